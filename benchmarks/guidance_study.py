"""Where the guidance signal is lost: the diffusion-guided methods on the embedded guidance model and on the
oracle (``guidance.model: oracle``, a supervised network on the guidance pool's labels: the best features the
pool can give), stage by stage, every choice made on a validation split, never on the test set.

Each run holds out ``data.val_fraction`` 0.1 of the training data on the server (before the partition) and
scores it every round; a setting is judged by the mean over seeds of its last-k *validation* accuracy. A
stage's variants run on seeds 0-2 beside FedAvg and FedRCL on the same partitions; the best variant of each
(method, guidance model) by validation goes on to the next stage, which varies one more thing:

    t        the timestep the UNet features are read at: paper (the pipeline-matched t, the default), 0, 50, 150
    weights  the loss weights: FedDifRC's lambda_tdcl x lambda_ndcr, SemanticFL's lambda_kd x lambda_con,
             align_features' lam, each at 0.25, 1 and 4 times the default
    edge     a weight chosen at the edge of the weights grid (4 or 0.25 times its default) one more factor of 4
             further out, the other weights as chosen, and again while the choice keeps moving out (at most
             EDGE_STEPS times): the grid's best may lie beyond it
    tau      the contrastive temperature: FedDifRC's and SemanticFL's tau at half, one and twice the default

The oracle's features are the same at every t (it has no timestep), so its t stage is one variant. The
tables show validation and test last-k (mean +- std over seeds), and the test last-k difference against
FedAvg paired by seed with its bootstrap interval: the test numbers are read, never used to choose.

    .venv/bin/python benchmarks/guidance_study.py [--stages t weights edge tau] [--config configs/demo.yaml]
                                                  [--seeds 0 1 2] [--out runs/guidance_study]
    .venv/bin/python benchmarks/guidance_study.py --report    # the tables from the finished runs only
    .venv/bin/python benchmarks/guidance_study.py --config configs/demo_dir0.05.yaml --transfer demo

``--transfer STEM`` chooses nothing: it runs the references and the variants the stages chose on STEM's config
(``<STEM>.chosen.json``, written with its tables) on ``--config``, and tables them: whether the choices carry to
another setting without tuning there.

Resumable (finished runs kept, started ones continued). Tables: benchmarks/results/guidance_study/<config>.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _runs import FROM_DEFAULTS, ensure_run, mean_std  # noqa: E402

from fedguide.core.atomic import write_text  # noqa: E402
from fedguide.report.measures import common_k  # noqa: E402
from fedguide.report.paired import bootstrap_interval  # noqa: E402
from fedguide.report.runs import RunRecord, last_k_mean, load_run  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "guidance_study"
VALIDATION = ["data.val_fraction=0.1", "data.val_from=server"]
GUIDANCE = ("embedded", "oracle")
GUIDED = ("feddifrc", "semanticfl", "align_features")
REFERENCES = ("fedavg", "fedrcl")
TIMESTEPS = ("paper", 0, 50, 150)
SCALES = (0.25, 1.0, 4.0)
# The weights and temperatures each stage scales, with the defaults it scales from (the methods' Params).
WEIGHTS = {"feddifrc": ("lambda_tdcl", "lambda_ndcr"), "semanticfl": ("lambda_kd", "lambda_con"),
           "align_features": ("lam",)}
TAUS = {"feddifrc": "tau", "semanticfl": "tau"}
STAGES = ("t", "weights", "edge", "tau")
EDGE_STEPS = 3  # the edge stage goes out at most 4**3 = 64 times further than the weights grid's edge


@dataclass(frozen=True)
class Variant:
    method: str
    guidance: Optional[str]  # None for the references, which read no guidance
    options: tuple[tuple[str, object], ...] = ()  # method options beside the name

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return self.method + (f"@{self.guidance}" if self.guidance else "") + (f"[{opts}]" if opts else "")

    def overrides(self) -> list[str]:
        out = [f"method.name={self.method}", *(f"method.{k}={v}" for k, v in self.options)]
        return out + ([f"guidance.model={self.guidance}"] if self.guidance else [])

    def slug(self) -> str:
        return "".join(c if c.isalnum() or c in "-_=." else "_" for c in self.label)

    def with_options(self, **options: object) -> "Variant":
        merged = {**dict(self.options), **options}
        return Variant(self.method, self.guidance, tuple(sorted(merged.items())))


def defaults(method: str) -> dict[str, object]:
    from fedguide.methods import METHODS
    return METHODS.get(method).params().model_dump(mode="json")


def stage_variants(stage: str, chosen: dict[tuple[str, str], Variant]) -> list[Variant]:
    """The variants of ``stage``, each grown from the (method, guidance) variant chosen before it."""
    out = []
    for guidance in GUIDANCE:
        for method in GUIDED:
            base = chosen.get((method, guidance), Variant(method, guidance))
            params = defaults(method)
            if stage == "t":
                steps = ("paper",) if guidance == "oracle" else TIMESTEPS
                out += [base.with_options(t=t) for t in steps] if "t" in params else [base]
            elif stage == "weights":
                names = WEIGHTS[method]
                grid = [dict(zip(names, combo)) for combo in _product([SCALES] * len(names))]
                # a scale of 1 leaves the option out, so the all-ones variant is the one chosen before (same run)
                out += [base.with_options(**{n: _scaled(params[n], s) for n, s in scales.items() if s != 1.0})
                        for scales in grid]
            elif stage == "edge":
                out += [base] + [base.with_options(**{n: _scaled(v, SCALES[-1] if v > params[n] else SCALES[0])})
                                 for n, v in dict(base.options).items() if n in WEIGHTS[method]
                                 and _at_edge(float(v), float(params[n]))]
            elif stage == "tau" and method in TAUS:
                out += [base] + [base.with_options(**{TAUS[method]: _scaled(params[TAUS[method]], s)}) for s in (0.5, 2.0)]
            else:
                out.append(base)
    return out


def _product(axes: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    combos: list[tuple[float, ...]] = [()]
    for axis in axes:
        combos = [c + (v,) for c in combos for v in axis]
    return combos


def _at_edge(value: float, default: float) -> bool:
    """Whether ``value`` is a scale of ``default`` at (or beyond) the weights grid's outermost scales."""
    return default != 0 and not SCALES[0] < value / default < SCALES[-1]


def _scaled(value: object, scale: float) -> float:
    return round(float(value) * scale, 6)


def run_all(variants: list[Variant], config: Path, seeds: list[int], root: Path, execute: bool
            ) -> dict[Variant, list[RunRecord]]:
    out: dict[Variant, list[RunRecord]] = {}
    for seed in seeds:
        for v in variants:
            folder = root / f"{v.slug()}-s{seed}"
            overrides = [f"seed={seed}", *VALIDATION, *FROM_DEFAULTS, *v.overrides()]
            ensure_run(config, folder, overrides, execute=False)  # restored from its record, if it has one
            if execute and not (folder / "summary.json").is_file():
                print(f"{v.label} seed {seed}: {'continuing' if (folder / 'config.yaml').is_file() else 'starting'} "
                      f"({datetime.now().strftime('%H:%M')})", flush=True)
                try:
                    ensure_run(config, folder, overrides)
                except subprocess.CalledProcessError as err:  # e.g. in use by another process: the others go on
                    print(f"{v.label} seed {seed}: FAILED (exit {err.returncode}); the next invocation tries it again",
                          flush=True)
            if (folder / "summary.json").is_file():
                out.setdefault(v, []).append(load_run(folder))
    return out


def last_k(rec: RunRecord, key: str, k: int) -> Optional[float]:
    values = rec.series(key)[1]
    return last_k_mean(values, k) if values else None


def choose(results: dict[Variant, list[RunRecord]], seeds: int) -> dict[tuple[str, str], Variant]:
    """The variant of each (method, guidance) with the best mean last-k validation accuracy over all seeds."""
    best: dict[tuple[str, str], tuple[float, Variant]] = {}
    for v, recs in results.items():
        if v.guidance is None or len(recs) < seeds:
            continue
        k = common_k(recs)
        score = statistics.fmean(last_k(r, "val_accuracy", k) for r in recs)
        if (v.method, v.guidance) not in best or score > best[(v.method, v.guidance)][0]:
            best[(v.method, v.guidance)] = (score, v)
    return {key: v for key, (_, v) in best.items()}


def paired_vs(mine: list[RunRecord], reference: list[RunRecord]) -> str:
    ref = {r.seed: r for r in reference}
    pairs = [(r, ref[r.seed]) for r in mine if r.seed in ref]
    if not pairs:
        return "—"
    k = common_k([r for p in pairs for r in p])
    diffs = [a.accuracy_last(k) - b.accuracy_last(k) for a, b in pairs]
    ci = bootstrap_interval(diffs)
    interval = f" [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]" if ci else ""
    return f"{100 * statistics.fmean(diffs):+.2f}{interval}"


def table(stage: str, results: dict[Variant, list[RunRecord]], chosen: dict[tuple[str, str], Variant],
          seeds: int) -> list[str]:
    refs = {v.method: recs for v, recs in results.items() if v.guidance is None}
    lines = [f"## Stage {stage}", "", "| variant | seeds | val last-k % | test last-k % | test vs FedAvg (paired) "
             "| test vs FedRCL (paired) | chosen |", "|---|---:|---:|---:|---:|---:|---|"]
    for v, recs in sorted(results.items(), key=lambda kv: (kv[0].guidance or "", kv[0].method, kv[0].label)):
        k = common_k(recs)
        val = [x for r in recs if (x := last_k(r, "val_accuracy", k)) is not None]
        test = [r.accuracy_last(k) for r in recs]
        pick = "yes" if chosen.get((v.method, v.guidance or "")) == v else ""
        lines.append(f"| {v.label} | {len(recs)} | {mean_std(val, seeds)} | {mean_std(test, seeds)} | "
                     f"{paired_vs(recs, refs.get('fedavg', [])) if v.method != 'fedavg' else '—'} | "
                     f"{paired_vs(recs, refs.get('fedrcl', [])) if v.method != 'fedrcl' else '—'} | {pick} |")
    return lines + [""]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "guidance_study")
    ap.add_argument("--report", action="store_true", help="the tables from the finished runs; run nothing")
    ap.add_argument("--transfer", metavar="STEM", help="run the variants chosen on STEM's config (no stages)")
    args = ap.parse_args(argv)
    root = args.out.resolve() / args.config.stem
    references = [Variant(m, None) for m in REFERENCES]
    chosen: dict[tuple[str, str], Variant] = {}
    how = (f"the variants are those chosen on {args.transfer}'s config, not chosen here" if args.transfer else
           "*val last-k* chooses each stage's variant (the best mean over seeds per method and guidance model)")
    doc = [f"# Guidance study on {args.config.name} (benchmarks/guidance_study.py)", "",
           f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; seeds "
           f"{', '.join(map(str, args.seeds))}; validation: {' '.join(VALIDATION)}. {how}; the test columns are "
           "read only. Cells: mean ± sample std over seeds.", ""]
    if args.transfer:
        chosen = read_chosen(args.transfer)
        results = run_all(references + list(chosen.values()), args.config, args.seeds, root, execute=not args.report)
        doc += table(f"transfer from {args.transfer}", results, chosen, len(args.seeds))
        write_text(RESULTS / f"{args.config.stem}.md", "\n".join(doc))
    for stage in [] if args.transfer else args.stages:
        for step in range(1, (EDGE_STEPS if stage == "edge" else 1) + 1):
            variants = references + stage_variants(stage, chosen)
            results = run_all(variants, args.config, args.seeds, root, execute=not args.report)
            before, chosen = chosen, {**chosen, **choose(results, len(args.seeds))}
            name = f"{stage} {step}" if stage == "edge" else stage
            doc += table(name, results, chosen, len(args.seeds))
            write_text(RESULTS / f"{args.config.stem}.md", "\n".join(doc))
            write_chosen(args.config.stem, chosen)
            print(f"stage {name}: chosen " + ", ".join(v.label for v in chosen.values()), flush=True)
            if chosen == before:  # no weight moved further out: the best is inside what was tried
                break
    print(f"tables: {RESULTS / (args.config.stem + '.md')}", flush=True)


def write_chosen(stem: str, chosen: dict[tuple[str, str], Variant]) -> None:
    write_text(RESULTS / f"{stem}.chosen.json", json.dumps(
        [{"method": v.method, "guidance": v.guidance, "options": dict(v.options)} for v in chosen.values()],
        indent=1) + "\n")


def read_chosen(stem: str) -> dict[tuple[str, str], Variant]:
    path = RESULTS / f"{stem}.chosen.json"
    if not path.is_file():
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        raise SystemExit(f"{shown} is missing: run the stages on {stem}'s config first (or "
                         f"--report them), which writes the variants they chose")
    return {(v["method"], v["guidance"]): Variant(v["method"], v["guidance"], tuple(sorted(v["options"].items())))
            for v in json.loads(path.read_text())}


if __name__ == "__main__":
    main()
