"""The CUDA paths: every method on a GPU as on the CPU, what a training step syncs and copies, deterministic
runs, mixed precision, resume across devices and the runtimes sharing one GPU.

Marked ``gpu``: skipped without a CUDA device. Stand-in data only, and nothing beyond plain pytest: the
checks are benchmarks/gpu_checks.py's (which scripts/device-check.sh runs without pytest), asserted here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedguide.fl.engine import TIMING_METRICS, Experiment
from fedguide.fl.run_folder import RunFolder
from fedguide.fl.setup import prepare
from fedguide.methods import METHODS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]


import gpu_checks as checks  # noqa: E402  (benchmarks/, on the tests' pythonpath)

SMOKE = checks.HASHES.SMOKE


def expect(result):
    """gpu_checks' (status, sentence, numbers): a pass, else a failure with the sentence (the numbers and the
    tolerance they missed, or why the check could not run: on a GPU host with fedguide installed every check
    runs, so one that did not is a failure too, never a skip)."""
    status, sentence, _ = result
    assert status == "ok", sentence


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    return checks.Pipelines(tmp_path_factory.mktemp("pipelines"))


def config(*overrides: str, base: Path = SMOKE):
    """configs/smoke.yaml (or ``base``) on its stand-in data, with overrides."""
    return checks.build(base, list(overrides), quick=False)


def run(tmp_path: Path, cfg, name: str, resume: bool = False) -> list[dict]:
    run_dir = tmp_path / name
    Experiment(prepare(cfg), run_dir, log=lambda s: None).run(resume=resume)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in rows]


def close(a: float, b: float, rtol: float = 1e-3) -> bool:
    return abs(a - b) <= 1e-4 + rtol * abs(b)


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_agrees_with_its_cpu_run(tmp_path, pipelines, method):
    """One round on CUDA and on the CPU, TF32 off: first-round loss and final weights within gpu_checks'
    LOSS_TOL and WEIGHT_TOL."""
    expect(checks.agreement(method, "cuda", pipelines, tmp_path, quick=False))


def test_a_training_step_syncs_and_copies_no_more_than_the_simulated_device_counts(tmp_path):
    """Host syncs (torch.cuda's sync debug mode) and host-to-device bytes per optimiser step at most the
    simulated device's, and round 2 copies no more than its index order plus 64 KiB."""
    expect(checks.transfers("cuda", tmp_path, quick=False))


def test_deterministic_runs_repeat_exactly_in_fresh_processes(tmp_path):
    procs = checks.start_determinism("cuda", False, tmp_path)
    expect(checks.finish_determinism(procs, deadline=float("inf")))


def test_deterministic_runs_repeat_exactly_in_one_process(tmp_path):
    cfg = config("train.device=cuda", "train.deterministic=true", "train.augment=crop")
    assert run(tmp_path, cfg, "a") == run(tmp_path, cfg, "b")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_finite(tmp_path, precision):
    expect(checks.precision(precision, "cuda", tmp_path, quick=False))


@pytest.mark.parametrize("method", ["fedbabu", "fedrep"])
def test_head_training_on_features_computed_once_matches_the_path_through_the_body_on_the_gpu(
        tmp_path, monkeypatch, method):
    import fedguide.methods._personalise as personalise
    cfg = config("train.device=cuda", "eval.mode=both", f"method.name={method}")
    with checks.no_tf32():
        fast = run(tmp_path, cfg, "fast")
        monkeypatch.setattr(personalise, "features_reusable", lambda *_: False)
        slow = run(tmp_path, cfg, "slow")
    for f, s in zip(fast, slow):  # the same arithmetic in another order
        assert close(f["loss"], s["loss"]), (f["loss"], s["loss"])
        assert abs(f["personal_accuracy"] - s["personal_accuracy"]) <= 0.02


def test_resume_from_a_gpu_checkpoint_on_the_cpu(tmp_path):
    with checks.no_tf32():
        whole = run(tmp_path, config("train.device=cuda", "train.rounds=3"), "whole")
        run(tmp_path, config("train.device=cuda", "train.rounds=2"), "split")
    run_dir = tmp_path / "split"
    text = (run_dir / "config.yaml").read_text().replace("device: cuda", "device: cpu").replace("rounds: 2", "rounds: 3")
    (run_dir / "config.yaml").write_text(text)
    Experiment(prepare(RunFolder(run_dir).read_config()), run_dir, log=lambda s: None).run(resume=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # rounds 1-2 on CUDA, round 3 on the CPU from CUDA's checkpoint: round 3's loss as the all-CUDA run's
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert close(rows[-1]["loss"], whole[-1]["loss"], rtol=1e-2), (rows[-1]["loss"], whole[-1]["loss"])


def test_the_worker_pool_shares_the_gpu(tmp_path):
    one = run(tmp_path, config("train.device=cuda", "train.deterministic=true"), "one")
    pool = run(tmp_path, config("train.device=cuda", "train.deterministic=true", "runtime.workers=2",
                                "runtime.threads_per_worker=1"), "pool")
    # the same clients on the same kernels, in two processes instead of one
    assert [r["clients"] for r in pool] == [r["clients"] for r in one]
    for p, o in zip(pool, one):
        assert close(p["loss"], o["loss"]), (p["loss"], o["loss"])


def test_flower_sim_actors_share_the_gpu(tmp_path):
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    rows = run(tmp_path, config("train.device=cuda", "runtime.name=flower-sim", "runtime.workers=2"), "sim")
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)


def test_compiled_model_gives_the_eager_result(tmp_path):
    with checks.no_tf32():
        eager = run(tmp_path, config("train.device=cuda", "train.rounds=1"), "eager")
        compiled = run(tmp_path, config("train.device=cuda", "train.rounds=1", "train.compile=true"), "compiled")
    # compiled kernels fuse and reorder float32 sums: close, not equal
    assert close(compiled[0]["loss"], eager[0]["loss"], rtol=1e-2), (compiled[0]["loss"], eager[0]["loss"])
