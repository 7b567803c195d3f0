"""fedguide's command line: thin wrappers that parse arguments and call the API."""
from __future__ import annotations

import argparse
import errno
import json
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import Optional

from fedguide.fl.runtime import RUNTIMES, WorkerCrashed
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


def _observer(console, quiet: bool):
    from fedguide.api import Observer

    # Lines are printed as they are (a config value in brackets is not rich markup); --quiet keeps the run's
    # own lines (what ran where, how it ended) and drops the rounds'.
    def say(line: str) -> None:
        console.print(line, markup=False)

    return Observer(say, lambda: _progress(console, quiet), rounds=(lambda s: None) if quiet else say)


def cmd_run(args) -> int:
    import fedguide.api as api

    if args.rebuild:
        args.overrides = list(args.overrides) + ["guidance.rebuild=true"]
    if args.reuse_synthetic:
        args.overrides = list(args.overrides) + [f"method.reuse_synthetic={args.reuse_synthetic}"]
    if args.dry_run:
        from fedguide.config import choices_comment

        print(choices_comment() + api.dry_run(args.config, args.overrides, args.sweep), end="")
        return 0
    console = _console()
    if not args.sweep:
        _interruptible(console, lambda: api.run(args.config, args.overrides, args.out,
                                                observer=_observer(console, args.quiet)))
        return 0
    with warnings.catch_warnings(record=True) as caught:  # a diverged run is an error line, the others go on
        warnings.simplefilter("always", RuntimeWarning)
        records = _interruptible(console, lambda: api.sweep(args.config, args.sweep, args.overrides, args.out,
                                                            observer=_observer(console, args.quiet)))
    diverged = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    for w in diverged:
        print(f"error: {w.message}", file=sys.stderr)
    if len(records) > 1:
        _print_report([r.path for r in records], None, console)
    if diverged:
        labels = "; ".join(str(w.message).split(":", 1)[0] for w in diverged)
        print(f"error: {len(diverged)} of {len(records)} runs diverged: {labels}", file=sys.stderr)
        return 2
    return 0


def _interruptible(console, call):
    """``call()``; an interruption prints how to go on and exits 130."""
    from fedguide.api import Interrupted

    try:
        return call()
    except Interrupted as stop:
        console.print(f"interrupted; {stop.hint}", markup=False)
        raise SystemExit(130)


def cmd_resume(args) -> int:
    import fedguide.api as api

    console = _console()
    _interruptible(console, lambda: api.resume(args.run_dir, device=args.device, rebuild=args.rebuild,
                                               observer=_observer(console, args.quiet)))
    return 0


def cmd_serve(args) -> int:
    from fedguide.api import default_run_dir, final_line
    from fedguide.config import load_config
    from fedguide.fl.run_folder import RunFolder
    from fedguide.fl.runtimes.flower.server import serve
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
        cfg = resolve(load_config(args.target, args.overrides)).config  # config errors before any process starts
        run_dir = args.out or default_run_dir(args.target.stem, cfg.method.name, cfg.seed)
        RunFolder(run_dir).check_fresh()
    log = (lambda s: None) if args.quiet else (lambda s: console.print(s, markup=False))  # Flower's text, verbatim
    try:
        summary = serve(run_dir, cfg, resume=args.resume, host=args.host, log=log, insecure=args.insecure)
    except KeyboardInterrupt:
        console.print(f"interrupted; continue with: fedguide serve --resume {run_dir}")
        raise SystemExit(130)
    except WorkerCrashed as err:
        hint = f"\ncontinue with: fedguide serve --resume {run_dir}" if (run_dir / "config.yaml").exists() else ""
        raise WorkerCrashed(f"{err}{hint}") from None
    console.print(final_line(summary, run_dir), markup=False)
    return 0


def cmd_client(args) -> int:
    from fedguide.config import load_config
    from fedguide.fl.runtimes.flower.node import run_client_node
    from fedguide.fl.setup import resolve

    console = _console()
    cfg = resolve(load_config(args.config, args.overrides)).config
    folder = args.out or Path("runs") / f"flower-client-{args.partition_id}"
    try:
        run_client_node(cfg, args.partition_id, folder, superlink=args.superlink, insecure=args.insecure,
                        log=(lambda s: None) if args.quiet else (lambda s: console.print(s, markup=False)))
    except KeyboardInterrupt:
        console.print(f"client {args.partition_id} stopped")
        return 0
    return 0


def registry_listing() -> dict[str, list[dict]]:
    from fedguide.config import choices
    from fedguide.data.partition import PARTITIONS
    from fedguide.data.sources import DATASETS
    from fedguide.fl.loggers import LOGGERS
    from fedguide.methods import METHODS
    from fedguide.methods.compose import REGULARIZERS
    from fedguide.methods.server_optimizers import SERVER_OPTIMIZERS
    from fedguide.models import MODELS

    def rows(reg):
        return [{"name": e.name, "summary": e.summary,
                 "params": {k: f.get_default(call_default_factory=True) for k, f in e.params.model_fields.items()},
                 **({"paper": e.obj.paper} if getattr(e.obj, "paper", "") else {})} for e in reg.entries()]

    # The closed sets a config names besides the registries' entries (train.device, train.augment).
    fixed = {kind: [{"name": n, "summary": summary, "params": {}} for n, summary in named.items()]
             for kind, named in choices().items()}
    return {"methods": rows(METHODS), "regularizers": rows(REGULARIZERS),
            "server_optimizers": rows(SERVER_OPTIMIZERS), "datasets": rows(DATASETS),
            "partitions": rows(PARTITIONS), "models": rows(MODELS), "runtimes": rows(RUNTIMES), **fixed,
            "loggers": rows(LOGGERS)}


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
            console.print(f"  {r['name']:<14} {escape(r['summary'])}" + (f"  [dim]({params})[/]" if params else "")
                          + (f"  {r['paper']}" if r.get("paper") else ""))
    return 0


def _print_report(paths: list[Path], out: Optional[Path], console, options=None) -> None:
    from fedguide.report import report

    result = report(paths, out, options)
    for w in (w for r in result.runs for w in r.warnings):
        print(f"warning: {w}", file=sys.stderr)
    print(result.table)
    if result.paired:
        print(result.paired)
    if result.paired_path:
        console.print(f"paired: {result.paired_path}")
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
                            last_k=args.last_k, rounds_to=args.rounds_to, keep_previous=args.keep_previous)
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
    res.add_argument("--rebuild", action="store_true",
                     help="recompute cached guidance features and fitted bases instead of reusing them (what a "
                          "damaged cache's error asks for; not part of the run's pinned settings)")
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
    from fedguide.report.measures import ALL_METRICS

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
    rep.add_argument("--metric", choices=ALL_METRICS, default="last_k",
                     help="what a pivot cell holds (default last_k: the mean over the last k rounds); a personal one "
                          "(eval.mode personal/both: the clients' mean, minimum, or worst-10 %% personal accuracy, "
                          "mean over the last k scored rounds) is also what --vs compares; best_val: the test accuracy "
                          "in the round of the best validation accuracy (data.val_fraction)")
    rep.add_argument("--format", choices=("md", "csv", "latex"), default="md",
                     help="format of the printed table (the pivot, else the results table), also written to --out")
    rep.add_argument("--last-k", dest="last_k", type=int, default=None, metavar="K",
                     help="average every run over its last K rounds instead of its own report.last_k")
    rep.add_argument("--rounds-to", dest="rounds_to", type=_marks, default=None, metavar="A,B,...",
                     help="accuracy marks of the rounds-to-accuracy table (default: those the runs recorded)")
    rep.add_argument("--keep-previous", dest="keep_previous", action="store_true",
                     help="keep a report written before into the same folder, as report-<its time>/ beside it "
                          "(default: the new report replaces it)")
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
    from fedguide.analysis.figure import in_order, option

    ana = sub.add_parser("analyze", help="the papers' analysis figures of a finished run (PNG + JSON in RUN/analysis/)")
    ana.add_argument("run_dir", type=Path, metavar="RUN")
    for figure in in_order():
        ana.add_argument(option(figure.name), dest=figure.name, action="store_true", help=figure.summary)
    ana.add_argument("--points", type=int, default=2000, help="t-SNE: at most this many test images (default 2000)")
    ana.add_argument("--seed", type=int, default=0, help="seed of the subsets, t-SNE and K-means (default 0)")
    ana.set_defaults(func=cmd_analyze)


def cmd_analyze(args) -> int:
    """No figure named: every figure that applies to the run; a named one that does not apply is an error."""
    from fedguide.analysis import analyze
    from fedguide.analysis.figure import in_order

    console = _console()
    chosen = [f.name for f in in_order() if getattr(args, f.name)]
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
    from fedguide.extras import EMBEDDED_BACKBONES, require_extras, require_modules

    require_extras(("guidance",), "fedguide pretrain-guidance")
    require_modules(EMBEDDED_BACKBONES, "guidance", "fedguide pretrain-guidance")
    from fedguide.guidance.embedded.pretrain.run import run_from_cli

    try:
        return run_from_cli(args)
    except KeyboardInterrupt:
        # The stages it finished (and its last UNet checkpoint) stay in the partial folder: the same command
        # continues from them.
        partial = args.out.resolve().parent / f".{args.out.resolve().name}.partial"
        kept = f"finished stages are kept in {partial}; " if partial.is_dir() else ""
        print(f"interrupted; {kept}continue with: fedguide {shlex.join(args.argv)}", file=sys.stderr)
        raise SystemExit(130)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed, for a continue hint
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
        fix = ("free some space there and run the command again" if err.errno in (errno.ENOSPC, errno.EDQUOT)
               else "check that the path exists and that you may write there")
        print(f"error: {err.strerror or err}{where}; {fix}", file=sys.stderr)
        return 2


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
