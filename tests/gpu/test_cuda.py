"""The CUDA paths: every method on a GPU, no data copied from the host per round, deterministic runs,
mixed precision, resume across devices and the runtimes sharing one GPU.

Marked ``gpu``: skipped without a CUDA device; scripts/device-check.sh runs them on a GPU host.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from fedguide.config import load_config
from fedguide.fl.engine import TIMING_METRICS, Experiment
from fedguide.fl.setup import load_run_config, prepare
from fedguide.methods import METHODS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs/smoke.yaml"


def _special() -> dict:
    """benchmarks/behaviour_hashes.py's config per method (the smoke config each family runs on)."""
    spec = importlib.util.spec_from_file_location("behaviour_hashes", REPO / "benchmarks/behaviour_hashes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SPECIAL


def method_config(name: str, *extra: str):
    config, overrides = _special().get(name, (SMOKE, []))
    if config == SMOKE and not any(o.startswith("method.name=") for o in overrides):
        overrides = overrides + [f"method.name={name}"]
    return load_config(config, overrides + list(extra))


def run(tmp_path: Path, cfg, name: str, resume: bool = False) -> list[dict]:
    run_dir = tmp_path / name
    Experiment(prepare(cfg), run_dir, log=lambda s: None).run(resume=resume)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in rows]


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_runs_on_the_gpu_as_on_the_cpu(tmp_path, method):
    gpu = run(tmp_path, method_config(method, "train.device=cuda"), "gpu")
    cpu = run(tmp_path, method_config(method, "train.device=cpu"), "cpu")
    assert len(gpu) == len(cpu)
    for g, c in zip(gpu, cpu):  # other kernels, other roundings: close, not equal
        assert g["loss"] is None or math.isfinite(g["loss"])
        assert abs(g["accuracy"] - c["accuracy"]) <= 0.1, (method, g["round"], g["accuracy"], c["accuracy"])


@pytest.mark.parametrize("method", ["fedbabu", "fedrep"])
def test_head_training_on_features_computed_once_matches_the_path_through_the_body_on_the_gpu(
        tmp_path, monkeypatch, method):
    import fedguide.methods._personalise as personalise
    cfg = method_config(method, "train.device=cuda", "eval.mode=both")
    fast = run(tmp_path, cfg, "fast")
    monkeypatch.setattr(personalise, "features_reusable", lambda *_: False)
    slow = run(tmp_path, cfg, "slow")
    for f, s in zip(fast, slow):
        assert abs(f["accuracy"] - s["accuracy"]) <= 0.02 and abs(f["personal_accuracy"] - s["personal_accuracy"]) <= 0.02


def test_a_round_copies_no_data_from_the_host(tmp_path, monkeypatch):
    """Only each epoch's index order (8 bytes a sample) goes host -> device in a round, no images."""
    cfg = load_config(SMOKE, ["train.device=cuda", "data.on_device=true", "train.rounds=2"])
    prepared = prepare(cfg)
    moved = []
    original = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "cuda":
            moved.append(self.numel() * self.element_size())
        return out

    exp = Experiment(prepared, tmp_path / "run", log=lambda s: moved.append("round"))
    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    exp.run()
    second = moved[moved.index("round") + 1: len(moved) - 1]  # the bytes of round 2
    index_bytes = 8 * sum(len(i) for i in prepared.data.client_indices) * cfg.train.epochs
    assert sum(second) <= index_bytes + 64 * 1024, (sum(second), index_bytes)


def test_deterministic_runs_repeat_exactly(tmp_path):
    cfg = load_config(SMOKE, ["train.device=cuda", "train.deterministic=true", "train.augment=crop"])
    assert run(tmp_path, cfg, "a") == run(tmp_path, cfg, "b")


def test_resume_from_a_gpu_checkpoint_on_the_cpu(tmp_path):
    whole = run(tmp_path, load_config(SMOKE, ["train.device=cuda", "train.rounds=3"]), "whole")
    run(tmp_path, load_config(SMOKE, ["train.device=cuda", "train.rounds=2"]), "split")
    run_dir = tmp_path / "split"
    text = (run_dir / "config.yaml").read_text().replace("device: cuda", "device: cpu").replace("rounds: 2", "rounds: 3")
    (run_dir / "config.yaml").write_text(text)
    Experiment(prepare(load_run_config(run_dir)), run_dir, log=lambda s: None).run(resume=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[-1]["accuracy"] - whole[-1]["accuracy"]) <= 0.02


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision):
    rows = run(tmp_path, load_config(SMOKE, ["train.device=cuda", f"train.precision={precision}",
                                             "train.channels_last=true"]), precision)
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["accuracy"] > 0.3


def test_the_worker_pool_shares_the_gpu(tmp_path):
    one = run(tmp_path, load_config(SMOKE, ["train.device=cuda", "train.deterministic=true"]), "one")
    pool = run(tmp_path, load_config(SMOKE, ["train.device=cuda", "train.deterministic=true", "runtime.workers=2",
                                             "runtime.threads_per_worker=1"]), "pool")
    assert [r["accuracy"] for r in pool] == pytest.approx([r["accuracy"] for r in one], abs=0.02)


def test_flower_sim_actors_share_the_gpu(tmp_path):
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    rows = run(tmp_path, load_config(SMOKE, ["train.device=cuda", "runtime.name=flower-sim", "runtime.workers=2"]),
               "sim")
    assert len(rows) == 3 and rows[-1]["accuracy"] > 0.3


def test_compiled_model_gives_the_eager_result(tmp_path):
    eager = run(tmp_path, load_config(SMOKE, ["train.device=cuda", "train.rounds=1"]), "eager")
    compiled = run(tmp_path, load_config(SMOKE, ["train.device=cuda", "train.rounds=1", "train.compile=true"]), "compiled")
    assert abs(compiled[0]["accuracy"] - eager[0]["accuracy"]) <= 0.02
