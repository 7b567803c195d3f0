"""Every random stream is derived from (seed, purpose, round, client), never from a shared global
generator, so a resumed run, or clients trained in another order, draw exactly the same numbers."""
from __future__ import annotations

import numpy as np
import torch

PURPOSE = {"data": 1, "partition": 2, "sampling": 3, "client": 4, "model": 5, "public": 6,
           "personal": 7, "personal_test": 8, "test_subset": 9, "dropout": 10, "stragglers": 11,
           "validation": 12, "probe": 13}


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    words = np.random.SeedSequence([seed, PURPOSE[purpose], *keys]).generate_state(2, dtype=np.uint32)
    return int(words[0]) << 31 ^ int(words[1])


def numpy_rng(seed: int, purpose: str, *keys: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, purpose, *keys))


def torch_generator(seed: int, purpose: str, *keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, purpose, *keys))


def sample_clients(seed: int, round_: int, num_clients: int, per_round: int) -> list[int]:
    """The clients of a round, in ascending order (a fixed aggregation order)."""
    if per_round >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, "sampling", round_).choice(num_clients, size=per_round, replace=False)
    return sorted(int(c) for c in chosen)


def sample_subset(seed: int, purpose: str, round_: int, clients: list[int], count: int) -> list[int]:
    """``count`` of ``clients`` drawn from (seed, purpose, round), in ascending order."""
    if count <= 0:
        return []
    picked = numpy_rng(seed, purpose, round_).choice(len(clients), size=min(count, len(clients)), replace=False)
    return sorted(clients[int(i)] for i in picked)
