"""Host time of ``train.augment`` per batch: the kornia pipeline it replaced vs the batched recipes.

Before: kornia's ``AugmentationSequential(RandomCrop(size, padding=4), RandomHorizontalFlip(), [AutoAugment])``,
which draws its parameters on the host and cuts the images one by one. After: ``fedguide.data.augment``
(one draw and one gather for the crop and flip on the batch's device; kornia's AutoAugment after it).
For each recipe and image shape: median wall time of one batch of 64 [0, 1] images over ``--batches``
batches (after ``--warmup`` untimed ones; the generator seeded per batch, outside the clock), on one torch
thread, and the ATen operations one batch dispatches (the work the host issues to a device, per batch).
Ends each line with ``ratio=<before / after>``.

    .venv/bin/python benchmarks/augment_host_time.py [--batches 200] [--out benchmarks/results/augment_host_time.txt]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedguide.data.augment import build_augment

CASES = [("crop", (1, 28, 28)), ("crop", (3, 32, 32)), ("crop_flip", (1, 28, 28)), ("crop_flip", (3, 32, 32)),
         ("autoaugment", (3, 32, 32))]


def kornia_pipeline(name: str, input_shape: tuple[int, ...]):
    """The recipe as it was built with kornia before (the baseline, kept here only)."""
    import kornia.augmentation as K

    steps = [K.RandomCrop(tuple(input_shape[1:]), padding=4, fill=0.0)]
    if name in ("crop_flip", "autoaugment"):
        steps.append(K.RandomHorizontalFlip(p=0.5))
    if name == "autoaugment":
        from kornia.augmentation.auto import AutoAugment

        steps.append(AutoAugment("imagenet"))
    pipeline = K.AugmentationSequential(*steps)

    def augment(unit: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return pipeline(unit).clamp_(0.0, 1.0)

    return augment


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def measure(augment, x: torch.Tensor, batches: int, warmup: int) -> tuple[float, float]:
    """(median ms per batch, mean ATen operations per batch)."""
    for i in range(warmup):
        torch.manual_seed(10_000 + i)
        augment(x)
    times = []
    for i in range(batches):
        torch.manual_seed(i)
        start = time.perf_counter()
        augment(x)
        times.append(time.perf_counter() - start)
    ops = []
    for i in range(min(batches, 50)):
        torch.manual_seed(i)
        with _CountOps() as counter:
            augment(x)
        ops.append(counter.count)
    return 1000 * statistics.median(times), statistics.mean(ops)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = [f"# .venv/bin/python benchmarks/augment_host_time.py --batches {args.batches}   "
             f"(CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} torch thread)",
             f"batch {args.batch_size}, median over {args.batches} batches after {args.warmup} warm-up; "
             "ms = host wall time per batch (on a CPU it includes the arithmetic), ops = ATen operations "
             "dispatched per batch (mean)",
             f"{'recipe':<12} {'shape':<10} {'before ms':>10} {'after ms':>9} {'before ops':>11} "
             f"{'after ops':>10}  ratio"]
    print("\n".join(lines), flush=True)
    for name, shape in CASES:
        x = torch.rand((args.batch_size, *shape), generator=torch.Generator().manual_seed(0))
        before, before_ops = measure(kornia_pipeline(name, shape), x, args.batches, args.warmup)
        after, after_ops = measure(build_augment(name, shape), x, args.batches, args.warmup)
        line = (f"{name:<12} {'x'.join(map(str, shape)):<10} {before:>10.3f} {after:>9.3f} {before_ops:>11.1f} "
                f"{after_ops:>10.1f}  ratio={before / after:.2f}")
        print(line, flush=True)
        lines.append(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
