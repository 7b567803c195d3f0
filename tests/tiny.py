"""Tiny in-process runs shared by the tests: 8x8 digits, an MLP, a few clients, a second a run."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from fedguide.config import Config, build_config
from fedguide.fl.engine import TIMING_METRICS, Experiment
from fedguide.fl.setup import prepare

BASE = {
    "data": {"name": "digits"},
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
    "model": {"name": "mlp"},
    "method": {"name": "fedavg"},
    "clients": {"num": 4, "per_round": 2},
    "train": {"rounds": 3, "epochs": 1, "batch_size": 32, "lr": 0.05},
    "runtime": {"workers": 1, "threads_per_worker": 1},
    "seed": 1,
}


def tiny_raw(*layers: dict, **over) -> dict:
    """BASE with each layer, then ``over``, merged in: a section given as a dict updates the
    section's keys (``train={"rounds": 2}``), except ``method``, which replaces it whole."""
    raw = copy.deepcopy(BASE)
    for layer in (*layers, over):
        for k, v in layer.items():
            merge = isinstance(v, dict) and isinstance(raw.get(k), dict) and k != "method"
            raw[k] = {**raw[k], **v} if merge else v
    return raw


def tiny_config(*layers: dict, **over) -> Config:
    return build_config(tiny_raw(*layers, **over))


def run_tiny(tmp_path: Path, cfg: Config, name: str = "run", resume: bool = False, log=lambda s: None):
    """(summary, metrics rows, run dir) of one in-process run."""
    run_dir = Path(tmp_path) / name
    summary = Experiment(prepare(cfg), run_dir, log=log).run(resume=resume)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, run_dir


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in rows]


class Crash(Exception):
    """Raised from the engine's log to simulate a crash right after a round is on disk."""


def crash_after(rounds: int):
    lines = []

    def log(line):  # the engine logs a round after its checkpoint and state commit
        lines.append(line)
        if len(lines) == rounds:
            raise Crash
    return log

# Method parameters the every-method sweeps set: defaults that are the papers' sizes
# but cost minutes on the sweeps' tiny data (FedEMA's BYOL heads, 4096 hidden and 2048 out, and its probe's
# 200 epochs at every evaluation; 20 run the same code).
SWEEP_OVERRIDES = {"fedema": {"hidden_dim": 64, "projection_dim": 32, "probe_samples": 500, "probe_epochs": 20}}

# Methods built on a guidance model: their own tests run them end to end on tiny pipelines; the
# every-method sweeps (8x8 digits has no pixels for an image model; smoke.yaml on the embedded models
# costs minutes each) leave them out.
GUIDED_METHODS = {"align_features", "centroid_finetune", "fedavg_sm", "fedcado", "feddda", "feddf", "feddifrc",
                  "feddisc", "rscfed", "sd_gen", "semanticfl", "semifl", "zero_shot"}
