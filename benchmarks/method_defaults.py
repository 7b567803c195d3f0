"""Every method on its defaults against FedAvg on the same network, seeds 0-2, on the configs a new user starts
from: does a method's default fall below FedAvg by more than its seed spread?

For each config and seed, every registered method runs on the config as it is (``method.name=<m>`` and
nothing else), except the settings a method declares it needs (``model_requirements``, FedDW's bias-free
head): those are set for the method *and* for a FedAvg run on the same network, which is then its reference.
The table pairs each method's last-k accuracy with its reference's, seed by seed: the mean difference, a
95 % t-interval of the paired differences, and the method's own seed spread (sample std of its last-k).

    .venv/bin/python benchmarks/method_defaults.py [--configs configs/demo.yaml ...] [--seeds 0 1 2]
                                                   [--methods fedavg moon ...] [--out runs/method_defaults]
                                                   [--verbose]   # each run's rounds as well
    .venv/bin/python benchmarks/method_defaults.py --report     # only the table, from the finished runs

Runs are resumable (kept when finished, continued when started); the table and status go to
benchmarks/results/method_defaults/<config>.md. A method the config cannot run (its pre-flight check refuses
it) is left out and listed with the check's reason. The guided methods run on the embedded guidance model where a
config names none (``guidance.model``'s default).

``--personal`` asks the other question of the methods whose clients keep a model of their own (Ditto, pFedMe,
FedRep, Local, ...), whose global accuracy scores those models on the whole test set: the same runs with
``eval.mode=both``, compared on their personal last-k accuracy (each client's model on its own test split, drawn
with its label mix) against FedAvg's global model on the same splits; the table goes to <config>_personal.md.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import FROM_DEFAULTS, REPO, ensure_run, summary  # noqa: E402

from fedguide.core.atomic import write_text  # noqa: E402
from fedguide.report.measures import measure  # noqa: E402
from fedguide.report.runs import load_run  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "method_defaults"
CONFIGS = [REPO / "configs/demo.yaml", REPO / "configs/fmnist_dir0.1.yaml"]
# Methods whose setup generates images with the guidance model (minutes to hours on a CPU): they run last.
GENERATING = ("fedcado", "sd_gen", "feddda", "feddisc")
# Two-sided 95 % t quantiles by degrees of freedom (n - 1 paired seeds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
# The number each table compares: the global last-k accuracy, or (--personal) the personal one.
COMPARED = {"last_k": "last-k accuracy (the config's report.last_k)",
            "personal_last_k": "personal last-k accuracy (eval.mode both: the mean over clients of each client's "
                               "model on its own test split; FedAvg's is its global model on the same splits)"}


def personal_methods() -> list[str]:
    """The methods whose clients keep a model of their own (they override ``Method.personal_model``)."""
    from fedguide.methods import METHODS
    from fedguide.methods.base import Method

    return [n for n in METHODS.names() if METHODS.get(n).obj.personal_model is not Method.personal_model]


def requirement_overrides(name: str) -> list[str]:
    from fedguide.methods import METHODS

    return [f"model.{k}={json.dumps(v)}" for k, v in sorted(METHODS.get(name).obj.model_requirements.items())]


def methods_for(config: Path, chosen: list[str] | None) -> tuple[list[str], list[str]]:
    """(methods to run on ``config``, methods its pre-flight check refuses, each with the check's reason)."""
    from fedguide.config import load_config
    from fedguide.fl.preflight import check
    from fedguide.methods import METHODS
    from fedguide.registry import ConfigError

    names = chosen or list(METHODS.names())
    run, left = [], []
    for name in names:
        try:
            check(load_config(config, [*FROM_DEFAULTS, f"method.name={name}", *requirement_overrides(name)]))
            run.append(name)
        except (ConfigError, ValueError) as err:
            left.append(f"{name} ({err})")
    return run, left


def run_dir(out: Path, config: Path, label: str, seed: int) -> Path:
    return out / config.stem / f"{label}-s{seed}"


def reference_label(name: str) -> str:
    """FedAvg on the method's network: plain fedavg, or fedavg with the method's requirements."""
    needs = requirement_overrides(name)
    return "fedavg" if not needs else "fedavg[" + ",".join(o.removeprefix("model.") for o in needs) + "]"


def plan(config: Path, names: list[str], seeds: list[int], out: Path,
         extra: tuple[str, ...] = ()) -> list[tuple[Path, list[str]]]:
    """The runs in the order they go: method by method, every seed of one before the next (each with its FedAvg
    reference of that seed first), the methods that generate images last, so that a suite stopped part way
    leaves whole rows of the table and the hours of image generation wait for everything else. ``extra``: overrides
    every run gets (``eval.mode=both`` for --personal)."""
    runs, seen = [], set()
    order = sorted(["fedavg", *names], key=lambda name: name in GENERATING)
    for name in order:
        for seed in seeds:
            for label, overrides in ((reference_label(name), ["method.name=fedavg", *requirement_overrides(name)]),
                                     (name, [f"method.name={name}", *requirement_overrides(name)])):
                folder = run_dir(out, config, label, seed)
                if folder not in seen:
                    seen.add(folder)
                    runs.append((folder, [*FROM_DEFAULTS, *overrides, *extra, f"seed={seed}"]))
    return runs


def last_k(folder: Path, metric: str = "last_k") -> float | None:
    if not (folder / "summary.json").exists():
        return None
    if metric == "last_k":
        return summary(folder)["accuracy_last_k"]
    run = load_run(folder)  # the personal series over the run's own last k scored rounds
    return measure(run, "last_k", run.last_k, "personal_accuracy")


def diverged(folder: Path) -> bool:
    """Whether the run stopped on a diverged loss (its stopped.json). Such a run fails the same way every time it
    is tried: the table says so rather than leave the seed out."""
    from fedguide.fl.run_folder import RunFolder

    why = None if (folder / "summary.json").exists() else RunFolder(folder).read_stopped()
    return bool(why) and why.get("reason") == "diverged"


def table(config: Path, names: list[str], left: list[str], seeds: list[int], out: Path,
          metric: str = "last_k") -> str:
    personal = metric != "last_k"
    script = "benchmarks/method_defaults.py" + (" --personal" if personal else "")
    lines = [f"# Method defaults against FedAvg on the same network{' (personal accuracy)' if personal else ''}: "
             f"{config.relative_to(REPO)}", "",
             f"Seeds {', '.join(map(str, seeds))}; {COMPARED[metric]}; "
             f"differences paired by seed. Made with `{script}`, {date.today().isoformat()}, 2-core CPU.", "",
             f"| method | reference | seeds | {'personal ' if personal else ''}last-k % mean ± std | "
             "Δ vs reference (points) | 95 % paired interval | below by more than its seed spread |",
             "|---|---|---:|---:|---:|---:|---|"]
    for name in names:
        ref = reference_label(name)
        pairs = [(last_k(run_dir(out, config, name, s), metric), last_k(run_dir(out, config, ref, s), metric))
                 for s in seeds]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        lost = [s for s in seeds if diverged(run_dir(out, config, name, s))]
        count = f"{len(pairs)}" + (f" (seed {', '.join(map(str, lost))} diverged)" if lost else "")
        if not pairs:
            lines.append(f"| {name} | {ref} | {count} | — | — | — | {'not run yet' if not lost else '—'} |")
            continue
        own = [a for a, _ in pairs]
        diffs = [100 * (a - b) for a, b in pairs]
        mean = statistics.fmean(diffs)
        spread = 100 * statistics.stdev(own) if len(own) > 1 else float("nan")
        half = T95.get(len(diffs) - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 \
            else float("nan")
        cell = f"{100 * statistics.fmean(own):.2f}" + (f" ± {spread:.2f}" if len(own) > 1 else "")
        interval = f"[{mean - half:+.2f}, {mean + half:+.2f}]" if len(diffs) > 1 else "—"
        is_reference = name == reference_label("fedavg")  # FedAvg's own row (fedavg_sm is a method of its own)
        below = "—" if is_reference else ("**yes**" if len(own) > 1 and -mean > spread else "no")
        if not is_reference and all(d == 0 for d in diffs):
            # its defaults left it its reference's run (FedCDA inside its warm-up): said, not read as a tie
            below += " (the reference's accuracy on every seed)"
        lines.append(f"| {name} | {ref} | {count} | {cell} | {mean:+.2f} | {interval} | {below} |")
    if left:
        lines += ["", "Left out on this config: " + "; ".join(left) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", type=Path, default=CONFIGS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--out", type=Path, default=None, help="runs/method_defaults (runs/method_defaults_personal "
                                                            "with --personal)")
    ap.add_argument("--personal", action="store_true",
                    help="the methods with personal models (or --methods), with eval.mode=both, compared on "
                         "personal accuracy")
    ap.add_argument("--report", action="store_true", help="write the tables from the finished runs only")
    ap.add_argument("--verbose", action="store_true",
                    help="print each run's rounds too (by default a run prints its start and its result: the "
                         "runs of configs/fmnist_dir0.1.yaml take minutes to hours each)")
    args = ap.parse_args()
    out = args.out or REPO / "runs" / ("method_defaults_personal" if args.personal else "method_defaults")
    metric, extra, suffix = ("personal_last_k", ("eval.mode=both",), "_personal") if args.personal \
        else ("last_k", (), "")
    chosen = args.methods or (personal_methods() if args.personal else None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for config in args.configs:
        config = config.resolve()
        names, left = methods_for(config, chosen)
        runs = plan(config, names, args.seeds, out, extra)
        result = RESULTS / f"{config.stem}{suffix}.md"
        for folder, overrides in runs:  # the runs of an earlier sitting, from their records
            ensure_run(config, folder, overrides, execute=False)
        if not args.report:
            for i, (folder, overrides) in enumerate(runs, 1):
                print(f"[{i}/{len(runs)}] {config.stem}: {folder.name}", flush=True)
                try:
                    ensure_run(config, folder, overrides, quiet=not args.verbose)
                except subprocess.CalledProcessError as err:  # one method's failure leaves the others to run
                    print(f"[{i}/{len(runs)}] {folder.name}: FAILED (exit {err.returncode}); the next invocation "
                          "tries it again", flush=True)
                    continue
                write_text(result, table(config, names, left, args.seeds, out, metric))
        write_text(result, table(config, names, left, args.seeds, out, metric))
        print(result.read_text())


if __name__ == "__main__":
    main()
