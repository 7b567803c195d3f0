"""fedguide's command line: thin wrappers that parse arguments and call the API."""
from __future__ import annotations

import argparse
import itertools
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
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=True)


def _default_run_dir(config_path: Path, method: str, seed: int) -> Path:
    return Path("runs") / f"{config_path.stem}-{method}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_fresh(run_dir: Path) -> None:
    from fedguide.fl.engine import check_fresh  # checked again under the run folder's lock

    check_fresh(run_dir)


def _sweep_grid(sweeps: list[str]) -> list[list[str]]:
    axes = []
    for s in sweeps:
        if "=" not in s:
            raise ConfigError(f"--sweep '{s}' is not key=v1,v2; write e.g. --sweep seed=0,1,2")
        key, values = s.split("=", 1)
        axes.append([f"{key}={v}" for v in values.split(",")])
    return [list(c) for c in itertools.product(*axes)] if axes else [[]]


def _run_one(config_path: Path, overrides: list[str], run_dir: Optional[Path], dry_run: bool, quiet: bool, console):
    from fedguide.config import load_config, to_yaml
    from fedguide.fl.setup import open_run, prepare

    prepared = prepare(load_config(config_path, overrides))
    cfg = prepared.config
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


def _execute(prepared, run_dir: Path, resume: bool, quiet: bool, console) -> dict:
    """Run or resume with progress; an interruption or a crashed worker says how to continue."""
    from fedguide.fl.engine import Experiment

    progress = _progress(console, quiet)
    exp = Experiment(prepared, run_dir, log=(lambda s: None) if quiet else console.print, progress=progress)
    try:
        if progress:
            with progress:
                return exp.run(resume=resume)
        return exp.run(resume=resume)
    except KeyboardInterrupt:
        console.print(f"interrupted; continue with: fedguide resume {run_dir}")
        raise SystemExit(130)
    except WorkerCrashed as err:
        raise WorkerCrashed(f"{err}\ncontinue with: fedguide resume {run_dir}") from None


def _check_writable(run_dir: Path) -> None:
    """The run folder exists (made here) and takes files, or a sentence says why not."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write the run folder {run_dir}: {err.strerror or err} "
                          f"({err.filename or run_dir}); choose another --out, a folder you can write to") from None


def cmd_run(args) -> int:
    console = _console()
    grid = _sweep_grid(args.sweep or [])
    if args.rebuild:
        args.overrides = list(args.overrides) + ["guidance.rebuild=true"]
    if args.reuse_synthetic:
        args.overrides = list(args.overrides) + [f"method.reuse_synthetic={args.reuse_synthetic}"]
    run_dirs = []
    for combo in grid:
        run_dir = args.out
        if len(grid) > 1:
            name = "-".join(o.split("=", 1)[0].split(".")[-1] + "=" + o.split("=", 1)[1] for o in combo)
            run_dir = (args.out or Path("runs") / f"{args.config.stem}-{time.strftime('%Y%m%d-%H%M%S')}") / name
        rd = _run_one(args.config, args.overrides + combo, run_dir, args.dry_run, args.quiet, console)
        if rd is not None:
            run_dirs.append(rd)
    if len(run_dirs) > 1:
        _print_report(run_dirs, None, console)
    return 0


def cmd_resume(args) -> int:
    from fedguide.fl.setup import load_run_config, prepare

    console = _console()
    run_dir = args.run_dir
    cfg = load_run_config(run_dir)
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


def _print_report(paths: list[Path], out: Optional[Path], console) -> None:
    from fedguide.report import report

    from fedguide.report import results_table

    result = report(paths, out)
    for w in (w for r in result.runs for w in r.warnings):
        print(f"warning: {w}", file=sys.stderr)
    print(results_table(result.runs))
    console.print(f"report: {result.markdown_path}")
    for p in result.plot_paths:
        console.print(f"plot:   {p}")


def cmd_report(args) -> int:
    _print_report(args.run_dirs, args.out, _console())
    return 0


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run an experiment from a YAML config")
    run.add_argument("config", type=Path)
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. method.name=fedprox method.mu=0.01")
    run.add_argument("--out", type=Path, default=None, help="run directory (parent folder with --sweep)")
    run.add_argument("--dry-run", action="store_true", help="validate, print the resolved config and partition")
    run.add_argument("--sweep", action="append", metavar="KEY=V1,V2",
                     help="run every combination (repeatable), then print a comparison table")
    run.add_argument("--quiet", action="store_true")
    run.add_argument("--rebuild", action="store_true",
                     help="recompute cached guidance features instead of reusing them (guidance.rebuild=true)")
    run.add_argument("--reuse-synthetic", metavar="RUN_DIR", default=None,
                     help="one-shot generating methods (fedcado, sd_gen): train on RUN_DIR's synthetic set instead "
                          "of generating (method.reuse_synthetic=RUN_DIR)")
    run.set_defaults(func=cmd_run)

    res = sub.add_parser("resume", help="continue an interrupted run from its last checkpoint")
    res.add_argument("run_dir", type=Path)
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

    rep = sub.add_parser("report", help="results table and plots for one or more run directories")
    rep.add_argument("run_dirs", nargs="+", type=Path)
    rep.add_argument("--out", type=Path, default=None)
    rep.set_defaults(func=cmd_report)


def _add_pretrain(sub) -> None:
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
    pre.add_argument("--repa-weight", dest="repa_weight", type=float, default=None,
                     help="weight of the UNet's representation-alignment (REPA) loss; 0 (default) trains without it")
    pre.add_argument("--repa-layers", dest="repa_layers", default=None,
                     type=lambda v: tuple(name.strip() for name in v.split(",") if name.strip()),
                     help="comma-separated UNet blocks aligned: mid, down.i, up.i (default mid,up.1)")
    pre.add_argument("--repa-target", dest="repa_target", choices=("effnet", "clip"), default=None,
                     help="alignment target: the frozen EfficientNet-Lite0 feature map of the clean image (effnet, "
                          "default) or its mini-CLIP embedding (clip)")
    pre.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    pre.add_argument("--quiet", action="store_true")
    pre.set_defaults(func=_pretrain_guidance)


def build_parser() -> argparse.ArgumentParser:
    from fedguide import __version__

    parser = argparse.ArgumentParser(prog="fedguide", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fedguide {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_flower, _add_results, _add_pretrain):
        add(sub)
    return parser


def _pretrain_guidance(args) -> int:
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
