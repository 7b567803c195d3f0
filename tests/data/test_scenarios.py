"""Domain shift, disjoint classes and the labeled-server scenario, on hand-made label/domain arrays."""
from __future__ import annotations

import numpy as np
import pytest

from fedguide.data.partition import PARTITIONS
from fedguide.data.scenarios import clients_per_domain, make_scenario
from fedguide.registry import ConfigError, Registry

# 4 domains of sizes 100, 40, 60, 80; labels cycle 0..9 inside each domain.
SIZES = {"mnist": 100, "usps": 40, "svhn": 60, "synthdigits": 80}
NAMES = list(SIZES)
DOMAINS = np.concatenate([np.full(n, d) for d, n in enumerate(SIZES.values())])
LABELS = np.concatenate([np.arange(n) % 10 for n in SIZES.values()])


def parsed(name, raw):
    """A ``partition:`` section as a resolved config holds it: the entry and its parsed parameters."""
    return PARTITIONS.parse(name, raw, "partition")


def scenario(name, num_clients, seed=0, **params):
    return make_scenario(parsed(name, params), LABELS, num_clients, seed, DOMAINS, NAMES)


def test_domain_assign_and_fraction_as_in_the_digits_setting():
    # FedDifRC's Digits split: M:1, U:4, SV:3, SY:2 clients, each holding 10 % of its domain
    part = scenario("domain", 10, assign={"mnist": 1, "usps": 4, "svhn": 3, "synthdigits": 2}, fraction=0.1)
    doms = [set(DOMAINS[p]) for p in part.clients]
    assert doms == [{0}] + [{1}] * 4 + [{2}] * 3 + [{3}] * 2
    assert [len(p) for p in part.clients] == [10] + [4] * 4 + [6] * 3 + [8] * 2
    flat = np.concatenate(part.clients)
    assert len(flat) == len(set(flat)), "clients of a domain hold disjoint slices"
    assert part.clients_labeled and part.server is None


def test_domain_defaults_spread_clients_evenly_and_split_each_domain():
    part = scenario("domain", 6)  # 6 clients over 4 domains: 2, 2, 1, 1
    doms = [int(DOMAINS[p][0]) for p in part.clients]
    assert doms == [0, 0, 1, 1, 2, 3]
    assert sorted(np.concatenate(part.clients)) == list(range(len(LABELS))), "every sample is used once"
    assert clients_per_domain(None, NAMES, 7) == [2, 2, 2, 1]


@pytest.mark.parametrize("params, num, fix", [
    ({"assign": {"mnist": 5, "mnistm": 5}}, 10, "unknown domain"),
    ({"assign": {"mnist": 5, "usps": 4}}, 10, "make them equal"),
    ({"assign": {"usps": 4, "mnist": 6}, "fraction": 0.3}, 10, "lower partition.fraction"),
    ({}, 3, "raise clients.num"),
])
def test_domain_errors_name_the_fix(params, num, fix):
    with pytest.raises(ConfigError, match=fix):
        scenario("domain", num, **params)


def test_domain_scenarios_need_domains():
    with pytest.raises(ConfigError, match="needs a dataset with domains"):
        make_scenario(parsed("domain", {}), LABELS, 4, 0)


def test_feature_skew_is_one_whole_domain_per_client():
    part = scenario("feature_skew", 4)
    assert [set(DOMAINS[p]) for p in part.clients] == [{0}, {1}, {2}, {3}]
    assert [len(p) for p in part.clients] == list(SIZES.values())
    half = scenario("feature_skew", 4, fraction=0.5)
    assert [len(p) for p in half.clients] == [n // 2 for n in SIZES.values()]
    with pytest.raises(ConfigError, match="set clients.num to 4"):
        scenario("feature_skew", 5)


def test_disjoint_classes_hand_out_whole_classes_once():
    labels = np.repeat(np.arange(60), 3)  # FedCADO: 60 classes -> 6 clients x 10
    parts = make_scenario(parsed("disjoint_classes", {"shuffle": False}), labels, 6, 0).clients
    assert [sorted(set(labels[p])) for p in parts] == [list(range(10 * i, 10 * i + 10)) for i in range(6)]
    shuffled = make_scenario(parsed("disjoint_classes", {}), labels, 6, 0).clients
    sets = [set(labels[p]) for p in shuffled]
    assert all(len(s) == 10 for s in sets) and set().union(*sets) == set(range(60))
    assert sets != [set(labels[p]) for p in parts], "the seeded order differs from label order"
    with pytest.raises(ConfigError, match="lower partition.k"):
        make_scenario(parsed("disjoint_classes", {"k": 11}), labels, 6, 0)


def test_semi_supervised_server_domain_is_held_out_and_clients_unlabeled():
    part = scenario("semi_supervised", 3, server_domain="usps")
    assert set(DOMAINS[part.server]) == {1} and len(part.server) == 40
    assert [set(DOMAINS[p]) for p in part.clients] == [{0}, {2}, {3}]
    assert not part.clients_labeled
    assert not set(part.server) & set(np.concatenate(part.clients))


def test_semi_supervised_server_fraction_is_stratified():
    labels = np.repeat(np.arange(5), 20)
    part = make_scenario(parsed("semi_supervised", {"server_fraction": 0.2}), labels, 4, 0)
    assert np.bincount(labels[part.server]).tolist() == [4] * 5
    assert sum(len(p) for p in part.clients) == 80
    with pytest.raises(ConfigError, match="exactly one"):
        make_scenario(parsed("semi_supervised", {}), labels, 4, 0)


def test_scenarios_are_seeded():
    a = scenario("domain", 10, fraction=0.1, assign={"mnist": 1, "usps": 4, "svhn": 3, "synthdigits": 2})
    b = scenario("domain", 10, fraction=0.1, assign={"mnist": 1, "usps": 4, "svhn": 3, "synthdigits": 2})
    c = scenario("domain", 10, seed=1, fraction=0.1, assign={"mnist": 1, "usps": 4, "svhn": 3, "synthdigits": 2})
    assert all(np.array_equal(x, y) for x, y in zip(a.clients, b.clients))
    assert not all(np.array_equal(x, y) for x, y in zip(a.clients, c.clients))


def test_make_scenario_takes_the_parsed_parameters_as_they_are(monkeypatch):
    section = parsed("disjoint_classes", {"k": 2, "shuffle": False})
    monkeypatch.setattr(Registry, "parse_params", lambda *a: pytest.fail("the partition was parsed again"))
    labels = np.repeat(np.arange(6), 2)
    part = make_scenario(section, labels, 3, 0)
    assert [sorted(set(labels[p])) for p in part.clients] == [[0, 1], [2, 3], [4, 5]]
