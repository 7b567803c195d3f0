"""Engine overhead: FedAvg round training time vs a bare SGD loop doing the same steps.

Runs `configs/fmnist_dir0.1.yaml` (FedAvg, 10 clients, Dirichlet 0.1) for a few rounds through the
engine, then, in the same process, the same sequence of mini-batch sizes on the same model in a bare
loop over one in-memory tensor. Prints both (evaluation timed separately) and ends with
`ratio=<round training time / bare-loop time>`.

    .venv/bin/python benchmarks/engine_overhead.py [--rounds 3] [CONFIG] [overrides ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch
from bare_loop import BareLoop, batch_sizes

from fedguide.config import load_config
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(REPO / "configs/fmnist_dir0.1.yaml"))
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # In-process clients: the engine's own overhead, not the worker pool's speed-up (see parallel_clients.py).
    prepared = prepare(load_config(Path(args.config), [f"train.rounds={args.rounds}", "runtime.workers=1",
                                                       *args.overrides]))
    print(f"config {os.path.relpath(args.config, REPO)} {' '.join(args.overrides)}: {prepared.config.method.name}, "
          f"{prepared.data.num_clients} clients, {args.rounds} rounds, torch threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory() as tmp:
        Experiment(prepared, Path(tmp) / "run", log=lambda s: None).run()
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    # Round 1 pays one-off warm-up costs (allocator, kernels); so does the bare loop: its first
    # round's worth of steps is a warm-up, excluded like round 1.
    loop = BareLoop(prepared)
    loop.run(batch_sizes(prepared, rows[0]["clients"]))
    timed = [b for r in rows[1:] for b in batch_sizes(prepared, r["clients"])]
    bare = loop.run(timed)
    engine = sum(r["train_seconds"] for r in rows[1:])
    evaluation = sum(r["eval_seconds"] for r in rows[1:])
    steps = len(timed)
    print(f"rounds timed: {len(rows) - 1} (round 1 = warm-up: {rows[0]['train_seconds']:.2f} s)")
    print(f"fedguide round training: {engine:.2f} s for {steps} steps ({1e3 * engine / steps:.2f} ms/step)")
    print(f"bare loop:               {bare:.2f} s for {steps} steps ({1e3 * bare / steps:.2f} ms/step)")
    print(f"evaluation (separate):   {evaluation:.2f} s ({evaluation / (len(rows) - 1):.2f} s/round)")
    ratio = engine / bare if bare > 0 else math.nan
    print(f"ratio={ratio:.4f}")


if __name__ == "__main__":
    main()
