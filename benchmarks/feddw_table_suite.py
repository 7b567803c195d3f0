"""FedDW Table I's shape on Fashion-MNIST, global and personal accuracy side by side, with Table IV's +DW
pairs: every method of those tables that fedguide has, in both settings of configs/feddw_fmnist.yaml
("practical": Dir(0.5), full participation; "pathological": Dir(0.1), 50 %), seeds 0-2, eval.mode both.

FedDW and every +DW run use the μ that feddw_suite.py chose on seed 0 of the setting
(benchmarks/results/feddw/<setting>/chosen_mu.txt): μ is not tuned again here. Every method of a seed runs
on the same partition and the same personal test splits (both depend on the seed alone), so runs of one
seed pair. Resumable: finished runs are kept, started ones continued, the others started; a run that fails
is named and skipped, and the next invocation tries it again. Runs go seed by seed (within a seed: method
by method, both settings each), so an interrupted suite leaves whole seeds of the leading methods.

    .venv/bin/python benchmarks/feddw_table_suite.py [--out runs/feddw_table] [--settings ...] [--seeds ...]
    .venv/bin/python benchmarks/feddw_table_suite.py --report   # only the tables, from the finished runs
    .venv/bin/python benchmarks/feddw_table_suite.py --only fedavg fedrep fedper --out runs/x --results DIR

The pFL rows that take ``method.protocol`` run FedDW's released protocol for them (``protocol: feddw``).

Reports (``fedguide report --vs fedavg``, per setting) and the combined tables (tables.md: Table I's shape,
every statistic per setting, paired differences against FedAvg and of X+DW against X, global and personal)
land in benchmarks/results/feddw_table/, with status.md saying how many runs had finished.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import cli, ensure_run, mean_std  # noqa: E402
from feddw_suite import CONFIG, SETTINGS  # noqa: E402

from fedguide.core.atomic import write_text  # noqa: E402
from fedguide.report.measures import common_k, measure  # noqa: E402
from fedguide.report.paired import bootstrap_interval  # noqa: E402
from fedguide.report.runs import RunRecord, load_run  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "feddw_table"
MU_DIR = REPO / "benchmarks" / "results" / "feddw"
# The clients' personal scores every 5 rounds and in the last k (eval.personal_every): the tables' personal last-k
# statistics, the training and the global scores are those of scoring every round (runs started before this
# setting scored every round); FedBABU fine-tunes every client to score it, most of such a round's time.
EVAL = ["eval.mode=both", "eval.personal_every=5"]
SEEDS = (0, 1, 2)
REFERENCE = "fedavg"
# Table I's rows that fedguide has, then Table IV's: the reference and the paper's method first, the
# methods new to these tables next, those with earlier results (benchmarks/results/feddw) after them, and
# Table I's weakest rows (FedProto, Local) last, so a suite cut short has lost the least.
ORDER = ("fedavg", "feddw", "fedbabu", "feduv", "fedrep", "fedper", "fedala", "perfedavg", "feddistill_plus",
         "fedprox", "moon", "moon+dw", "feduv+dw", "feddistill_plus+dw", "fedprox+dw", "fedproto", "local")
DW = "+dw"
LAST_LOCAL = "readings.last_local"  # the per-round metric of method.last_local_eval
PAPER_NAMES = {"fedavg": "FedAvg", "feddw": "FedDW", "fedbabu": "FedBABU", "feduv": "FedUV", "fedrep": "FedRep",
               "fedper": "FedPer", "fedala": "FedALA", "perfedavg": "Per-FedAvg", "feddistill_plus": "FedDistill+",
               "fedprox": "FedProx", "moon": "MOON", "fedproto": "FedProto", "local": "Local"}


@dataclass(frozen=True)
class Planned:
    setting: str
    label: str  # method name, "feddw", or "<method>+dw"
    seed: int
    out: Path
    overrides: tuple[str, ...]


def chosen_mu(setting: str) -> float:
    path = MU_DIR / setting / "chosen_mu.txt"
    if not path.is_file():
        raise SystemExit(f"{path.relative_to(REPO)} is missing; run benchmarks/feddw_suite.py --settings {setting} "
                         "first (it chooses FedDW's mu on seed 0), so that this suite uses the same mu")
    return float(path.read_text().strip())


def method_of(label: str) -> str:
    return label.removesuffix(DW)


def display(label: str) -> str:
    base = PAPER_NAMES.get(method_of(label), method_of(label))
    return base + ("+DW" if label.endswith(DW) else "")


def has_feddw_protocol(name: str) -> bool:
    """Whether the method takes ``protocol: feddw`` (FedDW's released protocol for its pFL rows)."""
    from fedguide.methods import METHODS
    return "protocol" in METHODS.get(name).params.model_fields


def overrides_for(label: str, mu: float) -> list[str]:
    """A row as FedDW's tables ran it: its pFL rows under FedDW's released protocol (method.protocol=feddw:
    the released codes' phases and evaluation, personalised/_protocol.py)."""
    name = method_of(label)
    if label.endswith(DW):
        return [f"method.name={name}", f"regularizers=[{{name: dw, mu: {mu}}}]"]
    if name == "feddw":
        return ["method.name=feddw", f"method.mu={mu}"]
    return [f"method.name={name}", *(["method.protocol=feddw"] if has_feddw_protocol(name) else [])]


def registered_methods() -> set[str]:
    from fedguide.methods import METHODS
    return set(METHODS.names())


def plan(root: Path, settings: list[str], seeds: list[int], available: set[str],
         only: Optional[list[str]] = None) -> list[Planned]:
    mus = {s: chosen_mu(s) for s in settings}
    runs = []
    for seed in seeds:
        for label in ORDER:
            if method_of(label) not in available or (only and label not in only):
                continue
            for setting in settings:
                over = [*SETTINGS[setting], f"seed={seed}", *overrides_for(label, mus[setting]), *EVAL]
                runs.append(Planned(setting, label, seed, root / setting / f"{label}-s{seed}", tuple(over)))
    return runs


def missing_labels(available: set[str]) -> list[str]:
    return [label for label in ORDER if method_of(label) not in available]


def finished(run: Planned) -> bool:
    return (run.out / "summary.json").is_file()


def execute(runs: list[Planned]) -> list[Planned]:
    """Every run, finished ones kept; the runs that failed."""
    failed = []
    for i, run in enumerate(runs, 1):
        tag = f"[{i}/{len(runs)}] {run.setting}/{run.out.name}"
        if finished(run):
            print(f"{tag}: finished earlier", flush=True)
            continue
        print(f"{tag}: {'continuing' if (run.out / 'config.yaml').is_file() else 'starting'} "
              f"({datetime.now().strftime('%Y-%m-%d %H:%M')})", flush=True)
        try:
            ensure_run(CONFIG, run.out, list(run.overrides))
        except subprocess.CalledProcessError as err:
            print(f"{tag}: FAILED (exit {err.returncode}); the next invocation tries it again", flush=True)
            failed.append(run)
            continue
        s = load_run(run.out).summary
        if s is None:  # ended without a summary (a diverged run says so in its folder)
            print(f"{tag}: STOPPED without a summary ({load_run(run.out).status})", flush=True)
            failed.append(run)
            continue
        print(f"{tag}: last-k {100 * s['accuracy_last_k']:.2f}%  final {100 * s['final_accuracy']:.2f}%  "
              f"personal final {100 * s.get('final_personal_accuracy', float('nan')):.2f}%  "
              f"{s['wall_seconds'] / 60:.0f} min", flush=True)
    return failed


# --- the tables ------------------------------------------------------------------------------------------


def _records(runs: list[Planned]) -> dict[tuple[str, str], list[RunRecord]]:
    """(setting, label) -> the finished runs, in seed order."""
    out: dict[tuple[str, str], list[RunRecord]] = {}
    for run in runs:
        if finished(run):
            out.setdefault((run.setting, run.label), []).append(load_run(run.out))
    return out


def _stat(recs: list[RunRecord], metric: str, key: str = "accuracy") -> str:
    k = common_k(recs)
    return mean_std([v for r in recs if (v := measure(r, metric, k, key)) is not None], len(SEEDS))


def _paired(mine: list[RunRecord], theirs: list[RunRecord], key: str, their_key: Optional[str] = None) -> str:
    """mean Δ (pp) of the last-k ``key`` over the seeds both have (against ``their_key`` of the others, ``key``
    unless given), its bootstrap interval, and each seed's Δ."""
    ref = {r.seed: r for r in theirs}
    pairs = [(r, ref[r.seed]) for r in mine if r.seed in ref]
    if not pairs:
        return "—"
    k = common_k([r for p in pairs for r in p])
    diffs = [measure(a, "last_k", k, key) - measure(b, "last_k", k, their_key or key) for a, b in pairs]
    ci = bootstrap_interval(diffs)
    interval = f" [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]" if ci else ""
    per_seed = ", ".join(f"{100 * d:+.2f}" for d in diffs)
    return f"{100 * statistics.fmean(diffs):+.2f}{interval} ({per_seed})"


def tables(runs: list[Planned], settings: list[str], missing: list[str]) -> str:
    recs = _records(runs)
    labels = [label for label in ORDER if any((s, label) in recs for s in settings)]
    done = sum(finished(r) for r in runs)
    lines = [
        "# FedDW Tables I and IV on Fashion-MNIST: global and personal accuracy",
        "",
        f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} by "
        "`benchmarks/feddw_table_suite.py --report` from the runs finished by then: "
        f"**{done} of {len(runs)}**.",
        *([f"Not in fedguide when the suite ran (no runs): {', '.join(missing)}."] if missing else []),
        "",
        "*last-k* is the number to compare: the mean over each run's last k rounds (the last 10 % of its "
        "rounds rounded up to even, at least 2: k = 2 of 20 rounds in configs/feddw_fmnist.yaml). "
        "*global*: the server's model as each method defines it (FedDW's protocol; FedRep, FedPer, FedALA, Local: "
        "the mean over the clients of their own models on the global test set). *personal*: each client's "
        "model after the method's personalisation step on the client's own test split, pooled over clients; "
        "methods without a personal model score the global model there (eval.finetune_steps 0), so their "
        "personal accuracy equals their global one (FedProto's global accuracy is its nearest-prototype rule, "
        "its personal one the classification layer's). Cells: mean ± sample std over seeds in %, with the number "
        "of seeds when fewer than 3 have finished.",
        "",
        "## Table I's shape (last-k accuracy %)",
        "",
        "| method | " + " | ".join(f"{s} global | {s} personal" for s in settings) + " |",
        "|---|" + "---:|---:|" * len(settings),
    ]
    for label in labels:
        cells = []
        for s in settings:
            r = recs.get((s, label), [])
            cells += [_stat(r, "last_k"), _stat(r, "last_k", "personal_accuracy")]
        lines.append(f"| {display(label)} | " + " | ".join(cells) + " |")
    for s in settings:
        lines += ["", f"## {s}: every statistic (%)", "",
                  "| method | seeds | last-k acc | final acc | best acc† | last-k personal | final personal "
                  "| last-k personal min |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for label in labels:
            r = recs.get((s, label), [])
            if not r:
                continue
            lines.append(f"| {display(label)} | {', '.join(str(x.seed) for x in r)} | " + " | ".join([
                _stat(r, "last_k"), _stat(r, "final"), _stat(r, "best"),
                _stat(r, "last_k", "personal_accuracy"), _stat(r, "final", "personal_accuracy"),
                _stat(r, "last_k", "personal_accuracy_min")]) + " |")
        lines.append("")
        lines.append("† best: the maximum over rounds, picked with the test set, so optimistic. *personal min*: the "
                     "worst client (with 10 clients also the bottom-10 % mean that the reports show).")
    pair_note = ("Δ in percentage points of the last-k accuracy, per seed between runs of the same seed (same "
                 "partition, initial weights and sampled clients); shown: the mean over the paired seeds, a 95 % "
                 "percentile bootstrap interval of that mean in brackets (10,000 resamples, numpy seed 0; none "
                 "below 2 pairs, coarse with 3), and the per-seed differences in seed order.")
    lines += ["", f"## Paired differences against {PAPER_NAMES[REFERENCE]}", "",
              "| method | " + " | ".join(f"{s} Δ global | {s} Δ personal" for s in settings) + " |",
              "|---|" + "---:|---:|" * len(settings)]
    for label in labels:
        if label == REFERENCE:
            continue
        cells = []
        for s in settings:
            mine, ref = recs.get((s, label), []), recs.get((s, REFERENCE), [])
            cells += [_paired(mine, ref, "accuracy"), _paired(mine, ref, "personal_accuracy")]
        lines.append(f"| {display(label)} | " + " | ".join(cells) + " |")
    if not any(label != REFERENCE for label in labels):
        lines.append("| (no other method finished yet) |" + " |" * (2 * len(settings)))
    lines += ["", pair_note, *_last_local_section(recs, labels, settings),
              "", "## Table IV: what DW adds (X+DW − X)", "",
              "| pair | " + " | ".join(f"{s} Δ global | {s} Δ personal" for s in settings) + " |",
              "|---|" + "---:|---:|" * len(settings)]
    # FedDW itself is FedAvg+DW: Table IV sets it beside FedAvg. A suite of some rows (--only) shows the pairs it ran.
    pairs = [(label, REFERENCE if label == "feddw" else method_of(label)) for label in labels
             if label == "feddw" or label.endswith(DW)]
    for with_dw, base in pairs:
        cells = []
        for s in settings:
            mine, ref = recs.get((s, with_dw), []), recs.get((s, base), [])
            cells += [_paired(mine, ref, "accuracy"), _paired(mine, ref, "personal_accuracy")]
        lines.append(f"| {display(with_dw)} − {display(base)} | " + " | ".join(cells) + " |")
    if not pairs:
        lines.append("| (no +DW row in these runs) |" + " |" * (2 * len(settings)))
    lines += ["", pair_note, ""]
    return "\n".join(lines)


def _last_local_section(recs: dict[tuple[str, str], list[RunRecord]], labels: list[str],
                        settings: list[str]) -> list[str]:
    """FedDW's own global reading of its split-model rows beside the averaged-body one, for the rows whose runs
    recorded it (``method.last_local_eval``, set by ``protocol: feddw``); no lines when none did."""
    readers = [label for label in labels
               if any(r.series(LAST_LOCAL)[1] for s in settings for r in recs.get((s, label), []))]
    if not readers:
        return []
    lines = ["", "## FedRep and FedPer as FedDW's code scores them (`inference_by_pFL`)", "",
             "*averaged body*: the global accuracy of the tables above, the mean over the clients of the averaged "
             "body with each client's own head. *last local*: each client's model as its last local training left "
             "it (its own body and head; `readings.last_local`, FedDW's `inference_by_pFL`, which its Table I "
             "reports), mean over the clients on the global test set. Last-k %, mean ± std over seeds; Δ: *last "
             "local* minus FedAvg's global accuracy, paired by seed.", "",
             "| method | " + " | ".join(f"{s} averaged body | {s} last local | {s} Δ last local vs FedAvg"
                                      for s in settings) + " |",
             "|---|" + "---:|---:|---:|" * len(settings)]
    for label in readers:
        cells = []
        for s in settings:
            r, ref = recs.get((s, label), []), recs.get((s, REFERENCE), [])
            cells += [_stat(r, "last_k"), _stat(r, "last_k", LAST_LOCAL), _paired(r, ref, LAST_LOCAL, "accuracy")]
        lines.append(f"| {display(label)} | " + " | ".join(cells) + " |")
    return lines


def status(runs: list[Planned], failed: list[Planned], missing: list[str]) -> str:
    done = [r for r in runs if finished(r)]
    started = [r for r in runs if not finished(r) and (r.out / "config.yaml").is_file()]
    lines = ["# Status of benchmarks/feddw_table_suite.py",
             "",
             f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}: {len(done)} of {len(runs)} runs finished"
             f"{f', {len(started)} started (running or interrupted)' if started else ''}.",
             ""]
    if missing:
        lines += [f"Methods not registered in fedguide when it ran (no runs planned): {', '.join(missing)}.", ""]
    if failed:
        lines += ["Failed in the last invocation (tried again by the next): "
                  + ", ".join(f"{r.setting}/{r.out.name}" for r in failed) + ".", ""]
    lines += ["| setting | run | state |", "|---|---|---|"]
    for r in runs:
        state = ("finished" if finished(r) else "started (running or interrupted)" if (r.out / "config.yaml").is_file()
                 else "not started")
        lines.append(f"| {r.setting} | {r.out.name} | {state} |")
    return "\n".join(lines) + "\n"


def report(runs: list[Planned], settings: list[str], failed: list[Planned], missing: list[str],
           results: Path = RESULTS) -> None:
    for s in settings:
        done = [r.out for r in runs if r.setting == s and finished(r)]
        if not done:
            continue
        vs = ["--vs", REFERENCE] if any(r.setting == s and r.label == REFERENCE and finished(r) for r in runs) else []
        cli("report", *done, *vs, "--rows", "method", "--cols", "partition", "--out", results / s)
    write_text(results / "tables.md", tables(runs, settings, missing))
    write_text(results / "status.md", status(runs, failed, missing))
    print(f"tables: {results / 'tables.md'}", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "feddw_table")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--only", nargs="+", choices=list(ORDER), help="these rows only (e.g. the reference and the "
                    "pFL rows after a change to them); write their tables with --results")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the tables and reports")
    ap.add_argument("--report", action="store_true", help="write the tables from the finished runs; run nothing")
    args = ap.parse_args(argv)
    available = registered_methods()
    missing = missing_labels(available)
    if missing:
        print(f"not registered, so not run: {', '.join(missing)}", flush=True)
    runs = plan(args.out.resolve(), args.settings, args.seeds, available, args.only)
    for run in runs:  # the runs finished in an earlier sitting, from their records (and records for new ones)
        ensure_run(CONFIG, run.out, list(run.overrides), execute=False)
    failed = [] if args.report else execute(runs)
    report(runs, args.settings, failed, missing, args.results.resolve())


if __name__ == "__main__":
    main()
