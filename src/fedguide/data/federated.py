"""The federation a run trains on: shared in-memory tensors plus per-client index lists."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
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


def validation_part(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of a per-class share held out for validation: each class gives round-half-up(fraction * its count)
    samples but keeps at least one for training (a class with one sample gives none)."""
    held = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        n = min(int(np.floor(fraction * len(idx) + 0.5)), len(idx) - 1)
        if n > 0:
            held.append(rng.choice(idx, size=n, replace=False))
    return np.sort(np.concatenate(held)) if held else np.empty(0, np.int64)


def cells(labels: torch.Tensor, domains: Optional[torch.Tensor], domain_names: Optional[list[str]]) -> np.ndarray:
    """One id per sample: its class, or its (class, domain) pair where the data has domains."""
    y = labels.numpy()
    return y if domains is None else y * len(domain_names) + domains.numpy()


def scored_test_subset(splits: DatasetSplits, fraction: float,
                       rng: np.random.Generator) -> tuple[DatasetSplits, Optional[np.ndarray]]:
    """The splits with only a stratified ``fraction`` of the test set (each class, and each (class, domain)
    pair where the data has domains, keeps its share, at least one sample), and the kept indices into the
    source's test set; ``fraction`` 1 returns the splits unchanged and None."""
    if fraction >= 1.0:
        return splits, None
    keep = stratified_fraction(cells(splits.test_y, splits.test_domains, splits.domain_names), fraction, rng)
    at = torch.from_numpy(keep)
    domains = None if splits.test_domains is None else splits.test_domains[at]
    groups = None if splits.test_groups is None else splits.test_groups[at]
    return replace(splits, test_x=splits.test_x[at], test_y=splits.test_y[at], test_domains=domains,
                   test_groups=groups), keep


def public_pool(labels: np.ndarray, fraction: float, public_seed: int) -> np.ndarray:
    """The stratified public pool of ``data.public_fraction``: fixed by ``public_seed``, not the run seed, so
    every run (and the embedded guidance models' pretraining) holds out the same samples."""

    if fraction <= 0:
        return np.empty(0, np.int64)
    return stratified_fraction(labels, fraction, numpy_rng(public_seed, "public"))


def _largest_remainder(total: int, shares: np.ndarray) -> np.ndarray:
    """``total`` items split in proportion to ``shares`` (whole numbers summing to ``total``): each gets the
    floor of its quota, the items left over go to the largest fractional parts (ties to the lower index)."""
    quota = total * shares / shares.sum()
    counts = np.floor(quota).astype(np.int64)
    left = total - int(counts.sum())
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:left]] += 1
    return counts


def personal_test_splits(train_cells: np.ndarray, client_indices: list[np.ndarray], test_cells: np.ndarray,
                         fraction: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's test split: every cell (a class, or a (class, domain) pair) of the test set, shuffled,
    with ``fraction`` of it handed out in proportion to the clients' training samples in that cell
    (largest remainders), so a client's test split has its training mix and each test sample goes to at
    most one client. Test samples of cells no client trains on go to nobody. Sorted indices into the test
    set, one array per client."""
    parts: list[list[np.ndarray]] = [[] for _ in client_indices]
    held = np.stack([np.bincount(train_cells[idx], minlength=int(max(train_cells.max(), test_cells.max())) + 1)
                     for idx in client_indices])
    for cell in range(held.shape[1]):
        pool = np.flatnonzero(test_cells == cell)
        shares = held[:, cell].astype(np.float64)
        if shares.sum() == 0 or len(pool) == 0:
            continue
        pool = rng.permutation(pool)
        counts = _largest_remainder(int(round(fraction * len(pool))), shares)
        for k, (a, b) in enumerate(zip(np.cumsum(counts) - counts, np.cumsum(counts))):
            parts[k].append(pool[a:b])
    return [np.sort(np.concatenate(p)) if p else np.empty(0, np.int64) for p in parts]


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
    # data.val_fraction: the training samples held out for validation (from the pool before the partition, or
    # from each client's share); None without a validation split.
    val_indices: Optional[np.ndarray] = None
    clients_labeled: bool = True
    # eval.test_subset below 1: the scored test samples' indices into the source's test set (the test
    # tensors hold only those); None = the whole test set.
    test_subset: Optional[np.ndarray] = None
    # Each client's split of the test set (indices into the test tensors) for personalised evaluation;
    # None unless eval.mode scores personalised models.
    personal_test: Optional[list[np.ndarray]] = None
    # Each client's classes in the partition (before a method's ``federation`` pools clients), for
    # eval.client_classes; None unless asked for.
    client_classes: Optional[dict[int, list[int]]] = None

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

    def personal_test_split(self, fraction: float, rng: np.random.Generator) -> list[np.ndarray]:
        """Every client's test split with its training mix of classes, and of domains where the data has them
        (``personal_test_splits``)."""
        s = self.splits
        return personal_test_splits(cells(s.train_y, s.train_domains, s.domain_names), self.client_indices,
                                    cells(s.test_y, s.test_domains, s.domain_names), fraction, rng)

    def domain_counts(self) -> Optional[np.ndarray]:
        """[K, D] samples of each domain per client, or None for data without domains."""
        if self.splits.train_domains is None:
            return None
        return client_class_counts(self.splits.train_domains.numpy(), self.client_indices,
                                   len(self.splits.domain_names))

    def group_record(self) -> dict:
        """partition.json's entries for data whose samples have owners (``DatasetSplits.train_groups``):
        ``groups_per_client``, how many groups each client holds samples of, and where no group is split
        between clients (the ``natural`` partition) ``client_groups``, each client's group names. Empty for
        data without groups (domains have their own ``domain_counts``)."""
        s = self.splits
        if s.train_groups is None:
            return {}
        ids = s.train_groups.numpy()
        held = [np.unique(ids[idx]) for idx in self.client_indices]
        record: dict = {"groups_per_client": [len(h) for h in held]}
        owned = np.concatenate(held) if held else np.empty(0, np.int64)
        if len(owned) == len(np.unique(owned)):
            record["client_groups"] = [[s.group_names[g] for g in h] for h in held]
        return record

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
