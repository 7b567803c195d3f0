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
