"""Round training time of a method vs FedAvg on the same config, measured in one process.

Alternates FedAvg and the method (A B A B ...) so drifts of the machine hit both alike; round 1 of
each run is a warm-up and excluded. Ends with `ratio=<method round time / FedAvg round time>`.

    .venv/bin/python benchmarks/method_overhead.py [--method fedprox] [--rounds 3] [--repeats 2] [overrides ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from fedguide.config import load_config
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare

REPO = Path(__file__).resolve().parents[1]


def round_times(config: Path, overrides: list[str], key: str) -> list[float]:
    prepared = prepare(load_config(config, overrides))
    with tempfile.TemporaryDirectory() as tmp:
        Experiment(prepared, Path(tmp) / "run", log=lambda s: None).run()
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=REPO / "configs/fmnist_dir0.1.yaml")
    ap.add_argument("--method", default="fedprox", help="method name, or several overrides joined by ';'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--phase", choices=["round", "fit", "whole"], default="round",
                    help="round: a round's whole client part; fit: the local training loops alone; "
                         "whole: the whole round, evaluation included")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    variant = args.method.split(";") if "=" in args.method else [f"method.name={args.method}"]
    base = [f"train.rounds={args.rounds}", *args.overrides]
    times = {"fedavg": [], "method": []}
    for _ in range(args.repeats):
        key = {"round": "train_seconds", "fit": "client_fit_seconds", "whole": "seconds"}[args.phase]
        times["fedavg"] += round_times(args.config, base + ["method.name=fedavg"], key)
        times["method"] += round_times(args.config, base + variant, key)
    a, b = statistics.median(times["fedavg"]), statistics.median(times["method"])
    print(f"config {args.config.name} {' '.join(base)}")
    print(f"phase: {args.phase}")
    print(f"fedavg {args.phase} time: median {a:.3f} s over {len(times['fedavg'])} rounds {[round(t, 2) for t in times['fedavg']]}")
    print(f"{' '.join(variant)} {args.phase} time: median {b:.3f} s over {len(times['method'])} rounds {[round(t, 2) for t in times['method']]}")
    print(f"ratio={b / a:.4f}")


if __name__ == "__main__":
    main()
