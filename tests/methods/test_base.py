"""The Method base: wire-size accounting, the registry, federation reshaping."""
import numpy as np
import pytest
import torch

from fedguide.methods import METHODS, Method, record_bytes
from fedguide.methods.classic.centralized import Centralized
from fedguide.methods.classic.fedavg import FedAvg
from fedguide.methods.classic.fedprox import FedProx, FedProxParams
from fedguide.methods.classic.local import Local
from fedguide.registry import NoParams


def test_record_bytes_tensor_plus_scalar():
    record = {"weights": torch.zeros(10, dtype=torch.float32), "num_samples": 5}
    assert record_bytes(record) == 48


@pytest.mark.parametrize("record, expected", [
    ({}, 0),
    ({"w": torch.zeros(10, dtype=torch.float64)}, 80),
    ({"w": torch.zeros(3, 4, dtype=torch.float16)}, 24),
    ({"w": torch.zeros(7, dtype=torch.int64), "a": 1, "b": 2.5}, 56 + 16),
    ({"nested": {"w": torch.zeros(2, dtype=torch.float32), "n": 3}, "x": 1}, 8 + 8 + 8),
])
def test_record_bytes_cases(record, expected):
    assert record_bytes(record) == expected


def test_methods_registry():
    names = METHODS.names()
    for name in ("fedavg", "fedprox", "local", "centralized"):
        assert name in names
    assert METHODS.get("fedavg").obj is FedAvg
    assert METHODS.get("fedprox").obj is FedProx
    assert METHODS.get("local").obj is Local
    assert METHODS.get("centralized").obj is Centralized
    assert METHODS.get("fedprox").params is FedProxParams
    assert METHODS.get("fedavg").params is NoParams
    for entry in METHODS.entries():
        assert issubclass(entry.obj, Method)
        assert entry.summary, f"{entry.name} has no summary"


def test_centralized_federation_merges_and_sorts():
    parts = [np.array([5, 9], dtype=np.int64), np.array([0, 7], dtype=np.int64), np.array([3], dtype=np.int64)]
    merged = Centralized.federation(parts)
    assert isinstance(merged, list) and len(merged) == 1
    assert merged[0].dtype == np.int64
    assert np.array_equal(merged[0], np.array([0, 3, 5, 7, 9]))


def test_centralized_federation_with_empty_client():
    merged = Centralized.federation([np.array([4, 1], dtype=np.int64), np.empty(0, dtype=np.int64)])
    assert np.array_equal(merged[0], np.array([1, 4]))


def test_default_federation_is_identity():
    parts = [np.array([1, 2]), np.array([0])]
    assert FedAvg.federation(parts) is parts


def test_default_aggregate_is_sample_weighted():
    method = FedAvg(NoParams(), run=None)
    uploads = [{"weights": torch.tensor([1.0, 2.0]), "num_samples": 1},
               {"weights": torch.tensor([3.0, 6.0]), "num_samples": 3}]
    out = method.aggregate(1, torch.zeros(2), uploads)
    assert torch.allclose(out, torch.tensor([2.5, 5.0]))


def test_local_aggregate_keeps_global_and_sends_nothing():
    method = Local(NoParams(), run=None)
    g = torch.tensor([1.0, 2.0])
    assert method.aggregate(1, g, [{"num_samples": 3}]) is g
    assert method.server_payload(1, 0, g) == {}


def test_load_server_state_rejects_unexpected_state():
    method = FedAvg(NoParams(), run=None)
    method.load_server_state({})
    with pytest.raises(ValueError, match="no server state"):
        method.load_server_state({"x": torch.zeros(1)})


def test_a_regulariser_on_a_method_with_its_own_loop_is_refused(tmp_path):
    """FedRep trains in its own loop (Method.fit): a dw term would be dropped, so composing is an error."""
    from fedguide.fl.setup import open_run, prepare
    from fedguide.registry import ConfigError
    from tests.tiny import tiny_config

    with pytest.raises(ConfigError, match=r"regularizers \[dw\].*'FedRep' trains its clients in its own loop"):
        open_run(prepare(tiny_config(method={"name": "fedrep"}, regularizers=["dw"],
                                          model={"head_bias": False})), tmp_path)


@pytest.mark.parametrize("method, regs, said", [
    ("feddw", ["dw"], r"regularizers: \[dw\] would apply twice \(method 'FedDW' already trains with it\)"),
    ("fedavg", ["dw", {"name": "dw", "mu": 0.5}], r"regularizers: \[dw\] would apply twice \(it is listed twice\)")])
def test_a_regulariser_applied_twice_is_refused(tmp_path, method, regs, said):
    """Two dw terms would share their records (dw.sl) and add the term twice without a word."""
    from fedguide.fl.setup import open_run, prepare
    from fedguide.registry import ConfigError
    from tests.tiny import tiny_config

    with pytest.raises(ConfigError, match=said):
        open_run(prepare(tiny_config(method={"name": method}, regularizers=regs, model={"head_bias": False})),
                 tmp_path)
