"""The federation a run trains on: shared in-memory tensors plus per-client index lists."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from fedguide.core.seeding import numpy_rng
from fedguide.data.partition import client_class_counts
from fedguide.data.sources.base import DatasetSplits


def stratified_fraction(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of a per-class subsample keeping each class's share (at least one sample per class)."""
    if fraction >= 1.0:
        return np.arange(len(labels))
    keep = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        n = max(1, int(round(fraction * len(idx))))
        keep.append(rng.choice(idx, size=n, replace=False))
    return np.sort(np.concatenate(keep))


def public_pool(labels: np.ndarray, fraction: float, public_seed: int) -> np.ndarray:
    """The stratified public pool of ``data.public_fraction``: fixed by ``public_seed``, not the run seed, so
    every run (and the embedded guidance models' pretraining) holds out the same samples."""

    if fraction <= 0:
        return np.empty(0, np.int64)
    return stratified_fraction(labels, fraction, numpy_rng(public_seed, "public"))


@dataclass
class ClientData:
    """One client's view: indices into the shared tensors; no copy is made per client or per round."""

    client_id: int
    indices: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    labeled: bool = True  # false in semi-supervised scenarios: the client must not train on y

    def __len__(self) -> int:
        return int(self.indices.numel())

    def labels(self) -> torch.Tensor:
        return self.y[self.indices]

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels(), minlength=self.num_classes)


@dataclass
class FederatedData:
    splits: DatasetSplits
    client_indices: list[np.ndarray]
    # Held out from every client: the public pool (data.public_fraction) and the server's labeled set
    # of a semi-supervised scenario; both index the training tensors.
    public_indices: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    server_indices: Optional[np.ndarray] = None
    clients_labeled: bool = True

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def num_classes(self) -> int:
        return self.splits.num_classes

    def client(self, client_id: int) -> ClientData:
        return ClientData(
            client_id=client_id,
            indices=torch.from_numpy(self.client_indices[client_id]),
            x=self.splits.train_x,
            y=self.splits.train_y,
            num_classes=self.num_classes,
            labeled=self.clients_labeled,
        )

    def class_counts(self) -> np.ndarray:
        return client_class_counts(self.splits.train_y.numpy(), self.client_indices, self.num_classes)

    def domain_counts(self) -> Optional[np.ndarray]:
        """[K, D] samples of each domain per client, or None for data without domains."""
        if self.splits.train_domains is None:
            return None
        return client_class_counts(self.splits.train_domains.numpy(), self.client_indices,
                                   len(self.splits.domain_names))

    def summary(self) -> dict:
        counts = self.class_counts()
        sizes = counts.sum(axis=1)
        return {
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "train_samples_used": int(sizes.sum()),
            "test_samples": int(len(self.splits.test_y)),
            "client_sizes": {"min": int(sizes.min()), "max": int(sizes.max()), "mean": float(sizes.mean())},
            "classes_per_client": {
                "min": int((counts > 0).sum(1).min()), "max": int((counts > 0).sum(1).max())
            },
        }
