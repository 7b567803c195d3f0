"""Client partitions: pure, seeded maps from a label array to one sorted int64 index array per client.

Every partition is registered in ``PARTITIONS`` with a pydantic Params model, so a config section
``partition: {name: dirichlet, alpha: 0.1}`` is validated before any data is touched.
All randomness comes from the ``rng`` handed in, so a seed fixes the split exactly.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fedguide.registry import ConfigError, NoParams, Registry

# The domain-shift and server-labeled scenarios (scenarios.py) register themselves here too.
PARTITIONS = Registry("partition", plugins=("fedguide.data.scenarios",))


def _sorted(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _class_indices(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    classes = np.unique(labels)
    return classes, [np.flatnonzero(labels == c) for c in classes]


@PARTITIONS.register("iid", params=NoParams, summary="uniform random split; sizes differ by at most 1")
def iid(labels: np.ndarray, num_clients: int, params: NoParams, rng: np.random.Generator) -> list[np.ndarray]:
    return _sorted(np.array_split(rng.permutation(len(labels)), num_clients))


class DirichletParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(0.5, gt=0)
    min_size: int = Field(10, ge=0)
    max_tries: int = Field(1000, ge=1)


@PARTITIONS.register("dirichlet", params=DirichletParams, summary="per class, proportions ~ Dir(alpha) over clients (NID1)")
def dirichlet(labels: np.ndarray, num_clients: int, params: DirichletParams, rng: np.random.Generator) -> list[np.ndarray]:
    """Label skew: each class is split over the clients by proportions drawn from Dir(alpha·1_K).

    The whole draw is repeated until every client holds at least ``min_size`` samples, because a
    client with a handful of samples makes local training (and batch norm) meaningless.
    """
    _, per_class = _class_indices(labels)
    fix = "lower partition.min_size, raise partition.alpha, or use fewer clients.num"
    if params.min_size * num_clients > len(labels):
        raise ConfigError(
            f"dirichlet: {num_clients} clients x min_size {params.min_size} exceeds the {len(labels)} samples; {fix}"
        )
    best = -1
    for _ in range(params.max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in per_class:
            idx = rng.permutation(idx)
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, params.alpha))) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        sizes = [sum(len(c) for c in p) for p in parts]
        best = max(best, min(sizes))
        if best >= params.min_size:
            return _sorted([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts])
    raise ConfigError(
        f"dirichlet: in the best of {params.max_tries} tries the smallest client got only {best} samples "
        f"(< min_size {params.min_size}); {fix}"
    )


class ShardsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int = Field(2, ge=1)


@PARTITIONS.register("shards", params=ShardsParams, summary="pathological: k label-sorted shards per client")
def shards(labels: np.ndarray, num_clients: int, params: ShardsParams, rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological non-IID split of the FedAvg paper (McMahan et al. 2017).

    Sort the samples by label, cut them into ``num_clients * k`` contiguous shards of equal size and
    give each client ``k`` shards chosen at random. Samples within a class are shuffled before the
    sort so a shard is a random subset of its class. When the sample count is not a multiple of the
    shard count, shards differ by one sample (nothing is dropped); a shard that straddles a class
    boundary holds two classes, so "at most k classes per client" is exact only when every class
    count is a multiple of the shard size (as for balanced data with a divisible client count).
    """
    count = num_clients * params.k
    if count > len(labels):  # some shards would be empty: clients with no data, or fewer shards than k
        raise ConfigError(f"partition shards: {num_clients} clients x k={params.k} = {count} shards, but only "
                          f"{len(labels)} training samples to cut them from; lower partition.k or clients.num to at "
                          f"most {len(labels)} shards in all, or use more data (data.fraction)")
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    pieces = np.array_split(order, count)
    owner = rng.permutation(num_clients * params.k).reshape(num_clients, params.k)
    return _sorted([np.concatenate([pieces[s] for s in row]) for row in owner])


class Nid2Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_biased: int = Field(6, ge=0)
    n_unbiased: int = Field(1, ge=0)


@PARTITIONS.register("nid2", params=Nid2Params, summary="n_biased single-class clients + n_unbiased all-class clients")
def nid2(labels: np.ndarray, num_clients: int, params: Nid2Params, rng: np.random.Generator) -> list[np.ndarray]:
    """NID2 (FedDifRC, SemanticFL): clients 0..n_biased-1 hold one class each, the rest hold all classes.

    Decision: with n_biased <= C the biased clients get distinct classes drawn at random (seeded);
    with more biased clients than classes, the classes cycle through one random permutation. Each
    class's shuffled samples are split equally among the clients holding it (its biased clients
    plus every unbiased client), so every sample belongs to exactly one client.
    """
    nb, nu = params.n_biased, params.n_unbiased
    if num_clients != nb + nu:
        raise ConfigError(
            f"nid2: clients.num is {num_clients} but partition.n_biased + partition.n_unbiased = {nb + nu}; "
            f"set clients.num to {nb + nu} or change n_biased/n_unbiased"
        )
    classes, per_class = _class_indices(labels)
    n_cls = len(classes)
    if nu == 0 and nb < n_cls:
        raise ConfigError(
            f"nid2: with partition.n_unbiased = 0, partition.n_biased must be >= the {n_cls} classes, "
            "else some classes belong to no client"
        )
    if nb <= n_cls:
        biased_cls = rng.choice(n_cls, size=nb, replace=False)
    else:
        biased_cls = rng.permutation(n_cls)[np.arange(nb) % n_cls]
    unbiased = list(range(nb, num_clients))
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(per_class):
        holders = [int(k) for k in np.flatnonzero(biased_cls == c)] + unbiased
        for k, chunk in zip(holders, np.array_split(rng.permutation(idx), len(holders))):
            parts[k].append(chunk)
    return _sorted([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts])


class LongtailParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rho: float = Field(100.0, ge=1)
    then: dict[str, Any] = Field(default_factory=lambda: {"name": "dirichlet", "alpha": 0.2})


def longtail_indices(labels: np.ndarray, rho: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of a long-tailed subsample: n_c = n_max · rho^(-c/(C-1)) (Cao et al. 2019).

    Classes are ordered by label; n_max is the smallest original class count so every class can
    supply its share. Each class keeps at least one sample, so the label space does not shrink.
    """
    classes, per_class = _class_indices(labels)
    n_max = min(len(idx) for idx in per_class) if per_class else 0
    denom = max(len(classes) - 1, 1)
    keep = [
        rng.choice(idx, size=max(1, int(round(n_max * rho ** (-c / denom)))), replace=False)
        for c, idx in enumerate(per_class)
    ]
    return np.sort(np.concatenate(keep)).astype(np.int64) if keep else np.empty(0, np.int64)


@PARTITIONS.register("longtail", params=LongtailParams, summary="long-tail the data (imbalance rho), then partition")
def longtail(labels: np.ndarray, num_clients: int, params: LongtailParams, rng: np.random.Generator) -> list[np.ndarray]:
    """Shape the training set to a long tail, then apply the ``then`` partition to what is left.

    Samples dropped by the shaping belong to no client (they are not used for training).
    """
    then = dict(params.then)
    then_name = then.pop("name", None)
    if not isinstance(then_name, str):
        raise ConfigError(f"partition.then needs a 'name'; valid choices: {', '.join(PARTITIONS.names())}")
    inner = PARTITIONS.parse_params(then_name, then, "partition.then")
    sub = longtail_indices(labels, params.rho, rng)
    parts = PARTITIONS.get(then_name).obj(labels[sub], num_clients, inner, rng)
    return _sorted([sub[p] for p in parts])


def client_class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """[K, C] int64 matrix: how many samples of each class every client holds."""
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for k, p in enumerate(parts):
        counts[k] = np.bincount(np.asarray(labels)[p], minlength=num_classes)[:num_classes]
    return counts
