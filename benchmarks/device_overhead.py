"""What the device layer costs a CPU run: one client's round (FedAvg, FMNIST CNN) with batches gathered
through ``DeviceData`` (the path every run takes now) against the plain host gather the loop used before,
alternated in one process so that drift in the machine's load hits both alike.

Prints the median time of each and their ratio (device layer / plain); the target is 1.00 ± 0.03.

    .venv/bin/python benchmarks/device_overhead.py [--reps 10] [--fraction 0.1]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedguide.config import load_config
from fedguide.fl.client_step import run_client
from fedguide.fl.setup import open_run, prepare

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fraction", type=float, default=0.1)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(REPO / "configs/smoke.yaml", [f"data.fraction={args.fraction}", "clients.num=2",
                                                    "clients.per_round=2", "train.device=cpu"])
    prepared = prepare(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        ctx, method = open_run(prepared, Path(tmp), setup=True)
        feed = ctx.device_data
        payload = {"weights": ctx.initial_weights}
        times = {"device layer": [], "plain": []}
        for rep in range(args.reps + 1):
            for name in (("device layer", "plain") if rep % 2 else ("plain", "device layer")):
                ctx.device_data = feed if name == "device layer" else None
                t0 = time.perf_counter()
                run_client(ctx, method, cfg.train, cfg.seed, 1, 0, payload)
                if rep:  # the first pair warms the caches up
                    times[name].append(time.perf_counter() - t0)
    steps = -(-len(prepared.data.client_indices[0]) // cfg.train.batch_size) * cfg.train.epochs
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"client steps per round: {steps}, reps: {args.reps}")
    for k, v in med.items():
        print(f"{k:<13} median {v * 1000:8.1f} ms   (min {min(times[k]) * 1000:.1f}, max {max(times[k]) * 1000:.1f})")
    print(f"ratio (device layer / plain): {med['device layer'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
