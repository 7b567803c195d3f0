"""FedDISC against its baselines (the FedDISC paper Table 1) in two semi-supervised settings, seeds 0-2:

- digits (configs/feddisc_digits.yaml): the server holds the uci domain of digits_domains labeled, the
  fonts and mnistm_like domains are two unlabeled clients; a client's accuracy is its domain's test accuracy.
- fmnist (configs/feddisc_fmnist.yaml): the public pool of Fashion-MNIST is the server's labeled set,
  5 unlabeled Dirichlet(0.5) clients; a client's accuracy is the test accuracy reweighted to its class
  mix (Σ_c n_kc·acc_c / n_k, the test set being balanced).

Methods: feddisc, centroid_finetune and zero_shot (one round), fedavg_sm, semifl and rscfed
(``--rounds``, 30 by default; the paper runs 30, 500 and 100), and feddisc_plus_centroids (not in the
paper: FedDISC's head trained on its generated images and the uploaded centroids together).
``--ablations`` adds, on seed 0 and the first setting given: Table 4 (no domain features, random
features instead of centroids) and the L and R sweeps of Tables 2-3 (L = 3, 5, 10 for feddisc and
centroid_finetune; R = 3, 5, 10).

Resumable: a run directory with summary.json is kept; a started one is continued with ``fedguide resume``;
a missing one is started. Results land in benchmarks/results/feddisc/<setting>/ (or ``--results``):
table.md (per-client and average accuracy, mean ± std over seeds), privacy.json and feddisc_samples.png of
seed 0, ablations.md, and ``fedguide report`` of every run (report/).

    .venv/bin/python benchmarks/feddisc_suite.py [--out runs/feddisc] [--settings digits fmnist] [--ablations]
        [--seeds 0 1 2] [--methods feddisc zero_shot ...] [--set KEY=VALUE ...] [--results DIR]

``--methods`` runs and tabulates only those methods (e.g. the baselines first, while the generator is
still training); a later call without it fills in the rest and writes the whole table.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import cli, ensure_run, mean_std, metrics, summary  # noqa: E402

CONFIGS = {"digits": REPO / "configs/feddisc_digits.yaml", "fmnist": REPO / "configs/feddisc_fmnist.yaml"}
ONE_SHOT = ("feddisc", "centroid_finetune", "zero_shot")
MULTI_ROUND = ("fedavg_sm", "semifl", "rscfed")
# Not a method of the paper: FedDISC with its head trained on the generated images and the uploaded
# centroids together (``method.head_train_set``), to see whether generation adds to the centroids.
VARIANTS = {"feddisc_plus_centroids": ["method.name=feddisc", "method.head_train_set=generated_and_centroids"]}
ALL = ONE_SHOT + MULTI_ROUND + tuple(VARIANTS)
SWEEP = (3, 5, 10)
RESULTS = REPO / "benchmarks" / "results" / "feddisc"


def run(config: Path, out: Path, overrides: list[str]) -> Path:
    """The finished run directory of ``config`` with ``overrides``: kept, resumed or started."""
    ensure_run(config, out, overrides)
    print(f"{out.parent.name}/{out.name:<36} final {100 * summary(out)['final_accuracy']:.2f}%", flush=True)
    return out


def client_accuracies(run_dir: Path) -> list[float]:
    """Each client's accuracy: its domain's (one domain per client) or its class mix's."""
    partition = json.loads((run_dir / "partition.json").read_text())
    last = metrics(run_dir)[-1]
    domains = partition.get("domain_counts")
    if domains and all(max(row) >= 0.99 * sum(row) for row in domains):
        names = partition["domain_names"]
        return [last["domain_accuracy"][names[max(range(len(row)), key=row.__getitem__)]] for row in domains]
    acc = last["class_accuracy"]
    return [sum(n * (a or 0.0) for n, a in zip(row, acc)) / sum(row) for row in partition["counts"]]


def client_names(run_dir: Path) -> list[str]:
    partition = json.loads((run_dir / "partition.json").read_text())
    domains = partition.get("domain_counts")
    if domains and all(max(row) >= 0.99 * sum(row) for row in domains):
        return [partition["domain_names"][max(range(len(row)), key=row.__getitem__)] for row in domains]
    return [f"client{k}" for k in range(len(partition["counts"]))]


def table(rows: dict[str, list[Path]]) -> str:
    """Markdown: one row per method, one column per client and the average, mean ± std over seeds."""
    first = next(iter(rows.values()))[0]
    names = client_names(first)
    lines = ["| method | rounds | " + " | ".join(names) + " | average |", "|---" * (len(names) + 3) + "|"]
    for method, dirs in rows.items():
        per_seed = [client_accuracies(d) for d in dirs]
        rounds = summary(dirs[0])["rounds"]
        cells = [mean_std([s[k] for s in per_seed]) for k in range(len(names))]
        cells.append(mean_std([statistics.fmean(s) for s in per_seed]))
        lines.append(f"| {method} | {rounds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "feddisc")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where the tables and the report go (another folder keeps the committed ones)")
    ap.add_argument("--settings", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=list(ALL), choices=ALL)
    ap.add_argument("--rounds", type=int, default=30, help="rounds of the multi-round baselines")
    ap.add_argument("--ablations", action="store_true", help="Table 4 and the L/R sweeps on seed 0")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides added to every run, e.g. runtime.threads_per_worker=1 (not part of the results)")
    args = ap.parse_args()
    for i, setting in enumerate(args.settings):
        config, root, dest = CONFIGS[setting], args.out / setting, args.results / setting
        dest.mkdir(parents=True, exist_ok=True)
        rows: dict[str, list[Path]] = {method: [] for method in ALL if method in args.methods}
        for seed in args.seeds:  # seed-major: an interrupted suite leaves whole seeds, not whole methods
            for method in rows:
                rounds = args.rounds if method in MULTI_ROUND else 1
                rows[method].append(run(config, root / f"{method}-s{seed}", [
                    f"seed={seed}", *VARIANTS.get(method, [f"method.name={method}"]), f"train.rounds={rounds}",
                    *args.set]))
        (dest / "table.md").write_text(table(rows))
        for name in ("privacy.json", "feddisc_samples.png"):
            if "feddisc" in rows and (rows["feddisc"][0] / name).is_file():
                shutil.copy(rows["feddisc"][0] / name, dest / name)
        runs = [d for dirs in rows.values() for d in dirs]
        if args.ablations and i == 0 and "feddisc" in rows:
            s0 = [f"seed={args.seeds[0]}", "train.rounds=1", *args.set]
            ablation = {
                "feddisc": [rows["feddisc"][0]],
                "feddisc, no domain features": [run(config, root / "ablation-no-domain", s0 + [
                    "method.name=feddisc", "method.use_domain_features=false"])],
                "feddisc, random features": [run(config, root / "ablation-random", s0 + [
                    "method.name=feddisc", "method.random_centroids=true"])],
            }
            for value in SWEEP:
                for method in ("feddisc", "centroid_finetune"):
                    ablation[f"{method}, L={value}"] = [run(config, root / f"{method}-L{value}", s0 + [
                        f"method.name={method}", f"method.num_centroids={value}"])]
                ablation[f"feddisc, R={value}"] = [run(config, root / f"feddisc-R{value}", s0 + [
                    "method.name=feddisc", f"method.images_per_centroid={value}"])]
            (dest / "ablations.md").write_text(table(ablation))
            runs += [d for dirs in ablation.values() for d in dirs]
        cli("report", *runs, "--out", dest / "report")
        print((dest / "table.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
