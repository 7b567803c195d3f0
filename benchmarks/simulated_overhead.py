"""What `train.device: simulated` costs against the CPU it runs on: a tiny run (8x8 digits, an MLP, four
clients, two rounds of two epochs; personalised methods also fine-tune and score their clients) per method, on
the CPU and on the simulated device, alternated in one process so that drift in the machine's load hits both
alike. The simulated device runs the same kernels and adds its bookkeeping in Python per op (which storages
live on the device, syncs and copies counted, mixes refused), so on a model this small the ratio is that
bookkeeping's share; on a real model the kernels dwarf it.

Prints each method's median seconds and the ratio (simulated / CPU).

    .venv/bin/python benchmarks/simulated_overhead.py [--reps 5] [--methods fedavg fedbabu scaffold moon]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedguide.config import build_config
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.methods import METHODS


def config(method: str, device: str):
    personal = METHODS.get(method).obj.personal_evaluation
    return build_config({
        "data": {"name": "digits"}, "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        "model": {"name": "mlp"}, "method": {"name": method}, "clients": {"num": 4, "per_round": 4},
        "train": {"rounds": 2, "epochs": 2, "batch_size": 32, "lr": 0.05, "device": device},
        "eval": {"mode": "both" if personal else "global"},
        "runtime": {"workers": 1, "threads_per_worker": 1}, "seed": 3})


def timed_run(cfg, folder: Path) -> tuple[float, list]:
    t0 = time.perf_counter()
    Experiment(prepare(cfg), folder, log=lambda s: None).run()
    seconds = time.perf_counter() - t0
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return seconds, [r.get("accuracy") for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedbabu", "scaffold", "moon"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'method':<10} {'cpu s':>8} {'simulated s':>12} {'ratio':>6}   (medians of {args.reps}, alternated)")
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            times: dict[str, list[float]] = {"cpu": [], "simulated": []}
            for rep in range(args.reps + 1):
                order = ("cpu", "simulated") if rep % 2 else ("simulated", "cpu")
                accuracies = {}
                for device in order:
                    seconds, accuracies[device] = timed_run(config(method, device), Path(tmp) / f"{method}-{device}-{rep}")
                    if rep:  # the first pair warms up data, imports and caches
                        times[device].append(seconds)
                if accuracies["cpu"] != accuracies["simulated"]:
                    raise SystemExit(f"{method}: the simulated device computed other accuracies than the CPU")
            cpu, sim = (statistics.median(times[d]) for d in ("cpu", "simulated"))
            print(f"{method:<10} {cpu:8.2f} {sim:12.2f} {sim / cpu:6.2f}", flush=True)


if __name__ == "__main__":
    main()
