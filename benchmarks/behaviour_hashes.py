"""Every registered method on a small config, one line each: the sha256 of its metrics without timings.

A refactoring that must not change behaviour is checked by running this before and after and
comparing the lines (``diff``). Methods that train on labeled clients run on configs/smoke.yaml; the
guided ones on the smoke config their family is made for (FedDifRC/SemanticFL/align_features on
smoke.yaml with the public slice their PCA bases need, the one-shot generators on
fedcado_smoke.yaml, FedDISC's family on feddisc_smoke.yaml), with the embedded guidance models.

    .venv/bin/python benchmarks/behaviour_hashes.py [--only NAME ...] > hashes.txt
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from fedguide.config import load_config
from fedguide.fl.engine import TIMING_METRICS, Experiment
from fedguide.fl.setup import prepare
from fedguide.methods import METHODS

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs/smoke.yaml"
# method -> (config, overrides) for the methods smoke.yaml cannot run as it is
SPECIAL = {
    "feddifrc": (SMOKE, ["data.public_fraction=0.1", "guidance.model=embedded"]),
    "semanticfl": (SMOKE, ["data.public_fraction=0.1", "guidance.model=embedded"]),
    "align_features": (SMOKE, ["data.public_fraction=0.1", "guidance.model=embedded"]),
    "feddda": (SMOKE, ["guidance.model=embedded", "method.pool_per_class=8", "method.steps=4",
                       "method.gen_batch_size=16"]),
    "fedcado": (REPO / "configs/fedcado_smoke.yaml", []),
    "sd_gen": (REPO / "configs/fedcado_smoke.yaml", ["method.name=sd_gen", "method.images_per_class=4",
                                                     "method.steps=4", "method.gen_batch_size=8",
                                                     "method.agg_epochs=5"]),
    "feddf": (REPO / "configs/fedcado_smoke.yaml", ["method.name=feddf", "method.local_epochs=5"]),
    **{name: (REPO / "configs/feddisc_smoke.yaml", [f"method.name={name}"])
       for name in ("feddisc", "centroid_finetune", "zero_shot", "fedavg_sm", "semifl", "rscfed")},
    # FedDW needs a bias-free head, which the config sets; the mapping layers are the ones it brought itself
    # before methods stopped changing the model, so its hash compares with the hashes of then.
    "feddw": (SMOKE, ["method.name=feddw", "model.head_bias=false", "model.mapping=[128, 128]"]),
    # Regularisers composed with a method: FedDW's term, payload, upload and server state beside the
    # method's own (MOON's per-round state, FedProx's gradient edit).
    **{f"{name}+dw": (SMOKE, [f"method.name={name}", "regularizers=[dw]", "model.head_bias=false"])
       for name in ("fedavg", "moon", "fedprox")},
}


def without_clock(row):
    """The row without what measures the machine: the engine's timings and a method's own seconds and
    throughputs (generation_seconds, images_per_second, ...), at any depth."""
    if isinstance(row, dict):
        return {k: without_clock(v) for k, v in row.items()
                if k not in TIMING_METRICS and not k.endswith("seconds") and not k.endswith("per_second")}
    return row


def metrics_hash(name: str) -> str:
    config, overrides = SPECIAL.get(name, (SMOKE, []))
    overrides = overrides + ([f"method.name={name}"] if not any(o.startswith("method.name=") for o in overrides)
                             and config == SMOKE else [])
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        Experiment(prepare(load_config(config, overrides)), Path(tmp) / "run", log=lambda s: None).run()
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    clean = [without_clock(r) for r in rows]
    return hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    for name in args.only or [*METHODS.names(), *(n for n in SPECIAL if n not in METHODS.names())]:
        try:
            print(f"{name:<18} {metrics_hash(name)}", flush=True)
        except Exception as err:  # a method that cannot run here is reported, the others go on
            print(f"{name:<18} error: {type(err).__name__}: {str(err).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
