"""FedAvg against FedProx on a small federation, from Python: run both, print the table, save a plot.

A notebook-style script: each ``# %%`` line starts a cell (VS Code, PyCharm and Jupytext run them one by
one). It trains on scikit-learn's 8x8 digits, which come with scikit-learn, so it needs no download and
takes seconds on a CPU:

    python examples/compare_methods.py [OUT] [--rounds N] [--fraction F]

Run again with the same OUT, it reuses the finished runs (a sweep continues where it stopped). For the
real benchmark, pass a config file instead of CONFIG: ``fedguide.sweep("configs/smoke.yaml", ...)``.
"""
# %% Imports
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # write files, open no window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

import fedguide  # noqa: E402

# %% The experiment: a config in the YAML files' shape. Four clients with Dirichlet(0.5) label skew.
CONFIG = {
    "data": {"name": "digits", "fraction": 1.0},
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
    "model": {"name": "mlp"},
    "clients": {"num": 4, "per_round": 4},
    "train": {"rounds": 10, "epochs": 1, "batch_size": 32, "lr": 0.05},
    "runtime": {"name": "local", "threads_per_worker": 1},  # a model this small trains fastest on one thread
    "seed": 0,
}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("out", nargs="?", default="runs/example-compare-methods", help="folder of the runs and figures")
parser.add_argument("--rounds", type=int, default=CONFIG["train"]["rounds"])
parser.add_argument("--fraction", type=float, default=CONFIG["data"]["fraction"], help="share of the training set used")
args = parser.parse_args()
out = Path(args.out)

# %% Run both methods: one run folder per method under OUT. Overrides are the command line's dotted keys.
records = fedguide.sweep(CONFIG, {"method.name": ["fedavg", "fedprox"]},
                         overrides={"train.rounds": args.rounds, "data.fraction": args.fraction}, out=out, quiet=True)

# %% The results table (Markdown), as `fedguide report` prints it
print(fedguide.results_table(records))

# %% Test accuracy per round, one line per method
fig, ax = plt.subplots(figsize=(5, 3.5))
for rec in records:
    curve = [100 * m["accuracy"] for m in rec.metrics]
    ax.plot(range(1, len(curve) + 1), curve, marker="o", label=rec.summary["method"])
ax.set_xlabel("round")
ax.xaxis.set_major_locator(MaxNLocator(integer=True))
ax.set_ylabel("test accuracy (%)")
ax.legend()
fig.tight_layout()
fig.savefig(out / "accuracy.png", dpi=120)
print(f"plot: {out / 'accuracy.png'}")

# %% The full report: report.md, accuracy curves and partition heatmaps
result = fedguide.write_report(records, out / "report")
print(f"report: {result.markdown_path}")
