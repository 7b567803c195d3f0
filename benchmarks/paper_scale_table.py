"""benchmarks/paper_scale.py over every configs/paper/*.yaml on this machine: one output file per config and
a Markdown table of the projections (benchmarks/results/paper_scale/<label>/).

Each config runs 2 rounds on stand-in data of about ``--train-images`` training images (the fraction is
chosen per dataset and printed in the table), with the guidance of the guided methods swapped for a tiny
random pipeline (``--guidance tiny``: the round's cost does not depend on which pipeline extracted the
cached features; the set-up does, and is therefore not tabulated). A Dirichlet partition's ``min_size``
is lowered to 2, since a few hundred images cannot give ten clients ten images each under alpha 0.05.
Configs of 224x224 images are left out with ``--max-side 64`` (their ResNet-18 rounds take hours on a
CPU).

    .venv/bin/python benchmarks/paper_scale_table.py --label cpu [--train-images 500] [--cap 900]
        [--device cpu] [--max-side 64] [--only GLOB ...]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedguide.config import load_raw
from fedguide.data.sources.standin import StandinParams, plan, standin_section

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks/results/paper_scale"
KEYS = ("s_per_round", "projected_hours", "ratio_vs_floor", "peak_gpu_gib", "setup_s")


def fraction_for(config: Path, images: int) -> tuple[float, int]:
    """(fraction drawing about ``images`` training images, the largest image side) of a config's data."""
    data = dict(load_raw(config).get("data") or {})
    section = standin_section(data.pop("name"), {k: v for k, v in data.items() if k != "fraction"})
    section.pop("name")
    p = plan(StandinParams(**section))
    fraction = min(1.0, images / sum(p.train))
    return float(f"{fraction:.2g}"), p.size if p.channels else 0


def partition_overrides(config: Path) -> list[str]:
    part = load_raw(config).get("partition") or {}
    if part.get("name") == "dirichlet":
        return ["partition.min_size=2"]
    if (part.get("then") or {}).get("name") == "dirichlet":
        return ["partition.then.min_size=2"]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="sub-folder of benchmarks/results/paper_scale, e.g. cpu")
    ap.add_argument("--train-images", type=int, default=500)
    ap.add_argument("--cap", type=int, default=900, help="seconds per config")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-side", type=int, default=64, help="skip configs of larger images")
    ap.add_argument("--only", nargs="+", default=["*.yaml"], help="globs of config names, run in this order")
    args = ap.parse_args()
    out = OUT / args.label
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="paper-scale-cache-") as cache:
        configs = [c for glob in args.only for c in sorted((REPO / "configs/paper").glob(glob))]
        for config in dict.fromkeys(configs):
            fraction, side = fraction_for(config, args.train_images)
            if side > args.max_side:
                rows.append((config.stem, fraction, f"not run: {side}x{side} images (over --max-side)", {}))
                print(f"{config.stem}: skipped ({side}x{side})", flush=True)
                continue
            cmd = [sys.executable, str(REPO / "benchmarks/paper_scale.py"), str(config), "--rounds", "2",
                   "--fraction", str(fraction), "--device", args.device, "--guidance", "tiny",
                   "--feature-cache", cache, *partition_overrides(config)]
            t0 = time.perf_counter()
            try:
                done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.cap)
                text, status = done.stdout + done.stderr, ("ok" if done.returncode == 0 else f"exit {done.returncode}")
            except subprocess.TimeoutExpired as err:
                text = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
                status = f"over the {args.cap} s cap"
            took = time.perf_counter() - t0
            record = " ".join(cmd[1:]) + "\n" + text
            (out / f"{config.stem}.txt").write_text(record.replace(str(REPO) + "/", "").replace(cache, "CACHE"))
            values = dict(re.findall(r"^(\w+)=(\S+)$", text, re.MULTILINE))
            rows.append((config.stem, fraction, status, values))
            print(f"{config.stem}: {status} in {took:.0f} s {values}", flush=True)
    lines = ["| config | fraction | s/round (measured) | projected hours | ratio vs floor | status |",
             "|---|---|---|---|---|---|"]
    for name, fraction, status, v in rows:
        lines.append(f"| {name} | {fraction:g} | {v.get('s_per_round', '—')} | {v.get('projected_hours', '—')} | "
                     f"{v.get('ratio_vs_floor', '—')} | {status} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
