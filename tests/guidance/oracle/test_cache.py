"""The oracle on disk: trained once and written sealed under its key; a later process reads it back (the same
features), a run keeps its own copy, a changed byte or another setting is never read."""
import json
import logging

import torch

from fedguide.guidance.oracle.cache import key_digest, load_oracle, oracle_key
from fedguide.guidance.oracle.loading import RUN_COPY, forget_oracles, oracle_model
from fedguide.guidance.oracle.pool import oracle_pool
from fedguide.guidance.oracle.training import OracleSettings
from tests.guidance.oracle.conftest import opened_run, oracle_config

QUICK = OracleSettings(min_steps=20, width=32)


def features(oracle, run):
    x = run.data.splits.unit_images(run.data.splits.train_x[:8]) * 2 - 1
    return oracle.image_encoder.embed(x)


def test_trained_once_then_read_back_from_the_cache_and_the_run_copy(tmp_path, fmnist_root):
    cfg = oracle_config(fmnist_root, tmp_path / "cache")
    run_a = opened_run(cfg, tmp_path / "a")
    first = oracle_model(cfg.guidance, run_a, QUICK)
    assert first.record["origin"] == "trained"
    digest = key_digest(oracle_key(run_a, oracle_pool(run_a), QUICK))
    cached = tmp_path / "cache" / "oracle" / f"fmnist-{digest}.safetensors"
    assert first.record["file"] == str(cached) and cached.is_file()
    assert (tmp_path / "a" / "guidance" / RUN_COPY).is_file()
    assert first.model_id == f"oracle@{digest}"
    want = features(first, run_a)

    forget_oracles()  # another process
    run_b = opened_run(cfg, tmp_path / "b")
    second = oracle_model(cfg.guidance, run_b, QUICK)
    assert second.record["origin"] == "cache" and torch.equal(features(second, run_b), want)
    assert second.record["pool_accuracy"] == first.record["pool_accuracy"]

    forget_oracles()
    cached.unlink()  # a resumed run or a worker process finds the run's own copy
    third = oracle_model(cfg.guidance, run_a, QUICK)
    assert third.record["origin"] == "run copy" and torch.equal(features(third, run_a), want)


def test_a_changed_byte_or_another_setting_is_never_read(tmp_path, fmnist_root, caplog):
    cfg = oracle_config(fmnist_root, tmp_path / "cache")
    run = opened_run(cfg, tmp_path / "a")
    oracle_model(cfg.guidance, run, QUICK)
    key = oracle_key(run, oracle_pool(run), QUICK)
    cached = tmp_path / "cache" / "oracle" / f"fmnist-{key_digest(key)}.safetensors"
    assert load_oracle(cached, key, QUICK) is not None
    other = oracle_key(run, oracle_pool(run), OracleSettings(min_steps=21, width=32))
    assert key_digest(other) != key_digest(key) and load_oracle(cached, other, QUICK) is None

    data = bytearray(cached.read_bytes())
    data[-3] ^= 0xFF  # a weight's byte
    cached.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="fedguide.guidance"):
        assert load_oracle(cached, key, QUICK) is None
    assert "cannot be trusted" in caplog.text

    forget_oracles()
    again = oracle_model(cfg.guidance, opened_run(cfg, tmp_path / "b"), QUICK)
    assert again.record["origin"] == "trained" and load_oracle(cached, key, QUICK) is not None


def test_the_key_names_the_pool_and_the_settings(tmp_path, fmnist_root):
    cfg = oracle_config(fmnist_root, tmp_path / "cache")
    run = opened_run(cfg, tmp_path / "a")
    key = oracle_key(run, oracle_pool(run), QUICK)
    assert key["dataset"] == "fmnist" and "root" not in key["data"]
    assert key["pool"]["source"] == "embedded_pretraining_pool" and len(key["pool"]["indices_sha256"]) == 64
    assert key["settings"] == json.loads(json.dumps(QUICK.as_dict()))


def test_a_run_draws_its_pool_once_however_often_a_method_looks_the_oracle_up(tmp_path, fmnist_root, monkeypatch):
    """A frozen image encoder reaches the oracle on every batch: the run's pool and key are computed once."""
    import fedguide.guidance.oracle.loading as loading

    drawn = []
    real = loading.oracle_pool
    monkeypatch.setattr(loading, "oracle_pool", lambda run: drawn.append(run) or real(run))
    cfg = oracle_config(fmnist_root, tmp_path / "cache")
    run = opened_run(cfg, tmp_path / "a")
    first = oracle_model(cfg.guidance, run, QUICK)
    assert all(oracle_model(cfg.guidance, run, QUICK) is first for _ in range(5)) and len(drawn) == 1
    other = opened_run(cfg, tmp_path / "b")  # another run: its own pool draw, the same oracle
    assert oracle_model(cfg.guidance, other, QUICK) is first and len(drawn) == 2
