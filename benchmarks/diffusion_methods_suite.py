"""FedDifRC and SemanticFL against the label-shift baselines on Fashion-MNIST, on the embedded guidance models.

Base config: configs/feddifrc_fmnist.yaml (a quarter of the client pool, the public slice held out, 10
clients, the CNN, 20 rounds of E = 1, full participation so every method of a seed trains on the same
partition and the same clients each round). Scenarios: Dirichlet 0.05, Dirichlet 0.2, NID2 (9 single-class
clients + 1 holding every class, 10 clients) and long tail rho = 10 with Dirichlet 0.2 on top. Methods:
FedAvg, MOON, FedRCL (when registered), FedDifRC (fused features lifted from 256 dims into the CNN's 512,
see the config), SemanticFL; seeds 0-2. FedDifRC and SemanticFL run with the options the guidance study chose
on the demo's validation split (``--options chosen``, the default; see CHOSEN_ON below), or on their papers'
defaults (``--options defaults``, the tables published before the study).

Outputs, under benchmarks/results/diffusion_methods/:
- ``<scenario>/`` the ``fedguide report`` of its runs (table with final and best accuracy, curves);
- ``table.md``: per scenario and method, the mean accuracy of the last 4 rounds (the statistic compared:
  under strong label skew the accuracy swings from round to round) and the final accuracy, mean ± sample
  std over the seeds; the paired difference of each against FedAvg per seed, its bootstrap interval and
  whether it is beyond the seed spread; the best accuracy (optimistic);
- ``overhead.md``: per scenario and seed, the mean round time of FedDifRC and SemanticFL divided by
  FedAvg's from this same suite (target <= 1.2; the paper's FedDifRC costs 1.48x FedAvg), with the
  one-off feature extraction (their setup, before round 1) reported separately;
- ``commands.txt``: every invocation that fed the tables (README.md there is the hand-written reading).

Resumable: a finished run (summary.json) is kept; an interrupted one resumes from its last checkpoint;
feature caches are shared through guidance.feature_cache, so each seed's features are extracted once
(the Dirichlet and NID2 scenarios train on the same samples; the long tail on a subset, extracted apart).

    .venv/bin/python benchmarks/diffusion_methods_suite.py [--options chosen|defaults] [--out DIR] [--seeds 0 1 2]
        [--scenarios dir0.05 dir0.2 nid2 lt10] [--methods fedavg moon fedrcl feddifrc semanticfl]
        [--set guidance.model=DIR ...] [--results DIR]
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import cli, ensure_run, mean_std, seed_note, summary  # noqa: E402

from fedguide.core.atomic import write_text  # noqa: E402
from fedguide.report.paired import bootstrap_interval  # noqa: E402

CONFIG = REPO / "configs/feddifrc_fmnist.yaml"
RESULTS = REPO / "benchmarks" / "results" / "diffusion_methods"
SCENARIOS = {
    "dir0.05": ["partition.alpha=0.05"],
    "dir0.2": ["partition.alpha=0.2"],
    "nid2": ["partition.name=nid2", "partition.n_biased=9", "partition.n_unbiased=1"],
    "lt10": ["partition.name=longtail", "partition.rho=10",
             "partition.then={name: dirichlet, alpha: 0.2, min_size: 10}"],
}
METHODS = {
    "fedavg": ["method.name=fedavg"],
    "moon": ["method.name=moon"],
    "fedrcl": ["method.name=fedrcl"],
    "feddifrc": ["method.name=feddifrc", "method.fused_dim=256"],
    "semanticfl": ["method.name=semanticfl"],
}
GUIDED = ("feddifrc", "semanticfl")
# --options chosen (the default): the guided methods run with the options benchmarks/guidance_study.py chose
# for the embedded model on the demo's validation split (benchmarks/results/guidance_study/demo.chosen.json,
# also configs/demo.yaml's method_options), not tuned again here: this suite is their test on other
# partitions. --options defaults runs each method's own defaults, the papers' values (the tables before the
# study); its runs and tables go to their own folders (runs/diffusion_methods/defaults, RESULTS/defaults).
CHOSEN_ON = "demo"
TAIL = 4  # rounds averaged in the last-rounds table (an even number: both phases of a period-2 swing)


def registered() -> set[str]:
    out = cli("list", "--json", capture=True)
    return {m["name"] for m in json.loads(out)["methods"]}


def method_overrides(options: str) -> dict[str, list[str]]:
    """METHODS with, for ``options`` 'chosen', the guided methods' options the guidance study chose on the
    embedded model."""
    if options == "defaults":
        return METHODS
    from guidance_study import read_chosen

    chosen = read_chosen(CHOSEN_ON)
    out = dict(METHODS)
    for m in GUIDED:
        variant = chosen.get((m, "embedded"))
        if variant is None:
            raise SystemExit(f"the guidance study chose nothing for {m} on the embedded model; run it, or pass "
                             "--options defaults")
        out[m] = METHODS[m] + [f"method.{k}={v}" for k, v in variant.options]
    return out


def run(out: Path, overrides: list[str]) -> Path:
    ensure_run(CONFIG, out, overrides)
    print(f"{out.parent.name}/{out.name:<16} final {100 * summary(out)['final_accuracy']:.2f}%", flush=True)
    return out


def extraction_seconds(path: Path, method: str) -> float | None:
    record = path / "guidance" / f"{method}.json"
    return json.loads(record.read_text()).get("setup_seconds") if record.is_file() else None


def finished(out: Path, scenarios: list[str], seeds: list[int]) -> dict:
    """Every finished run under ``out`` of these scenarios and seeds, this invocation's or an earlier one's."""
    return {(sc, m, s): out / sc / f"{m}-s{s}" for sc in scenarios for m in METHODS for s in seeds
            if (out / sc / f"{m}-s{s}" / "summary.json").is_file()}


def metric_table(title: str, value, summaries: dict, scenarios: list[str], methods: list[str],
                 seeds: list[int]) -> list[str]:
    """Markdown lines: per scenario and method, mean ± std over seeds of ``value(summary)``."""
    lines = [title, "", "| scenario | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for sc in scenarios:
        cells = [mean_std([value(summaries[sc, m, s]) for s in seeds if (sc, m, s) in summaries], len(seeds))
                 for m in methods]
        lines.append(f"| {sc} | " + " | ".join(cells) + " |")
    return lines


def last_mean(r: dict) -> float:
    return statistics.fmean(r["accuracy_curve"][-TAIL:])


def paired_cell(diffs: list[float], seeds: int) -> str:
    """'mean Δ [bootstrap interval] (per-seed Δ) verdict' in points; the verdict says whether every seed's
    difference has the mean's sign and the interval excludes 0 (beyond the seed spread) or not."""
    if not diffs:
        return "—"
    mean = statistics.fmean(diffs)
    ci = bootstrap_interval(diffs)
    interval = f" [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]" if ci else ""
    beyond = ci is not None and (ci[0] > 0 or ci[1] < 0) and all((d > 0) == (mean > 0) and d != 0 for d in diffs)
    verdict = (" **beyond spread**" if beyond else " within spread") if ci else ""
    per_seed = ", ".join(f"{100 * d:+.2f}" for d in diffs)
    return f"{100 * mean:+.2f}{interval} ({per_seed}){verdict}{seed_note(len(diffs), seeds)}"


def gains_table(title: str, value, summaries: dict, scenarios: list[str], methods: list[str],
                seeds: list[int]) -> list[str]:
    others = [m for m in methods if m != "fedavg"]
    lines = ["", title, "", "| scenario | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
    for sc in scenarios:
        cells = [paired_cell([value(summaries[sc, m, s]) - value(summaries[sc, "fedavg", s]) for s in seeds
                              if (sc, m, s) in summaries and (sc, "fedavg", s) in summaries], len(seeds))
                 for m in others]
        lines.append(f"| {sc} | " + " | ".join(cells) + " |")
    return lines


def write_tables(runs: dict, scenarios: list[str], methods: list[str], seeds: list[int], results: Path) -> None:
    summaries = {key: summary(path) for key, path in runs.items()}  # each summary.json read once
    seed_list = ", ".join(map(str, seeds))
    # Under strong label skew the global accuracy swings from one round to the next (period 2, several
    # points at Dirichlet 0.05), so one round's number is noisy: the mean of the last rounds is the
    # statistic compared, the final round beside it.
    tail = metric_table(f"# Mean accuracy of the last {TAIL} rounds (%), mean ± sample std over seeds {seed_list}",
                        last_mean, summaries, scenarios, methods, seeds)
    final = metric_table("\n## Final accuracy (%), mean ± sample std over seeds", lambda r: r["final_accuracy"],
                         summaries, scenarios, methods, seeds)
    note = ("Δ in points against FedAvg, per seed between runs of the same seed (same partition, initial "
            "weights and clients each round); shown: the mean, a 95 % percentile bootstrap interval of it "
            "(10,000 resamples, numpy seed 0; coarse with 3 seeds), the per-seed differences in seed order, and "
            "'beyond spread' when every seed's difference has the mean's sign and the interval excludes 0.")
    gains_tail = gains_table(f"## Paired difference against FedAvg, mean of the last {TAIL} rounds", last_mean,
                             summaries, scenarios, methods, seeds)
    gains_final = gains_table("## Paired difference against FedAvg, final round", lambda r: r["final_accuracy"],
                              summaries, scenarios, methods, seeds)
    best = metric_table("\n## Best accuracy over rounds (%; picked on the test set, so optimistic), mean ± sample std",
                        lambda r: r["best_accuracy"], summaries, scenarios, methods, seeds)
    write_text(results / "table.md", "\n".join(tail + final + ["", note] + gains_tail + gains_final + best) + "\n")

    rows = ["# Round time relative to FedAvg (same suite, same machine)", "",
            "Mean round seconds of the method divided by FedAvg's on the same scenario and seed",
            "(target <= 1.2).",
            "Extraction: the method's one-off setup (PCA fit and feature extraction, before round 1; only",
            "loading when the features came from the cache of an earlier run on the same samples).", "",
            "| scenario | seed | method | round s | FedAvg round s | ratio | extraction s |",
            "|---|---|---|---|---|---|---|"]
    for sc in scenarios:
        for s in seeds:
            if (sc, "fedavg", s) not in runs:
                continue
            base = summaries[sc, "fedavg", s]["mean_round_seconds"]
            for m in GUIDED:
                if (sc, m, s) in runs:
                    own = summaries[sc, m, s]["mean_round_seconds"]
                    extract = extraction_seconds(runs[sc, m, s], m)
                    rows.append(f"| {sc} | {s} | {m} | {own:.2f} | {base:.2f} | {own / base:.2f} | "
                                f"{'—' if extract is None else f'{extract:.1f}'} |")
    write_text(results / "overhead.md", "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--options", choices=("chosen", "defaults"), default="chosen",
                    help="the guided methods' options: the guidance study's choice, or the methods' (papers') defaults")
    ap.add_argument("--out", type=Path, default=None, help="default: runs/diffusion_methods/<options>")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--report-only", action="store_true", help="write the tables from the finished runs only")
    ap.add_argument("--cache", type=Path, default=None, help="guidance.feature_cache (default: the usual cache)")
    ap.add_argument("--results", type=Path, default=None,
                    help="where the tables go (a sub-folder keeps the published ones, e.g. for other guidance "
                         "models); default: RESULTS for --options chosen, RESULTS/defaults for defaults")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides given to every run (e.g. guidance.model=DIR for other guidance models)")
    args = ap.parse_args()
    args.out = args.out or REPO / "runs" / "diffusion_methods" / args.options
    args.results = args.results or (RESULTS if args.options == "chosen" else RESULTS / "defaults")
    options = method_overrides(args.options)
    known = registered()
    methods = [m for m in args.methods if m in known]
    skipped = sorted(set(args.methods) - set(methods))
    if skipped:
        print(f"not registered, skipped: {', '.join(skipped)}", flush=True)
    cache = [f"guidance.feature_cache={args.cache}"] if args.cache else []
    for seed in args.seeds:  # seed-major: each seed's features are extracted once, early
        for sc in args.scenarios:
            for m in methods:
                out = args.out / sc / f"{m}-s{seed}"
                overrides = SCENARIOS[sc] + options[m] + cache + [f"seed={seed}", *args.set]
                if args.report_only:
                    ensure_run(CONFIG, out, overrides, execute=False)  # an earlier sitting's run, from its record
                else:
                    run(out, overrides)  # restores it too, or runs it
    results = args.results
    results.mkdir(parents=True, exist_ok=True)
    # The tables hold every finished run on disk: the costlier baselines may have been run on fewer seeds
    # by another invocation (--methods moon fedrcl --seeds 0); each cell says how many seeds it has.
    runs = finished(args.out, args.scenarios, args.seeds)
    methods = [m for m in METHODS if any(key[1] == m for key in runs)]
    for sc in args.scenarios:
        paths = [str(runs[sc, m, s]) for m in methods for s in args.seeds if (sc, m, s) in runs]
        cli("report", *paths, "--out", results / sc)
    write_tables(runs, args.scenarios, methods, args.seeds, results)
    argv = [".venv/bin/python", "benchmarks/diffusion_methods_suite.py", *sys.argv[1:]]
    # Every invocation that fed the tables is recorded (the baselines may come from a separate one).
    log = results / "commands.txt"
    commands = log.read_text().splitlines() if log.is_file() else []
    command = " ".join(shlex.quote(a) for a in argv)
    if command not in commands:
        write_text(log, "\n".join(commands + [command]) + "\n")
    # README.md there (the reading of the tables) is written by hand: a rerun must not overwrite it.


if __name__ == "__main__":
    main()
