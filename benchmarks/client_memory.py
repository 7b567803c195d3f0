"""Peak memory vs the number of clients: clients.num = 100 and 1000 with 10 clients per round.

Each setting runs in its own process (peak RSS is per process), on configs/fmnist_dir0.1.yaml with
a few rounds. Per-client state lives on disk and client data are index lists into one shared tensor,
so the peak should not grow with clients.num. Ends with `ratio=<rss(1000) / rss(100)>`.

    .venv/bin/python benchmarks/client_memory.py [--rounds 2] [--method fedavg] [overrides ...]
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Dirichlet(0.1) leaves some of 1000 clients empty on Fashion-MNIST (60 samples each on average);
# the memory question does not depend on the label skew, so both settings use an iid split.
BASE = ["train.rounds={rounds}", "clients.per_round=10", "partition.name=iid", "method.name={method}"]


def child(num: int, overrides: list[str]) -> None:
    from fedguide.config import load_config
    from fedguide.fl.engine import Experiment
    from fedguide.fl.setup import prepare

    prepared = prepare(load_config(REPO / "configs/fmnist_dir0.1.yaml", [f"clients.num={num}", *overrides]))
    with tempfile.TemporaryDirectory() as tmp:
        Experiment(prepared, Path(tmp) / "run", log=lambda s: None).run()
    print(f"maxrss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--method", default="fedavg")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.overrides)
        return
    overrides = [o.format(rounds=args.rounds, method=args.method) for o in BASE] + args.overrides
    rss = {}
    for num in (100, 1000):
        out = subprocess.run([sys.executable, __file__, "--child", str(num), *overrides],
                             capture_output=True, text=True, check=True).stdout
        rss[num] = int(out.strip().splitlines()[-1].split("=")[1]) / 1024
        print(f"method={args.method} clients.num={num:>5} per_round=10 rounds={args.rounds}: peak RSS {rss[num]:.1f} MiB")
    print(f"ratio={rss[1000] / rss[100]:.4f}")


if __name__ == "__main__":
    main()
