"""Which UNet layers feed FedDifRC and SemanticFL: a sweep on configs/demo.yaml (seed 0).

FedDifRC: the fused decoder layers {2, 3, 4} (the default) against each single decoder layer L = 1..4
(paper Table 2); SemanticFL: every block (the default) against the encoder and the decoder blocks (each
with the bottleneck). FedAvg on the same partition is the reference. Reports the final accuracy and
the mean of the last 5 rounds (at Dirichlet 0.1 one round's accuracy swings by points).

An investigation on one seed of a small config, not a benchmark: each new layer set costs a feature
extraction, which is what the small config keeps affordable. Finished runs under --out are kept.

    .venv/bin/python benchmarks/diffusion_layer_sweep.py [--out runs/layer_sweep] [--seed 0]

Writes benchmarks/results/diffusion_methods/layer_sweep.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import FROM_DEFAULTS, ensure_run, summary  # noqa: E402

CONFIG = REPO / "configs/demo.yaml"
OUT_FILE = REPO / "benchmarks" / "results" / "diffusion_methods" / "layer_sweep.md"
TAIL = 5
VARIANTS = {
    "fedavg": ["method.name=fedavg"],
    "feddifrc layers 2,3,4 (default)": ["method.name=feddifrc"],
    **{f"feddifrc layer {level}": ["method.name=feddifrc", f"method.layers=[{level}]"] for level in (1, 2, 3, 4)},
    "semanticfl all blocks (default)": ["method.name=semanticfl"],
    # SemanticFL reduces its pooled features to z's 512 dims, so a block set needs at least 512 channels:
    # the embedded UNet's encoder (448) or decoder (448) alone is too narrow; each goes with the bottleneck.
    "semanticfl encoder + bottleneck": ["method.name=semanticfl", "method.layers=[down.0,down.1,down.2,down.3,mid]"],
    "semanticfl bottleneck + decoder": ["method.name=semanticfl", "method.layers=[mid,up.0,up.1,up.2,up.3]"],
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "layer_sweep")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    for name, overrides in VARIANTS.items():
        out = args.out / f"{slug(name)}-s{args.seed}"
        s = summary(ensure_run(CONFIG, out, [f"seed={args.seed}", *FROM_DEFAULTS, *overrides]))
        tail = statistics.mean(s["accuracy_curve"][-TAIL:])
        rows.append((name, s["final_accuracy"], tail, s["best_accuracy"]))
        print(f"{name:<36} final {100 * s['final_accuracy']:.2f}%  last-{TAIL} {100 * tail:.2f}%", flush=True)
    base = next(r for r in rows if r[0] == "fedavg")
    lines = [f"# Layer sweep on configs/demo.yaml, seed {args.seed} (benchmarks/diffusion_layer_sweep.py)", "",
             f"| variant | final % | last-{TAIL} mean % | last-{TAIL} vs FedAvg | best % |", "|---|---|---|---|---|"]
    for name, final, tail, best in rows:
        lines.append(f"| {name} | {100 * final:.2f} | {100 * tail:.2f} | {100 * (tail - base[2]):+.2f} | {100 * best:.2f} |")
    OUT_FILE.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
