"""fedguide's command line: thin wrappers that parse arguments and call the API."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from fedguide.fl.runtimes.base import RUNTIMES, WorkerCrashed
from fedguide.registry import ConfigError


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _progress(console, quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if quiet:
        return None
    if not (console.is_terminal or console.is_jupyter):
        # A bar on a log file prints nothing until it ends. Every round already logs its own line, so the
        # plain lines add what those lack (rate, time left) every ~10 % / 30 s, and no closing line (the
        # run's final line follows).
        from fedguide.guidance.progress import PlainLines

        return PlainLines(unit="round", final=False)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=True)


def _default_run_dir(config_path: Path, method: str, seed: int) -> Path:
    return Path("runs") / f"{config_path.stem}-{method}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_fresh(run_dir: Path) -> None:
    from fedguide.fl.engine import check_fresh  # checked again under the run folder's lock

    check_fresh(run_dir)


def _run_one(config_path: Path, overrides: list[str], run_dir: Optional[Path], dry_run: bool, quiet: bool, console):
    from fedguide.config import load_config, to_yaml
    from fedguide.fl.loggers import check_available
    from fedguide.fl.setup import open_run, prepare

    prepared = prepare(load_config(config_path, overrides))
    cfg = prepared.config
    check_available(cfg.logging)  # a missing logger package is named by --dry-run too, before any folder exists
    refusal = RUNTIMES.get(cfg.runtime.name).obj.refuses(run_dir, resume=False)
    if refusal and not dry_run:
        raise ConfigError(refusal)
    if dry_run:
        with tempfile.TemporaryDirectory() as scratch:
            open_run(prepared, Path(scratch))  # what building the method and its regularisers refuses
        print(to_yaml(cfg), end="")
        print("partition summary: " + json.dumps(prepared.data.summary()))
        return None
    run_dir = run_dir or _default_run_dir(config_path, cfg.method.name, cfg.seed)
    _check_fresh(run_dir)
    _check_writable(run_dir)
    console.print(f"[bold]{cfg.method.name}[/] on {cfg.data.name}, {cfg.partition.name}, "
                  f"{prepared.data.num_clients} clients, seed {cfg.seed} -> {run_dir}")
    summary = _execute(prepared, run_dir, False, quiet, console)
    console.print(f"final accuracy {100 * summary['final_accuracy']:.2f}%  "
                  f"(best {100 * summary['best_accuracy']:.2f}% at round {summary['best_round']})  "
                  f"{summary['wall_seconds']:.0f} s  -> {run_dir}")
    return run_dir


def _execute(prepared, run_dir: Path, resume: bool, quiet: bool, console, again: Optional[str] = None) -> dict:
    """Run or resume with progress; an interruption or a crashed worker says how to continue (``again``:
    instead of resuming this run folder)."""
    from fedguide.fl.engine import Experiment

    progress = _progress(console, quiet)
    exp = Experiment(prepared, run_dir, log=(lambda s: None) if quiet else console.print, progress=progress)
    try:
        if progress:
            with progress:
                return exp.run(resume=resume)
        return exp.run(resume=resume)
    except KeyboardInterrupt:
        console.print(f"interrupted; {again or f'continue with: fedguide resume {run_dir}'}")
        raise SystemExit(130)
    except WorkerCrashed as err:
        raise WorkerCrashed(f"{err}\n{again or f'continue with: fedguide resume {run_dir}'}") from None


def _check_writable(run_dir: Path) -> None:
    from fedguide.api import check_writable

    check_writable(run_dir)


def cmd_run(args) -> int:
    console = _console()
    if args.rebuild:
        args.overrides = list(args.overrides) + ["guidance.rebuild=true"]
    if args.reuse_synthetic:
        args.overrides = list(args.overrides) + [f"method.reuse_synthetic={args.reuse_synthetic}"]
    if args.sweep:
        return _run_sweep(args, console)
    _run_one(args.config, args.overrides, args.out, args.dry_run, args.quiet, console)
    return 0


def _run_sweep(args, console) -> int:
    """Every combination checked first (none runs if one is invalid); then each run started, continued
    (unfinished) or skipped (finished, or diverged before), and the comparison table."""
    from fedguide.config import load_raw
    from fedguide.fl.setup import prepare
    from fedguide.sweeps import dry_run_text, grid, parse_axis, plan

    combos = grid([parse_axis(s) for s in args.sweep])
    parent = args.out or Path("runs") / f"{args.config.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = plan(load_raw(args.config), args.overrides, combos, parent)
    if args.dry_run:
        print(dry_run_text(runs), end="")
        return 0
    again = f"run the same command with --out {parent}" if args.out is None else "run the same command again"
    diverged = []
    for i, r in enumerate(runs, 1):
        head = f"[{i}/{len(runs)}] {r.combination.label}"
        if r.state in ("finished", "stopped"):
            console.print(f"{head}: {'finished' if r.state == 'finished' else 'diverged'} before, skipped -> {r.run_dir}")
            continue
        _check_writable(r.run_dir)
        console.print(f"{head}: {'continuing' if r.state == 'unfinished' else 'starting'} -> {r.run_dir}")
        try:
            summary = _execute(prepare(r.config), r.run_dir, r.state == "unfinished", args.quiet, console,
                               again=f"continue the sweep: {again}")
        except FloatingPointError as err:  # recorded in the run folder (stopped.json); the other runs go on
            print(f"error: {err}", file=sys.stderr)
            diverged.append(r.combination.label)
            continue
        console.print(f"{head}: final accuracy {100 * summary['final_accuracy']:.2f}%  "
                      f"(best {100 * summary['best_accuracy']:.2f}% at round {summary['best_round']})  "
                      f"{summary['wall_seconds']:.0f} s")
    if len(runs) > 1:
        _print_report([r.run_dir for r in runs], None, console)
    if diverged:
        print(f"error: {len(diverged)} of {len(runs)} runs diverged: {'; '.join(diverged)}", file=sys.stderr)
        return 2
    return 0


def cmd_resume(args) -> int:
    from fedguide.fl.setup import load_run_config, prepare

    console = _console()
    run_dir = args.run_dir
    cfg = load_run_config(run_dir)
    if args.device is not None:  # where it computes is not pinned: a GPU run may continue on a CPU
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": args.device})})
    done = run_dir / "summary.json"
    if done.exists() and json.loads(done.read_text()).get("rounds", 0) >= cfg.train.rounds:
        console.print(f"{run_dir} is already complete (summary.json exists); nothing to resume")
        return 0
    refusal = RUNTIMES.get(cfg.runtime.name).obj.refuses(run_dir, resume=True)
    if refusal:
        raise ConfigError(refusal)
    summary = _execute(prepare(cfg), run_dir, True, args.quiet, console)
    console.print(f"final accuracy {100 * summary['final_accuracy']:.2f}%  -> {run_dir}")
    return 0


def cmd_serve(args) -> int:
    from fedguide.config import load_config
    from fedguide.fl.flower.deploy import serve
    from fedguide.fl.setup import resolve

    console = _console()
    if args.resume:
        if args.overrides or args.out:
            raise ConfigError("--resume takes the run directory alone (its config.yaml is the run's config)")
        run_dir = args.target
        if (run_dir / "summary.json").exists():
            console.print(f"{run_dir} is already complete (summary.json exists); nothing to resume")
            return 0
        cfg = None
    else:
        cfg, _ = resolve(load_config(args.target, args.overrides))  # config errors before any process starts
        run_dir = args.out or _default_run_dir(args.target, cfg.method.name, cfg.seed)
        _check_fresh(run_dir)
    log = (lambda s: None) if args.quiet else (lambda s: console.print(s, markup=False))  # Flower's text, verbatim
    try:
        summary = serve(run_dir, cfg, resume=args.resume, host=args.host, log=log, insecure=args.insecure)
    except KeyboardInterrupt:
        console.print(f"interrupted; continue with: fedguide serve --resume {run_dir}")
        raise SystemExit(130)
    except WorkerCrashed as err:
        hint = f"\ncontinue with: fedguide serve --resume {run_dir}" if (run_dir / "config.yaml").exists() else ""
        raise WorkerCrashed(f"{err}{hint}") from None
    console.print(f"final accuracy {100 * summary['final_accuracy']:.2f}%  "
                  f"(best {100 * summary['best_accuracy']:.2f}% at round {summary['best_round']})  "
                  f"{summary['wall_seconds']:.0f} s  -> {run_dir}")
    return 0


def cmd_client(args) -> int:
    from fedguide.config import load_config
    from fedguide.fl.flower.node import run_client_node
    from fedguide.fl.setup import resolve

    console = _console()
    cfg, _ = resolve(load_config(args.config, args.overrides))
    folder = args.out or Path("runs") / f"flower-client-{args.partition_id}"
    try:
        run_client_node(cfg, args.partition_id, folder, superlink=args.superlink, insecure=args.insecure,
                        log=(lambda s: None) if args.quiet else (lambda s: console.print(s, markup=False)))
    except KeyboardInterrupt:
        console.print(f"client {args.partition_id} stopped")
        return 0
    return 0


def registry_listing() -> dict[str, list[dict]]:
    from fedguide.data.partition import PARTITIONS
    from fedguide.data.sources import DATASETS
    from fedguide.methods import METHODS
    from fedguide.methods.compose import REGULARIZERS
    from fedguide.models import MODELS

    def rows(reg):
        return [{"name": e.name, "summary": e.summary,
                 "params": {k: f.get_default(call_default_factory=True) for k, f in e.params.model_fields.items()}} for e in reg.entries()]

    return {"methods": rows(METHODS), "regularizers": rows(REGULARIZERS), "datasets": rows(DATASETS),
            "partitions": rows(PARTITIONS), "models": rows(MODELS), "runtimes": rows(RUNTIMES)}


def cmd_list(args) -> int:
    listing = registry_listing()
    if args.json:
        print(json.dumps(listing, indent=2, default=str))
        return 0
    from rich.markup import escape

    console = _console()
    for kind, rows in listing.items():
        console.print(f"[bold]{kind}[/]")
        for r in rows:
            params = escape(", ".join(f"{k}={v}" for k, v in r["params"].items()))
            console.print(f"  {r['name']:<14} {escape(r['summary'])}" + (f"  [dim]({params})[/]" if params else ""))
    return 0


def _print_report(paths: list[Path], out: Optional[Path], console, options=None) -> None:
    from fedguide.report import report

    result = report(paths, out, options)
    for w in (w for r in result.runs for w in r.warnings):
        print(f"warning: {w}", file=sys.stderr)
    print(result.table)
    if result.paired:
        print(result.paired)
    console.print(f"report: {result.markdown_path}")
    if result.table_path:
        console.print(f"table:  {result.table_path}")
    for p in result.plot_paths:
        console.print(f"plot:   {p}")


def _marks(text: str) -> list[float]:
    try:
        return [float(m) for m in text.split(",") if m.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of accuracies, e.g. 0.2,0.3,0.4")


def cmd_report(args) -> int:
    from fedguide.report import ReportOptions

    options = ReportOptions(vs=args.vs, rows=args.rows, cols=args.cols, metric=args.metric, fmt=args.format,
                            last_k=args.last_k, rounds_to=args.rounds_to)
    _print_report(args.run_dirs, args.out, _console(), options)
    return 0


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run an experiment from a YAML config")
    run.add_argument("config", type=Path)
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. method.name=fedprox method.mu=0.01")
    run.add_argument("--out", type=Path, default=None,
                     help="run directory; with --sweep the parent folder of its runs, and the same command with the "
                          "same --out continues the sweep (without --out a new time-stamped folder each time)")
    run.add_argument("--dry-run", action="store_true", help="validate, print the resolved config and partition")
    run.add_argument("--sweep", action="append", metavar="KEY=VALUES",
                     help="run every combination (repeatable), then print a comparison table; VALUES: v1,v2 or a "
                          "YAML list ('model.mapping=[[64, 64], []]'). Every combination is checked before the "
                          "first run; finished runs are skipped and unfinished ones continued")
    run.add_argument("--quiet", action="store_true")
    run.add_argument("--rebuild", action="store_true",
                     help="recompute cached guidance features instead of reusing them (guidance.rebuild=true)")
    run.add_argument("--reuse-synthetic", metavar="RUN_DIR", default=None,
                     help="one-shot generating methods (fedcado, sd_gen): train on RUN_DIR's synthetic set instead "
                          "of generating (method.reuse_synthetic=RUN_DIR)")
    run.set_defaults(func=cmd_run)

    res = sub.add_parser("resume", help="continue an interrupted run from its last checkpoint")
    res.add_argument("run_dir", type=Path)
    res.add_argument("--device", default=None, metavar="D",
                     help="continue on device D (auto, cpu, cuda, cuda:N) instead of the run's train.device")
    res.add_argument("--quiet", action="store_true")
    res.set_defaults(func=cmd_resume)


def _add_flower(sub) -> None:
    srv = sub.add_parser("serve", help="run an experiment on a Flower deployment: SuperLink + ServerApp "
                                        "(runtime.name=flower; clients join with 'fedguide client')")
    srv.add_argument("target", type=Path, help="the YAML config; with --resume, the run directory")
    srv.add_argument("overrides", nargs="*", help="dotted overrides, e.g. runtime.min_clients=2")
    srv.add_argument("--out", type=Path, default=None, help="run directory")
    srv.add_argument("--resume", action="store_true", help="continue the run directory TARGET from its last checkpoint")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address the SuperLink listens on (default 127.0.0.1; 0.0.0.0 for other machines, which "
                          "needs runtime.tls or --insecure)")
    srv.add_argument("--insecure", action="store_true",
                     help="allow a --host beyond this machine without runtime.tls: plain HTTP, any machine that "
                          "reaches the port can join as a client (a trusted network only)")
    srv.add_argument("--quiet", action="store_true")
    srv.set_defaults(func=cmd_serve)

    cli = sub.add_parser("client", help="serve one client of Flower deployments: SuperNode + ClientApp, "
                                        "until stopped (Ctrl-C)")
    cli.add_argument("config", type=Path, help="the server's YAML config (with the same overrides)")
    cli.add_argument("overrides", nargs="*")
    cli.add_argument("--partition-id", type=int, required=True, help="this client's id, 0..clients.num-1")
    cli.add_argument("--superlink", default=None, help="host:port of the SuperLink (default: runtime.superlink)")
    cli.add_argument("--insecure", action="store_true",
                     help="allow plain HTTP to a SuperLink on another machine (without runtime.tls; a trusted "
                          "network only)")
    cli.add_argument("--out", type=Path, default=None,
                     help="this client's folder: logs, Flower home, client state (default runs/flower-client-I)")
    cli.add_argument("--quiet", action="store_true")
    cli.set_defaults(func=cmd_client)


def _add_results(sub) -> None:
    lst = sub.add_parser("list", help="registered methods, datasets, partitions, models and runtimes")
    lst.add_argument("--json", action="store_true")
    lst.set_defaults(func=cmd_list)

    rep = sub.add_parser("report", help="results table and plots for run folders (and the run folders below any "
                                        "other folder given, e.g. a sweep's)")
    rep.add_argument("run_dirs", nargs="+", type=Path, metavar="DIR",
                     help="a run folder, or a folder searched for run folders (a sweep's --out)")
    rep.add_argument("--out", type=Path, default=None)
    rep.add_argument("--vs", metavar="METHOD", default=None,
                     help="per-seed paired differences of every other method against METHOD, with a bootstrap 95%% "
                          "interval")
    rep.add_argument("--rows", metavar="KEY", default=None,
                     help="pivot table: KEY down the rows (method, partition, dataset or a dotted config key)")
    rep.add_argument("--cols", metavar="KEY", default=None, help="pivot table: KEY across the columns")
    rep.add_argument("--metric", choices=("last_k", "final", "best"), default="last_k",
                     help="what a pivot cell holds (default last_k: the mean over the last k rounds)")
    rep.add_argument("--format", choices=("md", "csv", "latex"), default="md",
                     help="format of the printed table (the pivot, else the results table), also written to --out")
    rep.add_argument("--last-k", dest="last_k", type=int, default=None, metavar="K",
                     help="average every run over its last K rounds instead of its own report.last_k")
    rep.add_argument("--rounds-to", dest="rounds_to", type=_marks, default=None, metavar="A,B,...",
                     help="accuracy marks of the rounds-to-accuracy table (default: those the runs recorded)")
    rep.set_defaults(func=cmd_report)


def _add_pretrain(sub) -> None:
    from fedguide.guidance.embedded.pretrain.settings import REPA_HEADS, REPA_TARGETS

    pre = sub.add_parser("pretrain-guidance", help="train the embedded guidance models (mini SD + mini CLIP) "
                                                   "from scratch on the embedded datasets' public pools")
    pre.add_argument("--out", type=Path, required=True, help="folder to write (SD layout + MODEL_CARD.md)")
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--unet-steps", dest="unet_steps", type=int, default=None)
    pre.add_argument("--vae-steps", dest="vae_steps", type=int, default=None)
    pre.add_argument("--clip-epochs", dest="clip_epochs", type=int, default=None)
    pre.add_argument("--clip-image-size", dest="clip_image_size", type=int, default=None,
                     help="input side of the mini-CLIP's frozen backbone in px (default 128)")
    pre.add_argument("--reuse-vae", dest="reuse_vae", type=Path, default=None,
                     help="take the VAE of a folder this command wrote before (same VAE settings and data) "
                          "instead of training one")
    pre.add_argument("--reuse-clip", dest="reuse_clip", type=Path, default=None,
                     help="take the mini-CLIP projection of a folder this command wrote before (same CLIP settings "
                          "and data) instead of training one")
    pre.add_argument("--repa-weight", dest="repa_weight", type=float, default=None,
                     help="weight of the UNet's representation-alignment (REPA) loss; 0 (default) trains without it")
    pre.add_argument("--repa-layers", dest="repa_layers", default=None,
                     type=lambda v: tuple(name.strip() for name in v.split(",") if name.strip()),
                     help="comma-separated UNet blocks aligned: mid, down.i, up.i (default mid,up.1)")
    pre.add_argument("--repa-target", dest="repa_target", choices=REPA_TARGETS, default=None,
                     help="alignment target: the frozen EfficientNet-Lite0 feature map of the clean image (effnet, "
                          "default) or its mini-CLIP embedding (clip)")
    pre.add_argument("--repa-head", dest="repa_head", choices=REPA_HEADS, default=None,
                     help="projection head of the alignment: REPA's per-position MLP (mlp, default) or one 1x1 "
                          "convolution (linear), which asks the features to hold the target linearly")
    pre.add_argument("--unet-channels", dest="unet_channels", default=None,
                     type=lambda v: tuple(int(c) for c in v.split(",") if c.strip()),
                     help="comma-separated channels of the UNet's levels (default 64,128,128,128; a larger UNet "
                          "costs more per step and a larger file)")
    pre.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    pre.add_argument("--quiet", action="store_true")
    pre.set_defaults(func=_pretrain_guidance)


def _add_analyze(sub) -> None:
    from fedguide.analysis.dispatch import FIGURES

    ana = sub.add_parser("analyze", help="the papers' analysis figures of a finished run (PNG + JSON in RUN/analysis/)")
    ana.add_argument("run_dir", type=Path, metavar="RUN")
    for figure in FIGURES:
        ana.add_argument(figure.option, dest=figure.name, action="store_true", help=figure.help)
    ana.add_argument("--points", type=int, default=2000, help="t-SNE: at most this many test images (default 2000)")
    ana.add_argument("--seed", type=int, default=0, help="seed of the subsets, t-SNE and K-means (default 0)")
    ana.set_defaults(func=cmd_analyze)


def cmd_analyze(args) -> int:
    """No figure named: every figure that applies to the run; a named one that does not apply is an error."""
    from fedguide.analysis import FIGURES, analyze

    console = _console()
    chosen = [f.name for f in FIGURES if getattr(args, f.name)]
    result = analyze(args.run_dir, chosen or None, points=args.points, seed=args.seed,
                     log=lambda line: console.print(line, markup=False))
    for name, paths in result.written.items():
        console.print(f"{name}: " + ", ".join(str(p) for p in paths), markup=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fedguide import __version__

    parser = argparse.ArgumentParser(prog="fedguide", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fedguide {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_flower, _add_results, _add_analyze, _add_pretrain):
        add(sub)
    return parser


def _pretrain_guidance(args) -> int:
    from fedguide.extras import require_extras

    require_extras(("guidance",), "fedguide pretrain-guidance")
    from fedguide.guidance.embedded.pretrain.run import run_from_cli

    return run_from_cli(args)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options ('run CFG --dry-run method.name=fedprox'); argparse leaves those
    # as unknown arguments, so they are taken here.
    if extra:
        if args.command not in ("run", "serve", "client") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    # A batch system's SIGTERM ends a run as Ctrl-C does: the message, the resume hint, every process closed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FloatingPointError, WorkerCrashed) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path that cannot be read or written: the path and the reason, no traceback
        where = f" ({err.filename})" if err.filename else ""
        print(f"error: {err.strerror or err}{where}; check that the path exists and that you may write there",
              file=sys.stderr)
        return 2


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
