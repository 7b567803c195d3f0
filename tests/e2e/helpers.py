"""Shared by the end-to-end tests: tiny configs and a way to run the CLI in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file
from tests.tiny import tiny_raw

REPO = Path(__file__).resolve().parents[2]


def tiny_config(path: Path, **sections) -> Path:
    """The tests' tiny digits run, as a YAML file for the CLI (rounds slow enough to be killed)."""
    raw = tiny_raw({"train": {"rounds": 6, "epochs": 3, "batch_size": 16}, "seed": 3}, **sections)
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "FEDGUIDE_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "fedguide.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"fedguide {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def cli_here(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``cli`` in this process: the command line's own code (``fedguide.cli.main``) with its output captured, without
    the 3-4 s of another interpreter importing torch. For what the process boundary does not change (parsing,
    validation, dry runs, errors, sweeps); `fedguide` as a process of its own stays ``cli``."""
    import contextlib
    import io

    from fedguide.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    proc = subprocess.CompletedProcess(["fedguide", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"fedguide {' '.join(args)} failed ({code}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def popen(*args: str) -> subprocess.Popen:
    env = {**os.environ, "FEDGUIDE_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "fedguide.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "model.safetensors")
