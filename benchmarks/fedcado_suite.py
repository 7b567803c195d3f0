"""FedCADO's benchmark on the embedded data, seeds 0-2, in two of the paper's scenarios:

- feature skew (configs/fedcado_digits.yaml): digits_domains, one domain per client;
- label skew (configs/fedcado_fmnist.yaml): Fashion-MNIST, clients with disjoint classes;

methods: Centralized (the ceiling: all client data, 20 epochs), SD_Gen, FedAvg (20 rounds of one epoch,
as in the paper), FedDF, FedCADO FT / MD / SD. Per client (label skew: the global model on the client's
classes) or per domain (feature skew), their average and the global test accuracy, mean ± std over the
seeds; the generation throughput (images/s) of every generating run; the heterogeneous-model variant
(paper Table 4: different client architectures, a larger global model) on the feature-skew scenario.

Resumable: every run has its own directory under --out; a finished one (summary.json) is read, an
unfinished one continued with `fedguide resume` (FedCADO and SD_Gen skip the clients whose synthetic
images are on disk), a missing one started. FedCADO MD and SD train on the FT run's synthetic set
(method.reuse_synthetic), so FedCADO generates once per scenario and seed; the heterogeneous SD_Gen
reuses the homogeneous SD_Gen set (text-only images do not depend on the clients).

    .venv/bin/python benchmarks/fedcado_suite.py [--out runs/fedcado] [--scenarios digits fmnist]
        [--seeds 0 1 2] [--hetero-seeds 0] [--only-report] [--results DIR]

Writes to benchmarks/results/fedcado/ (or --results): <scenario>.md (tables), throughput.md, hetero_<scenario>.md,
results.json (every number the tables show) and grids/<scenario>/ (seed 0's synthetic-image grids, one
PNG per client, FedCADO and SD_Gen).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import ensure_run, mean_std, metrics, summary  # noqa: E402

from fedguide.core.atomic import write_text  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fedcado"
SCENARIOS = {"digits": ("configs/fedcado_digits.yaml", "feature skew"),
             "fmnist": ("configs/fedcado_fmnist.yaml", "label skew")}
HETERO_SCENARIO = "digits"
# Paper Table 4 uses MobileNetV3, ResNet18, ResNet34, MobileNetV2, VGG16, ShuffleNet clients and a ResNet50
# global model; three clients here, at CPU-sized widths.
HETERO = ['method.client_models=[{name: mobilenetv3_small}, {name: resnet18, width: 16}, '
          '{name: shufflenetv2, width: 0.5}]']
HETERO_MODEL = ["model.name=resnet50", "model.width=8"]
ROWS = ("centralized", "sd_gen", "fedavg", "feddf", "fedcado_ft", "fedcado_md", "fedcado_sd")
LABELS = {"centralized": "Ceiling (centralized)", "sd_gen": "SD_Gen", "fedavg": "FedAvg (20 rounds)",
          "feddf": "FedDF", "fedcado_ft": "FedCADO_FT", "fedcado_md": "FedCADO_MD", "fedcado_sd": "FedCADO_SD"}


def overrides_of(row: str, root: Path, seed: int, hetero: bool) -> list[str]:
    """The CLI overrides of one table row (reused synthetic sets point into ``root``)."""
    seed_o = [f"seed={seed}"]
    if row == "centralized":
        return seed_o + ["method.name=centralized", "train.rounds=1", "train.epochs=20"]
    if row == "fedavg":
        return seed_o + ["method.name=fedavg", "train.rounds=20", "train.epochs=1"]
    if row == "feddf":
        return seed_o + ["method.name=feddf"] + (HETERO if hetero else [])
    if row == "sd_gen":
        reuse = [f"method.reuse_synthetic={root.parent / f'sd_gen-s{seed}'}"] if hetero else []
        return seed_o + ["method.name=sd_gen"] + reuse
    aggregation = row.split("_")[1]
    extra = HETERO if hetero else []
    if aggregation == "ft":
        return seed_o + extra
    reuse = root / f"fedcado_ft-s{seed}"
    return seed_o + extra + [f"method.aggregation={aggregation}", f"method.reuse_synthetic={reuse}"]


def run(config: str, out: Path, overrides: list[str]) -> Path:
    ensure_run(config, out, overrides, quiet=False)
    print(f"{out.relative_to(out.parents[1])}: final {100 * summary(out)['final_accuracy']:.2f}%", flush=True)
    return out


def client_classes(root: Path, seed: int) -> list[list[int]]:
    """The classes each client of ``seed`` holds (every federated run of a seed has the same partition;
    Centralized's merges it, so it is read from another run)."""
    for row in ("fedcado_ft", "sd_gen", "feddf", "fedavg"):
        path = root / f"{row}-s{seed}" / "partition.json"
        if path.is_file():
            counts = json.loads(path.read_text())["counts"]
            return [[c for c, n in enumerate(r) if n > 0] for r in counts]
    return []


def per_client_accuracy(run_dir: Path, classes: list[list[int]]) -> list[float]:
    """The run's final global model on each client's classes (label skew), from model.safetensors."""
    import torch
    from safetensors.torch import load_file

    from fedguide.fl.run_folder import RunFolder

    from fedguide.fl.setup import prepare
    from fedguide.models import build_model

    prepared = prepare(RunFolder(run_dir).read_config())
    splits = prepared.data.splits
    model = build_model(prepared.config.model.name, prepared.resolved.model.params, splits.model_spec())
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        preds = torch.cat([model(splits.test_x[i: i + 1024]).argmax(1) for i in range(0, len(splits.test_y), 1024)])
    correct = preds == splits.test_y
    return [float(correct[torch.isin(splits.test_y, torch.tensor(c))].double().mean()) for c in classes]


def columns_of(run_dir: Path, kind: str, classes: list[list[int]]) -> tuple[list[str], list[float]]:
    """(column names, accuracies): per domain (feature skew) or per client (label skew)."""
    if kind == "feature skew":
        domains = summary(run_dir)["domain_accuracy"]
        return list(domains), list(domains.values())
    return [f"client{i}" for i in range(len(classes))], per_client_accuracy(run_dir, classes)


def table(title: str, kind: str, runs: dict[str, list[Path]], classes: dict[int, list[list[int]]],
          seeds: list[int], results: dict[str, Any]) -> str:
    header: Optional[list[str]] = None
    lines = []
    for row in ROWS:
        if row not in runs:
            continue
        per_seed, avg, glob = [], [], []
        for seed, run_dir in zip(seeds, runs[row]):
            names, accs = columns_of(run_dir, kind, classes[seed])
            header = header or names
            per_seed.append(accs)
            avg.append(statistics.fmean(accs))
            glob.append(summary(run_dir)["final_accuracy"])
        cols = [mean_std([s[i] for s in per_seed]) for i in range(len(header))]
        results[row] = {"columns": header, "per_seed": per_seed, "avg": avg, "global": glob}
        lines.append(f"| {LABELS[row]} | " + " | ".join(cols + [mean_std(avg), mean_std(glob)]) + " |")
    head = f"| method | {' | '.join(header or [])} | Avg | global |"
    sep = "|" + "---|" * (3 + len(header or []))
    intro = f"## {title}\n\nTest accuracy (%), mean ± std over seeds {seeds}.\n\n"
    return intro + f"{head}\n{sep}\n" + "\n".join(lines) + "\n"


def ordering_note(results: dict[str, Any]) -> str:
    def avg(row):
        return statistics.fmean(results[row]["avg"]) if row in results else float("nan")

    best = max((r for r in ("fedcado_ft", "fedcado_md", "fedcado_sd") if r in results), key=avg, default=None)
    if best is None:
        return ""
    checks = [f"{LABELS[best]} {'>' if avg(best) > avg(o) else '<='} {LABELS[o]}" for o in ("fedavg", "feddf", "sd_gen")
              if o in results]
    ceiling = f"; ceiling gap {100 * (avg('centralized') - avg(best)):.2f} points" if "centralized" in results else ""
    return "\nOrdering (Avg): " + ", ".join(checks) + ceiling + ".\n"


def throughput(rows: list[tuple[str, Path]]) -> str:
    import torch

    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else f"CPU, {os.cpu_count()} cores ({platform.machine()})")
    lines = [f"# Generation throughput\n\nDevice: {device}; torch {torch.__version__}; threads: the run's torch threads.\n",
             "| run | threads | images generated | seconds | images/s |", "|---|---|---|---|---|"]
    for name, run_dir in rows:
        m = metrics(run_dir)[0]
        if m.get("generated_images"):
            lines.append(f"| {name} | {summary(run_dir).get('threads_per_worker', '?')} | {m['generated_images']} | "
                         f"{m['generation_seconds']:.1f} | {m['generation_images_per_second']:.3f} |")
    return "\n".join(lines) + "\n"


def copy_grids(scenario: str, root: Path, seed: int, results_dir: Path) -> None:
    for row in ("fedcado_ft", "sd_gen"):
        src = root / f"{row}-s{seed}" / "synthetic"
        dest = results_dir / "grids" / scenario / row
        if src.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            for png in src.glob("client_*.png"):
                shutil.copy2(png, dest / png.name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "fedcado")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS),
                    help="the scenarios whose runs are started; every scenario's finished runs of --seeds are "
                         "tabulated")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--hetero-seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--only-report", action="store_true", help="tabulate the finished runs, start none")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where the tables go (a sub-folder keeps the published ones, e.g. for other models)")
    args = ap.parse_args()
    results_dir = args.results
    results_dir.mkdir(parents=True, exist_ok=True)
    everything: dict[str, Any] = {}
    generating: list[tuple[str, Path]] = []
    # Every scenario is tabulated from its finished runs; only --scenarios start runs. So the shared files
    # (throughput.md, results.json) always cover everything on disk.
    for scenario in SCENARIOS:
        start = scenario in args.scenarios and not args.only_report
        config, kind = SCENARIOS[scenario]
        variants = [("", args.seeds, False)]
        if scenario == HETERO_SCENARIO and args.hetero_seeds:
            variants.append(("hetero_", args.hetero_seeds, True))
        for prefix, seeds, hetero in variants:
            root = args.out / scenario / ("hetero" if hetero else "")
            rows = [r for r in ROWS if not (hetero and r == "fedavg")]  # Table 4 has no FedAvg row
            runs: dict[str, list[Path]] = {r: [] for r in rows}
            classes: dict[int, list[list[int]]] = {}
            for seed in seeds:
                for row in rows:  # fedcado_ft before md/sd: they reuse its synthetic set
                    out = root / f"{row}-s{seed}"
                    extra = HETERO_MODEL if hetero else []
                    if start:
                        run(config, out, overrides_of(row, root, seed, hetero) + extra)
                    if (out / "summary.json").exists():
                        runs[row].append(out)
                classes[seed] = client_classes(root, seed)
            runs = {r: paths for r, paths in runs.items() if len(paths) == len(seeds)}
            if not runs:  # nothing finished for this scenario here: no empty table
                continue
            results: dict[str, Any] = {}
            title = f"{scenario} ({kind}{', heterogeneous client models' if hetero else ''})"
            text = table(title, kind, runs, classes, seeds, results) + ordering_note(results)
            write_text(results_dir / f"{prefix}{scenario}.md", text)
            print(text, flush=True)
            everything[f"{prefix}{scenario}"] = results
            generating += [(f"{prefix}{scenario}/{p.name}", p)
                           for r in ("fedcado_ft", "sd_gen") for p in runs.get(r, [])]
            if not hetero and seeds:
                copy_grids(scenario, root, seeds[0], results_dir)
    write_text(results_dir / "throughput.md", throughput(generating))
    write_text(results_dir / "results.json", json.dumps(everything, indent=1) + "\n")


if __name__ == "__main__":
    main()
