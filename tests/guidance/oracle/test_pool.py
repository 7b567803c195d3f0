"""The oracle's pool: the embedded models' pretraining pool of their datasets (as their model card records it),
else the run's public pool, else a ConfigError naming the fix; how many pool images clients hold is counted."""
import numpy as np
import pytest

from fedguide.data.federated import public_pool
from fedguide.guidance.embedded.pretrain.data import pool_indices
from fedguide.guidance.oracle.pool import embedded_pool_settings, oracle_pool, pool_note
from fedguide.registry import ConfigError
from tests.guidance.oracle.conftest import opened_run, oracle_config
from tests.tiny import tiny_config


def test_the_embedded_models_pool_as_their_card_records_it(tmp_path, fmnist_root):
    assert embedded_pool_settings() == {"public_fraction": 0.1, "public_seed": 0, "max_per_class": None}
    run = opened_run(oracle_config(fmnist_root, tmp_path / "c"), tmp_path / "a")
    pool = oracle_pool(run)
    labels = run.data.splits.train_y.numpy()
    assert pool.source == "embedded_pretraining_pool"
    assert np.array_equal(pool.indices, public_pool(labels, 0.1, 0))
    note = pool_note(pool, run)
    assert note["images"] == 10 and note["clients_hold"] == 10  # no public pool held out: the clients hold it


def test_pretraining_caps_the_pool_per_class_as_its_settings_say():
    labels = np.repeat(np.arange(10), 50)
    whole = public_pool(labels, 0.1, 0)
    capped = pool_indices(labels, 0.1, 0, max_per_class=2)
    assert np.array_equal(pool_indices(labels, 0.1, 0), whole) and len(capped) == 20
    assert np.array_equal(capped, np.sort(np.concatenate([whole[labels[whole] == c][:2] for c in range(10)])))


def test_a_run_holding_out_the_same_pool_gives_no_client_an_oracle_image(tmp_path, fmnist_root):
    cfg = oracle_config(fmnist_root, tmp_path / "c", data={"public_fraction": 0.1})
    run = opened_run(cfg, tmp_path / "a")
    pool = oracle_pool(run)
    assert np.array_equal(pool.indices, np.sort(run.data.public_indices)) and pool_note(pool, run)["clients_hold"] == 0


def test_other_datasets_use_the_runs_public_pool_or_name_the_fix(tmp_path):
    guidance = {"guidance": {"model": "oracle", "feature_cache": str(tmp_path / "c")}}
    with pytest.raises(ConfigError, match="data.public_fraction > 0"):
        oracle_pool(opened_run(tiny_config(guidance), tmp_path / "a"))
    run = opened_run(tiny_config(guidance, data={"name": "digits", "public_fraction": 0.2}), tmp_path / "b")
    pool = oracle_pool(run)
    assert pool.source == "run_public_pool" and np.array_equal(pool.indices, np.sort(run.data.public_indices))
    assert pool.settings["public_fraction"] == 0.2
