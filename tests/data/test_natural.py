"""The ``natural`` partition (clients own whole groups: writers, or domains) on hand-made group arrays, and
on the embedded domain data through ``prepare``.

The one-writer-per-client order follows LEAF's clients, writers sorted by name (TalwalkarLab/leaf,
models/utils/model_utils.py line 45); ``groups: N`` is LEAF's sampling of writers (data/utils/sample.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedguide.config import build_config
from fedguide.data.federated import FederatedData
from fedguide.data.partition import PARTITIONS
from fedguide.data.scenarios import make_scenario
from fedguide.data.sources.base import DatasetSplits
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError

# 7 groups of sizes 3, 1, 4, 2, 5, 2, 3 (ids 0..6 in that order), interleaved so a group's samples are not
# contiguous; labels are arbitrary.
SIZES = [3, 1, 4, 2, 5, 2, 3]
GROUPS = np.array([g for g, n in enumerate(SIZES) for _ in range(n)])[np.random.default_rng(5).permutation(20)]
LABELS = np.arange(20) % 4
NAMES = [f"w{g}" for g in range(7)]


def natural(num_clients, seed=0, ids=GROUPS, **params):
    return make_scenario(PARTITIONS.parse("natural", params, "partition"), LABELS, num_clients, seed,
                         groups=ids, group_names=NAMES).clients


def owned(parts, groups=GROUPS):
    return [sorted(set(groups[p].tolist())) for p in parts]


def test_as_many_clients_as_groups_gives_client_k_group_k_for_every_seed():
    for seed in (0, 1, 2):
        parts = natural(7, seed)
        assert owned(parts) == [[g] for g in range(7)]
        # every sample of group k, and nothing else
        assert [p.tolist() for p in parts] == [np.flatnonzero(GROUPS == g).tolist() for g in range(7)]


def test_fewer_clients_deal_whole_groups_floor_or_ceil_seeded():
    parts = natural(3, seed=4)
    groups = owned(parts)
    # 7 groups over 3 clients: 3, 2, 2 (the first 7 mod 3 clients take the extra one)
    assert [len(g) for g in groups] == [3, 2, 2]
    assert sorted(sum(groups, [])) == list(range(7)), "every group to exactly one client"
    flat = np.concatenate(parts)
    assert sorted(flat.tolist()) == list(range(20)), "no sample dropped or shared"
    for p, gs in zip(parts, groups):  # clients hold whole groups
        assert len(p) == sum(SIZES[g] for g in gs)
    assert owned(natural(3, seed=4)) == groups
    assert any(owned(natural(3, seed=s)) != groups for s in range(5, 10)), "the deal depends on the seed"
    assert [len(g) for g in owned(natural(5, seed=0))] == [2, 2, 1, 1, 1]


def test_groups_option_draws_a_seeded_subset_first():
    parts = natural(4, seed=3, groups=4)
    drawn = owned(parts)
    assert all(len(g) == 1 for g in drawn)
    ids = [g[0] for g in drawn]
    assert ids == sorted(ids) and len(set(ids)) == 4, "K = groups: client k owns the k-th drawn group"
    assert owned(natural(4, seed=3, groups=4)) == drawn
    draws = {tuple(g[0] for g in owned(natural(4, seed=s, groups=4))) for s in range(8)}
    assert len(draws) > 1, "which groups are drawn depends on the seed"
    # the samples of groups left out belong to no client
    left_out = set(range(7)) - set(ids)
    assert not set(np.concatenate(parts).tolist()) & set(np.flatnonzero(np.isin(GROUPS, list(left_out))).tolist())
    two = owned(natural(2, seed=3, groups=4))
    assert [len(g) for g in two] == [2, 2] and sorted(sum(two, [])) == ids, "then dealt like all groups"


def test_only_groups_with_training_samples_count():
    groups = np.where(GROUPS == 2, 6, GROUPS)  # group 2 has no sample left (say data.fraction dropped it)
    parts = natural(6, ids=groups)
    assert owned(parts, groups) == [[0], [1], [3], [4], [5], [6]]


def test_more_clients_than_groups_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"8 clients but 7 groups.*set clients.num to at most 7"):
        natural(8)
    with pytest.raises(ConfigError, match=r"5 clients but 4 groups \(partition.groups\).*raise partition.groups"):
        natural(5, groups=4)
    with pytest.raises(ConfigError, match=r"partition.groups=9 but the data has only 7 groups.*at most 7"):
        natural(3, groups=9)


def test_a_dataset_without_groups_or_domains_is_refused():
    with pytest.raises(ConfigError, match=r"natural.*digits_domains.*neither"):
        natural(2, ids=None)
    cfg = build_config({"data": {"name": "digits"}, "partition": {"name": "natural"}, "model": {"name": "mlp"},
                        "clients": {"num": 2, "per_round": 2}})
    with pytest.raises(ConfigError, match="neither"):
        prepare(cfg)


def splits_with(groups=None, names=None, domains=None):
    n = len(LABELS)
    dom = None if domains is None else torch.as_tensor(domains)
    return DatasetSplits(torch.zeros(n, 1), torch.as_tensor(LABELS), torch.zeros(2, 1),
                         torch.zeros(2, dtype=torch.int64),
                         ["a", "b", "c", "d"], train_groups=None if groups is None else torch.as_tensor(groups),
                         group_names=names, train_domains=dom,
                         test_domains=None if dom is None else torch.zeros(2, dtype=torch.int64),
                         domain_names=None if dom is None else ["x", "y"])


def test_owner_groups_are_the_groups_else_the_domains():
    both = splits_with(GROUPS, NAMES, LABELS % 2)
    ids, names = both.owner_groups(np.array([0, 5]))
    assert ids.tolist() == GROUPS[[0, 5]].tolist() and names == NAMES
    ids, names = splits_with(domains=LABELS % 2).owner_groups()
    assert ids.tolist() == (LABELS % 2).tolist() and names == ["x", "y"]
    assert splits_with().owner_groups() == (None, None)
    with pytest.raises(ValueError, match="together"):
        splits_with(GROUPS, None)
    with pytest.raises(ValueError, match="int64 of shape"):
        splits_with(GROUPS[:5], NAMES)


def test_group_record_lists_each_clients_groups_when_none_is_split():
    splits = splits_with(GROUPS, NAMES)
    record = FederatedData(splits, natural(3, seed=4)).group_record()
    assert record["groups_per_client"] == [3, 2, 2]
    assert [sorted(c) for c in record["client_groups"]] == [[NAMES[g] for g in gs] for gs in owned(natural(3, seed=4))]
    split = FederatedData(splits, [np.arange(0, 10), np.arange(10, 20)]).group_record()
    assert "client_groups" not in split and len(split["groups_per_client"]) == 2
    assert FederatedData(splits_with(), [np.arange(20)]).group_record() == {}


def test_digits_domains_natural_gives_one_domain_per_client():
    raw = {"data": {"name": "digits_domains", "image_size": 16, "per_class": 6},
           "partition": {"name": "natural"}, "model": {"name": "mlp"}, "clients": {"num": 3, "per_round": 3}, "seed": 1}
    data = prepare(build_config(raw)).data
    domains = data.splits.train_domains.numpy()
    assert [sorted(set(domains[p].tolist())) for p in data.client_indices] == [[0], [1], [2]]
    assert [len(p) for p in data.client_indices] == np.bincount(domains).tolist()
    with pytest.raises(ConfigError, match=r"4 clients but 3 groups.*\(uci, fonts, mnistm_like\).*at most 3"):
        prepare(build_config({**raw, "clients": {"num": 4, "per_round": 4}}))
