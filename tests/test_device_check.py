"""scripts/device-check.sh on a machine without a GPU: it says so and stops before doing anything."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts/device-check.sh"
NO_GPU = 3

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run")


def run(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_without_nvidia_smi_it_stops_at_once(tmp_path):
    done = run(tmp_path, "/usr/bin:/bin")  # no nvidia-smi there
    assert done.returncode == NO_GPU, done.stderr
    assert "no CUDA GPU on this machine (nvidia-smi is not on PATH)" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing installed, run or written


def test_a_gpu_torch_cannot_use_is_no_gpu_either(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA Imaginary 80GB'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    done = run(tmp_path, f"{fake}:/usr/bin:/bin")
    assert done.returncode == NO_GPU, done.stderr
    assert "lists 'NVIDIA Imaginary 80GB' but" in done.stderr and "cannot use CUDA" in done.stderr
    assert not (tmp_path / "out").exists()
