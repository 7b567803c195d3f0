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
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedguide.config import load_config
from fedguide.fl.engine import Experiment, prepare
from fedguide.fl.training import make_optimizer
from fedguide.models import ModelSpec, build_model

REPO = Path(__file__).resolve().parents[1]


def batch_sizes(prepared, clients_per_round: list[list[int]]) -> list[int]:
    cfg = prepared.config.train
    sizes = []
    for clients in clients_per_round:
        for cid in clients:
            n = len(prepared.data.client_indices[cid])
            for _ in range(cfg.epochs):
                sizes += [cfg.batch_size] * (n // cfg.batch_size) + ([n % cfg.batch_size] if n % cfg.batch_size else [])
    return sizes


def bare_loop(prepared, sizes: list[int]) -> float:
    """The floor: one model, one optimiser, random batches gathered from one in-memory tensor."""
    cfg = prepared.config
    spec = ModelSpec(prepared.data.splits.input_shape, prepared.data.num_classes)
    torch.manual_seed(0)
    model = build_model(cfg.model.name, prepared.params["model"], spec)
    opt = make_optimizer(model, cfg.train)
    x, y = prepared.data.splits.train_x, prepared.data.splits.train_y
    gen = torch.Generator().manual_seed(0)
    model.train()
    t0 = time.perf_counter()
    for b in sizes:
        idx = torch.randint(0, len(y), (b,), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(REPO / "configs/fmnist_dir0.1.yaml"))
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # In-process clients: the engine's own overhead, not the worker pool's speed-up (see parallel_clients.py).
    prepared = prepare(load_config(Path(args.config), [f"train.rounds={args.rounds}", "runtime.workers=1",
                                                       *args.overrides]))
    print(f"config {args.config} {' '.join(args.overrides)}: {prepared.config.method.name}, "
          f"{prepared.data.num_clients} clients, {args.rounds} rounds, torch threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory() as tmp:
        Experiment(prepared, Path(tmp) / "run", log=lambda s: None).run()
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    sizes = batch_sizes(prepared, [r["clients"] for r in rows])
    # Round 1 pays one-off warm-up costs (allocator, kernels); time the bare loop the same way: a
    # warm-up pass over one round's worth of steps first, excluded like round 1.
    per_round = len(sizes) // len(rows)
    bare_loop(prepared, sizes[:per_round])
    bare = bare_loop(prepared, sizes[per_round:])
    engine = sum(r["train_seconds"] for r in rows[1:])
    evaluation = sum(r["eval_seconds"] for r in rows[1:])
    steps = len(sizes) - per_round
    print(f"rounds timed: {len(rows) - 1} (round 1 = warm-up: {rows[0]['train_seconds']:.2f} s)")
    print(f"fedguide round training: {engine:.2f} s for {steps} steps ({1e3 * engine / steps:.2f} ms/step)")
    print(f"bare loop:               {bare:.2f} s for {steps} steps ({1e3 * bare / steps:.2f} ms/step)")
    print(f"evaluation (separate):   {evaluation:.2f} s ({evaluation / (len(rows) - 1):.2f} s/round)")
    ratio = engine / bare if bare > 0 else math.nan
    print(f"ratio={ratio:.4f}")


if __name__ == "__main__":
    main()
