"""Wall-clock timing shared by the benchmark scripts (CUDA work is synchronised before the clock is read)."""
from __future__ import annotations

import time

import torch


def synchronized_seconds(fn) -> float:
    """Wall time of one fn() call, with queued CUDA work finished before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def best_seconds(fn, repeat: int = 3, warmup: bool = True) -> float:
    """Best of ``repeat`` synchronised wall times of fn() (after one untimed call when ``warmup``)."""
    if warmup:
        fn()
    return min(synchronized_seconds(fn) for _ in range(repeat))
