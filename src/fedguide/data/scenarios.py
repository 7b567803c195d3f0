"""Scenarios beyond label skew: domain shift, disjoint label spaces, and a labeled server.

Like the label-skew partitions these are pure, seeded functions registered in ``PARTITIONS``; the
domain-aware ones (``needs_domains = True``) also receive every sample's domain id and the domain
names. Client order follows the data's domain order, so client k of a ``domain`` split always sits
in the same domain for every seed.

Decisions:
- ``domain``: each client of a domain takes a disjoint random slice of ``fraction`` of that domain's
  training data (FedBN / FedDifRC: Digits M:1, U:4, SV:3, SY:2 at 10 %); without ``fraction`` the
  domain's data is split evenly over its clients. Slices are drawn per domain, not stratified by
  class, as in the papers' code.
- ``feature_skew`` gives exactly one domain per client (clients.num = number of domains).
- ``disjoint_classes`` hands out whole classes in a seeded random order (``shuffle: false`` keeps the
  label order: client 0 gets classes 0..k−1, as in FedCADO's 6 × 10 split of 60 classes).
- ``semi_supervised`` keeps the server's labeled set out of every client, and marks the clients'
  data unlabeled; methods that train on client labels refuse such a run.
- ``natural`` (``needs_groups = True``) hands out whole groups: the data's own owners (FEMNIST's
  writers, ``DatasetSplits.train_groups``), or its domains where it has no groups. Only groups with
  training samples in the run's data count. ``groups: N`` first draws N of them without replacement
  (LEAF's sampling of writers, seeded by the run's partition seed). With clients.num equal to the
  number of groups, client k owns the k-th group in group order (FEMNIST: writers sorted by name, the
  order LEAF's ``read_dir`` gives its clients, models/utils/model_utils.py line 45), for every seed;
  with fewer clients, the groups are shuffled and dealt round-robin, so each client owns floor or
  ceil of G/K groups (the first G mod K clients one more). Groups are not split or resized: client
  sizes are the groups' own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.data.partition import PARTITIONS, _sorted
from fedguide.registry import ConfigError, Parsed


@dataclass
class Partition:
    """Client index arrays, plus the server's own labeled set where the scenario gives it one."""

    clients: list[np.ndarray]
    server: Optional[np.ndarray] = None
    clients_labeled: bool = True


def _require_domains(name: str, domains: Optional[np.ndarray]) -> np.ndarray:
    if domains is None:
        raise ConfigError(f"partition '{name}' needs a dataset with domains (e.g. data.name=digits_domains, "
                          "digit_benchmark, office_caltech10, domainnet); this dataset has none")
    return np.asarray(domains)


def _split_domain(idx: np.ndarray, n_clients: int, fraction: Optional[float], name: str,
                  rng: np.random.Generator) -> list[np.ndarray]:
    perm = rng.permutation(idx)
    if fraction is None:
        return list(np.array_split(perm, n_clients))
    if n_clients * fraction > 1.0 + 1e-9:
        raise ConfigError(f"domain '{name}' has {n_clients} clients × fraction {fraction} > 1 of its data; "
                          f"lower partition.fraction to at most {1.0 / n_clients:.4g} or give it fewer clients")
    size = int(np.floor(fraction * len(idx)))
    return [perm[i * size: (i + 1) * size] for i in range(n_clients)]


def clients_per_domain(assign: Optional[dict[str, int]], domain_names: list[str], num_clients: int) -> list[int]:
    """How many clients each domain gets: ``assign`` by name, or spread evenly (the first domains
    take the remainder)."""
    if assign is None:
        if num_clients < len(domain_names):
            raise ConfigError(f"{num_clients} clients cannot cover {len(domain_names)} domains "
                              f"({', '.join(domain_names)}); raise clients.num or set partition.assign")
        base, extra = divmod(num_clients, len(domain_names))
        return [base + (1 if d < extra else 0) for d in range(len(domain_names))]
    unknown = sorted(set(assign) - set(domain_names))
    if unknown:
        raise ConfigError(f"partition.assign names unknown domain(s) {unknown}; the data's domains are "
                          f"{domain_names}")
    counts = [int(assign.get(d, 0)) for d in domain_names]
    if sum(counts) != num_clients:
        raise ConfigError(f"partition.assign gives {sum(counts)} clients in all but clients.num is {num_clients}; "
                          "make them equal")
    return counts


class DomainParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    assign: Optional[dict[str, int]] = Field(
        None, description="clients per domain by name, e.g. {mnist: 1, usps: 4, svhn: 3, synthdigits: 2}; "
                          "default: spread evenly")
    fraction: Optional[float] = Field(
        None, gt=0.0, le=1.0, description="share of its domain's training data each client holds (disjoint); "
                                          "default: the domain's data split evenly over its clients")


@PARTITIONS.register("domain", params=DomainParams, summary="domain shift: clients per domain, each a slice of its domain")
def domain(labels: np.ndarray, num_clients: int, params: DomainParams, rng: np.random.Generator,
           domains: Optional[np.ndarray] = None, domain_names: Optional[list[str]] = None) -> list[np.ndarray]:
    dom = _require_domains("domain", domains)
    counts = clients_per_domain(params.assign, domain_names, num_clients)
    parts: list[np.ndarray] = []
    for d, (name, n) in enumerate(zip(domain_names, counts)):
        if n:
            parts += _split_domain(np.flatnonzero(dom == d), n, params.fraction, name, rng)
    return _sorted(parts)


domain.needs_domains = True


class FeatureSkewParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fraction: float = Field(1.0, gt=0.0, le=1.0, description="share of its domain each client holds")


@PARTITIONS.register("feature_skew", params=FeatureSkewParams, summary="one domain per client, same label space")
def feature_skew(labels: np.ndarray, num_clients: int, params: FeatureSkewParams, rng: np.random.Generator,
                 domains: Optional[np.ndarray] = None, domain_names: Optional[list[str]] = None) -> list[np.ndarray]:
    dom = _require_domains("feature_skew", domains)
    if num_clients != len(domain_names):
        raise ConfigError(f"feature_skew gives one domain per client: set clients.num to {len(domain_names)} "
                          f"(domains {', '.join(domain_names)}), or use partition.name=domain for several per domain")
    return _sorted([_split_domain(np.flatnonzero(dom == d), 1, params.fraction, name, rng)[0]
                    for d, name in enumerate(domain_names)])


feature_skew.needs_domains = True


class DisjointParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: Optional[int] = Field(None, ge=1, description="classes per client; default: num_classes // clients.num")
    shuffle: bool = Field(True, description="hand out classes in a seeded random order (false: label order)")


@PARTITIONS.register("disjoint_classes", params=DisjointParams, summary="clients hold disjoint sets of k classes")
def disjoint_classes(labels: np.ndarray, num_clients: int, params: DisjointParams,
                     rng: np.random.Generator) -> list[np.ndarray]:
    classes = np.unique(labels)
    k = params.k if params.k is not None else len(classes) // num_clients
    if k < 1 or k * num_clients > len(classes):
        raise ConfigError(f"disjoint_classes needs k × clients.num <= {len(classes)} classes (k={k}, "
                          f"clients.num={num_clients}); lower partition.k or clients.num")
    order = rng.permutation(classes) if params.shuffle else classes
    return _sorted([np.flatnonzero(np.isin(labels, order[i * k: (i + 1) * k])) for i in range(num_clients)])


class SemiSupervisedParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server_domain: Optional[str] = Field(None, description="the server holds this domain's training data, labeled")
    server_fraction: Optional[float] = Field(
        None, gt=0.0, lt=1.0, description="the server holds this stratified share of the training data, labeled")
    clients: Literal["auto", "iid", "feature_skew"] = Field(
        "auto", description="how the rest is split: auto = one domain per client where the data has domains, else iid")

    @model_validator(mode="after")
    def _one_source(self) -> "SemiSupervisedParams":
        if (self.server_domain is None) == (self.server_fraction is None):
            raise ValueError("set exactly one of server_domain and server_fraction")
        return self


@PARTITIONS.register("semi_supervised", params=SemiSupervisedParams,
                     summary="the server holds a labeled set (a domain or a share); clients hold unlabeled data")
def semi_supervised(labels: np.ndarray, num_clients: int, params: SemiSupervisedParams, rng: np.random.Generator,
                    domains: Optional[np.ndarray] = None, domain_names: Optional[list[str]] = None) -> Partition:
    n = len(labels)
    if params.server_domain is not None:
        dom = _require_domains("semi_supervised with server_domain", domains)
        if params.server_domain not in domain_names:
            raise ConfigError(f"partition.server_domain '{params.server_domain}' is not a domain of this data "
                              f"({', '.join(domain_names)})")
        server_mask = dom == domain_names.index(params.server_domain)
    else:
        server_mask = np.zeros(n, dtype=bool)
        for c in np.unique(labels):
            idx = np.flatnonzero(labels == c)
            server_mask[rng.choice(idx, size=max(1, int(round(params.server_fraction * len(idx)))), replace=False)] = True
    rest = np.flatnonzero(~server_mask)
    mode = params.clients
    if mode == "auto":
        mode = "feature_skew" if domains is not None else "iid"
    if mode == "feature_skew":
        dom = _require_domains("semi_supervised with clients=feature_skew", domains)
        names = [d for i, d in enumerate(domain_names) if (dom[rest] == i).any()]
        if num_clients != len(names):
            raise ConfigError(f"semi_supervised gives one client domain per client: set clients.num to {len(names)} "
                              f"(domains {', '.join(names)}), or set partition.clients=iid")
        clients = [rest[dom[rest] == domain_names.index(d)] for d in names]
    else:
        clients = list(np.array_split(rng.permutation(rest), num_clients))
    return Partition(_sorted(clients), np.sort(np.flatnonzero(server_mask)).astype(np.int64), clients_labeled=False)


semi_supervised.needs_domains = True


class NaturalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    groups: Optional[int] = Field(
        None, ge=1, description="first draw this many groups (writers, domains) at random, seeded, as LEAF samples "
                                "writers; default: every group with training samples")


@PARTITIONS.register("natural", params=NaturalParams,
                     summary="clients own whole groups (FEMNIST's writers, or domains): group k to client k")
def natural(labels: np.ndarray, num_clients: int, params: NaturalParams, rng: np.random.Generator,
            groups: Optional[np.ndarray] = None, group_names: Optional[list[str]] = None) -> list[np.ndarray]:
    if groups is None:
        raise ConfigError("partition 'natural' needs a dataset whose samples carry a group (a writer, as femnist's) "
                          "or a domain (e.g. data.name=digits_domains); this dataset has neither: choose such a "
                          "dataset or another partition (iid, dirichlet, ...)")
    ids = np.asarray(groups)
    present = np.unique(ids)  # in group order
    what = f"{len(present)} groups with training samples"
    if group_names is not None and len(present) <= 10:
        what += f" ({', '.join(group_names[g] for g in present)})"
    if params.groups is not None:
        if params.groups > len(present):
            raise ConfigError(f"partition.groups={params.groups} but the data has only {what}; lower "
                              f"partition.groups to at most {len(present)}")
        present = np.sort(rng.choice(present, size=params.groups, replace=False))
        what = f"{len(present)} groups (partition.groups)"
    if num_clients > len(present):
        raise ConfigError(f"partition 'natural' gives each client whole groups: {num_clients} clients but {what}; "
                          f"set clients.num to at most {len(present)}"
                          + ("" if params.groups is None else " or raise partition.groups"))
    if num_clients == len(present):
        owned = [present[k:k + 1] for k in range(num_clients)]
    else:
        order = rng.permutation(present)
        owned = [order[k::num_clients] for k in range(num_clients)]
    return _sorted([np.flatnonzero(np.isin(ids, own)) for own in owned])


natural.needs_groups = True


def make_scenario(partition: Parsed, labels: np.ndarray, num_clients: int, seed: int,
                  domains: Optional[np.ndarray] = None, domain_names: Optional[list[str]] = None,
                  groups: Optional[np.ndarray] = None, group_names: Optional[list[str]] = None) -> Partition:
    """Run ``partition`` (a resolved config's: the entry and its parsed parameters) seeded with ``seed``, check
    no client is empty. ``groups``: every sample's owner id (``DatasetSplits.owner_groups``), for the
    partitions that set ``needs_groups``."""
    if num_clients < 1:
        raise ConfigError(f"clients.num must be >= 1, got {num_clients}")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    fn, name = partition.entry.obj, partition.name
    extra = {"domains": domains, "domain_names": domain_names} if getattr(fn, "needs_domains", False) else {}
    if getattr(fn, "needs_groups", False):
        if groups is not None and len(groups) != len(labels):
            raise ValueError(f"groups has {len(groups)} entries for {len(labels)} labels")
        extra.update(groups=groups, group_names=group_names)
    out = fn(labels, num_clients, partition.params, np.random.default_rng(seed), **extra)
    result = out if isinstance(out, Partition) else Partition(out)
    empty = [k for k, p in enumerate(result.clients) if len(p) == 0]
    # A partition may opt in to empty clients by setting ``allow_empty = True`` on its function.
    if empty and not getattr(fn, "allow_empty", False):
        raise ConfigError(
            f"partition '{name}' left client(s) {empty} with no samples ({len(labels)} samples, "
            f"{num_clients} clients); use fewer clients.num or change the partition parameters"
        )
    return result
