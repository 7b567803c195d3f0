"""What a worker pool adds to a run: a tiny run (8x8 digits, six clients, three rounds of two epochs) in process,
in a pool of two workers on the CPU and on the simulated device, with the fork server preloading what workers
import (``fl.runtimes.local.FORKSERVER_PRELOAD``) and, in a fresh process, preloading only torch (the baseline).

    .venv/bin/python benchmarks/pool_start.py [--repeats 5]

Prints the median seconds per run of each and ``ratio=`` (pool on the CPU, preloaded / baseline).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timings(repeats: int) -> dict[str, float]:
    from fedguide.config import build_config
    from fedguide.fl.engine import Experiment
    from fedguide.fl.setup import prepare

    def config(workers: int, device: str = "cpu"):
        return build_config({"data": {"name": "digits"}, "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
                             "model": {"name": "mlp"}, "method": {"name": "fedprox"},
                             "clients": {"num": 6, "per_round": 4},
                             "train": {"rounds": 3, "epochs": 2, "batch_size": 32, "lr": 0.05, "device": device},
                             "runtime": {"workers": workers, "threads_per_worker": 1}, "seed": 5})

    cases = {"in_process": config(1), "pool_cpu": config(2), "pool_simulated": config(2, "simulated")}
    out: dict[str, list[float]] = {k: [] for k in cases}
    with tempfile.TemporaryDirectory() as tmp:
        Experiment(prepare(cases["pool_cpu"]), Path(tmp) / "warm", log=lambda s: None).run()  # the fork server
        for i in range(repeats):
            for name, cfg in cases.items():
                t0 = time.perf_counter()
                Experiment(prepare(cfg), Path(tmp) / f"{name}-{i}", log=lambda s: None).run()
                out[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)  # the child process below
    args = ap.parse_args()
    if args.baseline:
        import fedguide.fl.runtimes.local as local
        local.FORKSERVER_PRELOAD = (local.__name__,)
        print(json.dumps(timings(args.repeats)))
        return
    preloaded = timings(args.repeats)
    child = subprocess.run([sys.executable, __file__, "--baseline", "--repeats", str(args.repeats)], cwd=REPO,
                           capture_output=True, text=True, check=True)
    baseline = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{'median s per run':<18} {'preloaded':>10} {'torch only':>11}")
    for name in preloaded:
        print(f"{name:<18} {preloaded[name]:>10.2f} {baseline[name]:>11.2f}")
    print(f"ratio={preloaded['pool_cpu'] / baseline['pool_cpu']:.2f}")


if __name__ == "__main__":
    main()
