"""Pure aggregation rules on flat weight vectors."""
from __future__ import annotations

from typing import Sequence

import torch


def weighted_average(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_k w_k v_k / sum_k w_k, accumulated in the given order (fixed order => reproducible sums)."""
    if len(vectors) == 0:
        raise ValueError("cannot aggregate zero client updates")
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    w = torch.as_tensor(list(weights), dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum, got {w.tolist()}")
    w = w / w.sum()
    out = torch.zeros_like(vectors[0], dtype=torch.float64)
    for v, wk in zip(vectors, w):
        out.add_(v.to(torch.float64), alpha=float(wk))
    return out.to(vectors[0].dtype)


def sample_weighted_average(vectors: Sequence[torch.Tensor], num_samples: Sequence[int]) -> torch.Tensor:
    """FedAvg (McMahan et al. 2017): weights proportional to each client's training-set size."""
    return weighted_average(vectors, [float(n) for n in num_samples])


def average_leading_part(global_weights: torch.Tensor, parts: Sequence[torch.Tensor],
                         num_samples: Sequence[int]) -> torch.Tensor:
    """A copy of ``global_weights`` whose first ``len(parts[0])`` entries (a shared body uploaded alone)
    are the sample-weighted average of ``parts``; the rest (a head kept elsewhere) is unchanged."""
    out = global_weights.clone()
    out[: parts[0].numel()] = sample_weighted_average(parts, num_samples)
    return out
