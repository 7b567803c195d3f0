"""scripts/device-check.sh on a machine without a GPU: it says so and stops before doing anything, and its
dry run (train.device: simulated, the smallest sizes) starts every step and writes its line."""
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


def run(tmp_path: Path, path: str, timeout: int = 60, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def fake_nvidia_smi(tmp_path: Path) -> Path:
    """A folder holding an nvidia-smi that names a card, as the real one does with --query-gpu=name."""
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA Imaginary 80GB'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return fake


def test_without_nvidia_smi_it_stops_at_once(tmp_path):
    done = run(tmp_path, "/usr/bin:/bin")  # no nvidia-smi there
    assert done.returncode == NO_GPU, done.stderr
    assert "no CUDA GPU on this machine (nvidia-smi is not on PATH)" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing installed, run or written


def test_a_gpu_torch_cannot_use_is_no_gpu_either(tmp_path):
    done = run(tmp_path, f"{fake_nvidia_smi(tmp_path)}:/usr/bin:/bin")
    assert done.returncode == NO_GPU, done.stderr
    assert "lists 'NVIDIA Imaginary 80GB' but" in done.stderr and "cannot use CUDA" in done.stderr
    assert not (tmp_path / "out").exists()


STEPS = ("set-up: ok", "gpu checks: ok", "paper_scale FedAvg ResNet-18 CIFAR-100: ok", "paper_scale FedDifRC CIFAR-10: ok")


def test_the_dry_run_starts_every_step_and_writes_its_line(tmp_path):
    """FEDGUIDE_CHECK_DEVICE=simulated: every check on train.device: simulated instead of cuda, at the smallest
    sizes; no wheels (this checkout's environment has every package). About a minute on two CPU cores."""
    done = run(tmp_path, f"{fake_nvidia_smi(tmp_path)}:/usr/bin:/bin", timeout=240, FEDGUIDE_CHECK_DEVICE="simulated",
               DEVICE_CHECK_QUICK="1", FEDGUIDE_WHEELS="none")
    results = tmp_path / "out" / "nvidia-imaginary-80gb-dry-run"
    summary = (results / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stderr
    lines = summary.splitlines()
    assert lines[0].startswith("device-check: DRY RUN with train.device: simulated")
    for start in STEPS:
        assert any(line.startswith(start) for line in lines), (start, summary)
    # each GPU check wrote its line, every method has one (FedAvg run, the others named as left out)
    from fedguide.methods import METHODS

    for check in ("transfers fedavg: ok", "precision bf16: ok", "precision fp16: ok", "agreement fedavg: ok",
                  "determinism crop_flip: ok"):
        assert f"  gpu checks: {check}" in summary, (check, summary)
    for name in METHODS.names():
        assert f"  gpu checks: agreement {name}: " in summary, name
    for key in ("s_per_round=", "projected_hours=", "ratio_vs_floor="):
        assert sum(f": {key}" in line for line in lines) == 2, (key, summary)
    assert "pytest -m gpu: not run on the dry run (its tests need CUDA)" in lines
    assert lines[-1].startswith("total: ") and lines[-1].endswith("every check passed")
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(files) <= 6, files
    assert {p.name for p in files} == {"summary.txt", "environment.txt", "gpu_checks.log", "gpu_checks.json",
                                       "paper_scale.log"}
