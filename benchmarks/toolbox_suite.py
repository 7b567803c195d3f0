"""The standard-toolbox comparisons against FedAvg, seeds 0-2, as a user runs them: a sweep through the CLI, then
``fedguide report --vs fedavg`` (per-seed paired differences of the last-k means, bootstrap 95 % intervals).

- ``fedbn``: FedBN against FedAvg on domain shift (``configs/fedbn_digits_domains.yaml``: the embedded
  three-domain digits, two clients per domain, FedBN's BatchNorm digit model), compared on the global test set
  and on each client's own domain (personal accuracy, FedBN's protocol).
- ``server``: the server optimisers (FedAvgM and FedAdam at their defaults; ``--optimizers`` adds others) against
  plain averaging on
  Dirichlet(0.1) Fashion-MNIST (``configs/fmnist_dir0.1.yaml``), at ``--fraction`` of the training set (1.0 is
  the config's; a smaller share keeps a CPU run within an hour and is named in the table).

    .venv/bin/python benchmarks/toolbox_suite.py [fedbn] [server] [--seeds 0 1 2] [--fraction 0.25]

Runs are kept and continued (a sweep's folder); the tables go to benchmarks/results/toolbox/<part>.md.
"""
from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import REPO, cli  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "toolbox"


def sweep(config: str, out: Path, seeds: list[int], axes: list[str], overrides: list[str]) -> None:
    flags = [f for axis in axes for f in ("--sweep", axis)]
    cli("run", REPO / config, "--quiet", "--out", out, *flags, "--sweep", f"seed={','.join(map(str, seeds))}",
        *overrides)


def report(out: Path, *extra: str) -> str:
    """The report's printed tables, without the lines naming the files it wrote; with ``--vs``, only the paired
    table and its note (the results table is the first section)."""
    text = cli("report", out, "--out", out / "report", *extra, capture=True)
    lines = [line for line in text.splitlines() if not line.startswith(("report: ", "plot: "))]
    if "--vs" in extra:
        start = next(i for i, line in enumerate(lines) if line.startswith("| method | settings"))
        lines = lines[start:]
    return "\n".join(lines)


def write(part: str, title: str, how: str, sections: list[tuple[str, str]]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{part}.md"
    body = [f"# {title}", "", f"{how} Made with `benchmarks/toolbox_suite.py {part}`, {date.today()}, 2-core CPU.", ""]
    for heading, text in sections:
        body += [f"## {heading}", "", text.rstrip(), ""]
    path.write_text("\n".join(body))
    return path


def fedbn(args) -> Path:
    out = args.out / "fedbn"
    sweep("configs/fedbn_digits_domains.yaml", out, args.seeds, ["method.name=fedavg,fedbn"], [])
    return write("fedbn", "FedBN against FedAvg on domain shift (configs/fedbn_digits_domains.yaml)",
                 "Seeds " + ", ".join(map(str, args.seeds)) + "; 30 rounds, six clients (two per domain); last-k means "
                 "(the config's report.last_k), differences paired by seed.",
                 [("Results", report(out)),
                  ("Global test set, paired against FedAvg", report(out, "--vs", "fedavg")),
                  ("Each client's own domain (personal accuracy, FedBN's protocol), paired against FedAvg",
                   report(out, "--vs", "fedavg", "--metric", "personal_last_k"))])


def server(args) -> Path:
    out = args.out / f"server-fraction{args.fraction}"
    sweep("configs/fmnist_dir0.1.yaml", out, args.seeds, [f"server_optimizer.name={','.join(['average', *args.optimizers])}"],
          [f"data.fraction={args.fraction}"])
    return write("server", "Server optimisers against plain averaging, FedAvg on Dirichlet(0.1) Fashion-MNIST",
                 f"configs/fmnist_dir0.1.yaml at data.fraction={args.fraction}; seeds "
                 + ", ".join(map(str, args.seeds)) + "; each optimiser at its defaults (`fedguide list`); last-k "
                 "means, differences paired by seed.",
                 [("Results", report(out)), ("Paired against plain averaging (fedavg)", report(out, "--vs", "fedavg"))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", choices=["fedbn", "server"], default=["fedbn", "server"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--optimizers", nargs="+", default=["avgm", "adam"], help="server optimisers against average")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "toolbox")
    args = ap.parse_args()
    for part in args.parts:
        print(f"{part}: {globals()[part](args)}")


if __name__ == "__main__":
    main()
