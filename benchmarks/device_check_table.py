"""Every registered method (and regulariser, on FedAvg) for one round on the simulated device and on the CPU:
whether it runs under CUDA's rules, whether its metrics match the CPU run's, and what it syncs and copies
per optimiser step. Writes a markdown table.

Each method runs on the config benchmarks/behaviour_hashes.py gives it (the guided ones with the embedded
guidance models, the one-shot ones with their smallest settings).

    .venv/bin/python benchmarks/device_check_table.py [--only NAME ...] [--runtime-workers 2] \\
        > benchmarks/results/device_check.md
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import behaviour_hashes as HASHES  # a sibling script: benchmarks/ is on the path when this one runs
from fedguide.config import load_config
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.methods import METHODS
from fedguide.methods.compose import REGULARIZERS




def cases() -> list[tuple[str, Path, list[str]]]:
    out = []
    for name in METHODS.names():
        config, overrides = HASHES.SPECIAL.get(name, (HASHES.SMOKE, []))
        if not any(o.startswith("method.name=") for o in overrides):
            overrides = overrides + [f"method.name={name}"]
        out.append((name, config, overrides))
    for reg in REGULARIZERS.names():
        out.append((f"fedavg+{reg}", HASHES.SMOKE, ["method.name=fedavg", f"regularizers=[{reg}]"]
                    + (["model.head_bias=false"] if reg == "dw" else [])))
    return out


def run_once(config: Path, overrides: list[str], device: str, workers: int, extra: list[str]
             ) -> tuple[list[dict], dict, float]:
    cfg = load_config(config, overrides + [f"train.device={device}", "train.rounds=1", f"runtime.workers={workers}",
                                           *extra])
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = Experiment(prepare(cfg), Path(tmp) / "run", log=lambda s: None).run()
        seconds = time.perf_counter() - t0
        rows = [HASHES.without_clock(json.loads(x)) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, summary, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--runtime-workers", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run (e.g. data.fraction=0.01 to "
                                                          "shorten the guided methods' feature extraction)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"runtime.workers={args.runtime_workers}; overrides: {' '.join(args.extra) or 'none'}; steps, syncs and bytes "
          "are the clients' work in one round\n")
    print("| method | runs under CUDA's rules | metrics = CPU run | steps | host syncs / step | H2D bytes / step "
          "| syncs (round) | H2D bytes (round) | s simulated / s CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config, overrides in cases():
        if args.only and name not in args.only:
            continue
        try:
            sim_rows, summary, t_sim = run_once(config, overrides, "simulated", args.runtime_workers, args.extra)
        except Exception as err:  # the table reports what fails; the other methods go on
            print(f"| {name} | **no**: {type(err).__name__}: {str(err).splitlines()[0][:300]} | | | | | | | |", flush=True)
            continue
        cpu_rows, _, t_cpu = run_once(config, overrides, "cpu", args.runtime_workers, args.extra)
        dc = summary["device_check"]
        same = "yes" if sim_rows == cpu_rows else "**no**"
        print(f"| {name} | yes | {same} | {dc['steps']} | {dc['host_syncs_per_step']:.2f} | "
              f"{dc['h2d_bytes_per_step']:.0f} | {dc['host_syncs']} | {dc['h2d_bytes']} | {t_sim / t_cpu:.2f} |", flush=True)


if __name__ == "__main__":
    main()
