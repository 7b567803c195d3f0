"""FedDW's Fig. 8 in the report reads the run's checkpoint and model verified: a damaged file is an error
naming it, never a figure drawn from altered numbers."""
from __future__ import annotations

import numpy as np
import pytest

from fedguide.registry import ConfigError
from fedguide.report.feddw import dw_matrices
from fedguide.report.runs import load_run
from tests.tiny import run_tiny, tiny_config


@pytest.fixture(scope="module")
def dw_run(tmp_path_factory):
    cfg = tiny_config(model={"name": "mlp", "mapping": [16], "head_bias": False}, regularizers=["dw"],
                      train={"rounds": 2})
    return run_tiny(tmp_path_factory.mktemp("dw"), cfg)[2]


def test_the_matrices_are_the_runs_soft_labels_and_class_relations(dw_run):
    sl, cr = dw_matrices(load_run(dw_run))
    assert sl.shape == cr.shape == (10, 10)
    np.testing.assert_allclose(cr.sum(axis=1), 1.0, atol=1e-9)  # a softmax per row
    assert np.all(sl >= 0) and np.allclose(sl.sum(axis=1)[sl.sum(axis=1) > 0], 1.0, atol=1e-5)


@pytest.mark.parametrize("name", ["model.safetensors", "checkpoints/last.safetensors"])
def test_a_flipped_tensor_byte_is_refused_naming_the_file(dw_run, tmp_path, name):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(dw_run, copy)
    path = copy / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last tensor's last byte
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"damaged .*{name.split('/')[-1]}"):
        dw_matrices(load_run(copy))


def test_a_run_without_dw_has_no_matrices(tmp_path):
    run_dir = run_tiny(tmp_path, tiny_config(train={"rounds": 1}))[2]
    assert dw_matrices(load_run(run_dir)) is None
