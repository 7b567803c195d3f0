"""Parallel clients vs the single-process floor and vs Flower's simulation, on one workload.

The FedAvg Fashion-MNIST Dirichlet(0.1) workload of configs/fmnist_dir0.1.yaml for a few rounds,
measured in one run:
  floor    the same SGD steps in a bare single-process loop with every core as intra-op threads;
  w1       fedguide with runtime.workers=1 (in-process clients, every core as threads);
  auto     fedguide with runtime.workers=auto (in-process on 2 cores or fewer, else a pool);
  pool     fedguide with one single-thread worker process per core (measured even where auto
           does not choose it);
  flower   Flower's simulation engine with the same model and data at its fastest setting
           (one single-thread actor per core), where flwr[simulation] is installed.
Round 1 of every variant is a warm-up and is excluded. Times are the training part of a round
(evaluation is reported separately by fedguide and not part of any ratio).
Last line: `ratio_vs_floor=<auto / floor> ratio_vs_flower=<auto / flower>`.

    .venv/bin/python benchmarks/parallel_clients.py [--rounds 4] [--workers auto] [overrides ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from bare_loop import BareLoop, batch_sizes

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/fmnist_dir0.1.yaml"


def fedguide_rounds(overrides: list[str]) -> tuple[list[float], dict]:
    from fedguide.config import load_config
    from fedguide.fl.engine import Experiment
    from fedguide.fl.setup import prepare

    prepared = prepare(load_config(CONFIG, overrides))
    with tempfile.TemporaryDirectory() as tmp:
        summary = Experiment(prepared, Path(tmp) / "run", log=lambda s: None).run()
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["train_seconds"] for r in rows[1:]], {"rows": rows, "summary": summary, "prepared": prepared}


def floor_rounds(prepared, rows: list[dict], threads: int) -> list[float]:
    """The same mini-batch sizes per round, in one process with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    loop = BareLoop(prepared)
    return [loop.run(batch_sizes(prepared, r["clients"])) for r in rows][1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workers", default="auto")
    ap.add_argument("--no-flower", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    base = [f"train.rounds={args.rounds}", *args.overrides]

    auto, info = fedguide_rounds(base + [f"runtime.workers={args.workers}"])
    s = info["summary"]
    w1, _ = fedguide_rounds(base + ["runtime.workers=1", f"runtime.threads_per_worker={cores}"])
    pool, _ = fedguide_rounds(base + [f"runtime.workers={cores}", "runtime.threads_per_worker=1"])
    floor = floor_rounds(info["prepared"], info["rows"], cores)
    flower = None
    if not args.no_flower:
        try:
            from flower_baseline import flower_rounds  # noqa: E402  (benchmarks/flower_baseline.py)

            flower = flower_rounds(CONFIG, base, actors=cores)
        except ImportError as err:
            print(f"flower: not measured ({err}); pip install 'flwr[simulation]' to include it")
        except Exception as err:  # a Flower failure must not discard the fedguide numbers above
            print(f"flower: failed ({type(err).__name__}: {err})")

    def show(name, ts):
        print(f"{name:<34} per round {[round(t, 2) for t in ts]}  median {statistics.median(ts):.2f} s")

    print(f"workload: {CONFIG.name} {' '.join(base)}; {cores} cores; timed rounds 2..{args.rounds}")
    show(f"floor (1 process, {cores} threads)", floor)
    show(f"fedguide workers=1 ({cores} threads)", w1)
    show(f"fedguide workers={args.workers} -> {s['workers']} x {s['threads_per_worker']} thr", auto)
    show(f"fedguide pool ({cores} workers x 1 thr)", pool)
    if flower:
        show(f"flower simulation ({cores} actors x 1 thr)", flower)
    m = statistics.median
    print(f"speed-up of the pool over workers=1: {m(w1) / m(pool):.3f}x; "
          f"pool / floor {m(pool) / m(floor):.4f}; pool / flower {(m(pool) / m(flower)) if flower else float('nan'):.4f}")
    print(f"ratio_vs_floor={m(auto) / m(floor):.4f} "
          f"ratio_vs_flower={(m(auto) / m(flower)) if flower else float('nan'):.4f}")


if __name__ == "__main__":
    main()
