"""FedDW's comparison on Fashion-MNIST: a mu sweep on seed 0, then FedAvg, FedProx, MOON, FedDW and
MOON+DW on seeds 0-2, in the "practical" and "pathological" settings (configs/feddw_fmnist.yaml).

Every method of a seed runs on the same partition (the partition depends on the seed alone). The
chosen mu is the one with the best final accuracy on seed 0 of that setting. Reports (tables and
plots, SL/CR heatmaps) land in benchmarks/results/feddw/<setting>/.

    .venv/bin/python benchmarks/feddw_suite.py [--out runs/feddw] [--settings practical pathological]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import cli, ensure_run, summary  # noqa: E402

CONFIG = REPO / "configs/feddw_fmnist.yaml"
SETTINGS = {"practical": [], "pathological": ["partition.alpha=0.1", "clients.per_round=5"]}
MUS = (0.01, 0.1, 1.0, 10.0)


def run(out: Path, overrides: list[str]) -> Path:
    ensure_run(CONFIG, out, overrides)
    print(f"{out.name:<28} final {100 * summary(out)['final_accuracy']:.2f}%", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "feddw")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    for setting in args.settings:
        base = SETTINGS[setting]
        root = args.out / setting
        sweep = {mu: run(root / f"sweep-mu={mu}", base + ["seed=0", "method.name=feddw", f"method.mu={mu}"]) for mu in MUS}
        mu = max(MUS, key=lambda m: summary(sweep[m])["final_accuracy"])
        print(f"{setting}: chosen mu = {mu}", flush=True)
        runs = []
        for seed in args.seeds:
            s = [f"seed={seed}"]
            runs += [run(root / f"fedavg-s{seed}", base + s + ["method.name=fedavg"]),
                     run(root / f"fedprox-s{seed}", base + s + ["method.name=fedprox"]),
                     run(root / f"moon-s{seed}", base + s + ["method.name=moon"]),
                     run(root / f"feddw-s{seed}", base + s + ["method.name=feddw", f"method.mu={mu}"]),
                     run(root / f"moon+dw-s{seed}", base + s + ["method.name=moon", f"regularizers=[{{name: dw, mu: {mu}}}]"])]
        dest = REPO / "benchmarks" / "results" / "feddw" / setting
        for name, paths in (("sweep", list(sweep.values())), ("table", runs)):
            cli("report", *paths, "--out", dest / name)
        (dest / "chosen_mu.txt").write_text(f"{mu}\n")


if __name__ == "__main__":
    main()
