"""Nothing lost, nothing silently wrong: the run-folder lock, the config pinned by the checkpoint,
checksummed checkpoints and bases, the checks on input that used to pass silently."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedguide.config import build_config, load_config
from fedguide.core.checksums import cached_file_sha256
from fedguide.fl.checkpoint import FILE, DamagedCheckpoint, load_checkpoint
from fedguide.fl.engine import Experiment
from fedguide.fl.run_folder import RunFolder
from fedguide.fl.run_lock import RunFolderBusy, RunLock
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from tests.tiny import Crash, crash_after, run_tiny, tiny_config, without_timing


# ---- the lock ----------------------------------------------------------------------------------------
def test_a_locked_run_folder_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):
            RunLock(tmp_path / "run").__enter__()
        with pytest.raises(RunFolderBusy, match="in use by another fedguide process"):
            Experiment(prepare(tiny_config()), tmp_path / "run", log=lambda s: None).run()
    assert not (tmp_path / "run" / "config.yaml").exists()  # the refused run wrote nothing
    with RunLock(tmp_path / "run"):  # released at exit
        pass


def test_a_second_run_into_a_finished_folder_is_refused_under_the_lock(tmp_path):
    run_tiny(tmp_path, tiny_config(), "run")
    with pytest.raises(ConfigError, match="already holds a run"):
        run_tiny(tmp_path, tiny_config(seed=9), "run")
    assert RunFolder(tmp_path / "run").read_config().seed == 1  # the first run's files are untouched


# ---- the config pinned by the checkpoint --------------------------------------------------------------
def crashed_run(tmp_path, rounds_done: int = 1, **over):
    run_dir = tmp_path / "run"
    with pytest.raises(Crash):
        Experiment(prepare(tiny_config(**over)), run_dir, log=crash_after(rounds_done)).run()
    return run_dir


def edit_config(run_dir: Path, key: str, value) -> None:
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    section, leaf = key.split(".")
    raw[section][leaf] = value
    if key == "method.name":
        raw["method"] = {"name": value}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))


def resume(run_dir: Path):
    return Experiment(prepare(RunFolder(run_dir).read_config()), run_dir, log=lambda s: None).run(resume=True)


@pytest.mark.parametrize("key,value,named", [("train.lr", 0.5, "train.lr: 0.05 (checkpoint) vs 0.5"),
                                             ("method.name", "fedprox", "method.name: 'fedavg' (checkpoint)"),
                                             ("train.rounds", 2, "train.rounds may only be raised")])
def test_resume_refuses_an_edited_config_naming_the_keys(tmp_path, key, value, named):
    run_dir = crashed_run(tmp_path)
    edit_config(run_dir, key, value)
    with pytest.raises(ConfigError, match="was edited since the run started") as err:
        resume(run_dir)
    assert named in str(err.value)
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1  # nothing was trained or rewritten


def test_raising_rounds_on_resume_continues_and_says_so(tmp_path):
    ref, ref_rows, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 4}), "ref")
    run_dir = crashed_run(tmp_path, 2)
    edit_config(run_dir, "train.rounds", 4)
    summary = resume(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 4 and summary["rounds_raised_from"] == 3
    assert without_timing(rows) == without_timing(ref_rows)  # the same as a 4-round run from the start


def test_raising_rounds_continues_a_finished_run_from_the_command_line(tmp_path):
    from fedguide.cli import main

    run_tiny(tmp_path, tiny_config(), "run")
    edit_config(tmp_path / "run", "train.rounds", 4)
    assert main(["resume", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["accuracy_curve"]) == 4 and summary["rounds_raised_from"] == 3


# ---- checksums --------------------------------------------------------------------------------------
def flip_a_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")  # safetensors: u64 header length, JSON header, tensors
    data[header + (len(data) - header) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_flipped_bytes_or_truncated_is_reported_damaged(tmp_path):
    run_dir = crashed_run(tmp_path, 2)
    path = run_dir / "checkpoints" / FILE
    original = path.read_bytes()
    flip_a_tensor_byte(path)
    with pytest.raises(DamagedCheckpoint, match="damaged checkpoint: .*do not match the sha256") as err:
        load_checkpoint(run_dir / "checkpoints")
    assert "fedguide run" in str(err.value)  # what to do
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(DamagedCheckpoint, match="damaged checkpoint: .*cannot be read"):
        resume(run_dir)
    path.write_bytes(original)
    assert resume(run_dir)["rounds"] == 3


def test_a_pca_basis_with_flipped_bytes_is_refused_with_the_rebuild_hint(tmp_path):
    from fedguide.guidance.fused import FusedFeatures

    feats = FusedFeatures(["up.1"], d=4, samples_per_image=8)
    g = torch.Generator().manual_seed(0)
    feats.fit([{"up.1": torch.randn(6, 8, 4, 4, generator=g)} for _ in range(2)])
    path = tmp_path / "basis.safetensors"
    feats.save(path)
    assert FusedFeatures.load(path).recipe() == feats.recipe()
    flip_a_tensor_byte(path)
    with pytest.raises(ConfigError, match="do not match the sha256.*--rebuild"):
        FusedFeatures.load(path)


def test_weight_files_are_hashed_whole_once_per_size_and_mtime(tmp_path, monkeypatch):
    from fedguide.core import checksums

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    cache = tmp_path / "hashes.json"
    reads = []
    real = checksums.file_sha256
    monkeypatch.setattr(checksums, "file_sha256", lambda p: reads.append(p) or real(p))
    first = cached_file_sha256(weights, cache)
    assert cached_file_sha256(weights, cache) == first and len(reads) == 1  # remembered
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] = 1  # the middle MiB: a head-and-tail hash would not see it
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))
    assert cached_file_sha256(weights, cache) != first and len(reads) == 2


# ---- input that used to pass silently --------------------------------------------------------------
def idx(values: np.ndarray, dims: tuple[int, ...]) -> bytes:
    return bytes([0, 0, 8, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + values.astype(np.uint8).tobytes()


def test_fashion_mnist_labels_outside_0_to_9_are_refused(tmp_path):
    from fedguide.data.sources.fmnist import load_fmnist
    from fedguide.data.sources.base import SourceParams

    for split, n in (("train", 20), ("t10k", 10)):
        (tmp_path / f"{split}-images-idx3-ubyte").write_bytes(idx(np.zeros((n, 28, 28)), (n, 28, 28)))
        labels = np.arange(n) % 10
        if split == "train":
            labels[[3, 7]] = [200, 37]
        (tmp_path / f"{split}-labels-idx1-ubyte").write_bytes(idx(labels, (n,)))
    with pytest.raises(ConfigError, match=r"labels span 0\.\.200, expected 0\.\.9"):
        load_fmnist(SourceParams(root=str(tmp_path)))


def test_an_explicit_data_root_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="data.root .* does not exist"):
        prepare(tiny_config(data={"name": "digits", "root": str(tmp_path / "missing")}))


@pytest.mark.parametrize("key,value", [("train.lr", True), ("clients.num", False), ("data.fraction", True),
                                       ("method.mu", True)])
def test_a_boolean_where_a_number_belongs_is_refused(key, value):
    section, leaf = key.split(".")
    raw = {section: {leaf: value}}
    if section == "method":
        raw["method"]["name"] = "fedprox"
    with pytest.raises(ConfigError, match=f"{leaf}: {value} is a boolean where a number belongs"):
        prepare(build_config(raw))


def test_an_empty_config_file_warns_which_defaults_run(tmp_path, capsys):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    load_config(path)
    assert "is empty; every default runs (fedavg on fmnist" in capsys.readouterr().err


# ---- the command line --------------------------------------------------------------------------------
def test_out_that_cannot_be_written_gets_a_sentence(tmp_path, capsys):
    from fedguide.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"name": "digits"}, "model": {"name": "mlp"},
                                   "clients": {"num": 2, "per_round": 2}, "train": {"rounds": 1}}))
    a_file = tmp_path / "file"
    a_file.write_text("")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    unwritable = read_only if os.geteuid() != 0 else Path("/sys/fedguide-unwritable")  # root ignores modes
    for out in (a_file, a_file / "run", unwritable / "run"):
        assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot write the run folder") and "Traceback" not in err, err
    read_only.chmod(0o755)


def test_dry_run_refuses_what_building_the_method_refuses(tmp_path, capsys):
    from fedguide.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"name": "digits"}, "model": {"name": "mlp", "head_bias": True},
                                   "regularizers": ["dw"], "clients": {"num": 2, "per_round": 2}}))
    assert main(["run", str(cfg), "--dry-run"]) == 2
    assert "regularizers: [dw] needs model.head_bias=false (the config has true)" in capsys.readouterr().err


def test_a_refused_set_up_leaves_no_run_behind(tmp_path):
    cfg = tiny_config(method={"name": "feddifrc"}, guidance={"model": str(tmp_path / "no-such-model")})
    with pytest.raises(ConfigError):
        Experiment(prepare(cfg), tmp_path / "run", log=lambda s: None).run()
    left = sorted(p.name for p in (tmp_path / "run").iterdir()) if (tmp_path / "run").exists() else []
    assert not {"config.yaml", "client_state", "server_state", "checkpoints"} & set(left), left
    run_tiny(tmp_path, tiny_config(), "run")  # the folder takes a run afterwards


def test_resume_removes_temporaries_a_killed_write_left(tmp_path):
    run_dir = crashed_run(tmp_path, 1, method={"name": "local"})
    stale = [run_dir / ".metrics.jsonl.k2j3.tmp", run_dir / "client_state" / "committed" / ".x.abc.tmp"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("half")
    resume(run_dir)
    assert not [p for p in stale if p.exists()]


def test_divergence_says_how_to_go_on_and_the_report_marks_the_run(tmp_path):
    from fedguide.report import load_run

    cfg = tiny_config(train={"lr": 1e12})
    with pytest.raises(FloatingPointError) as err:
        Experiment(prepare(cfg), tmp_path / "run", log=lambda s: None).run()
    message = str(err.value)
    assert "diverged" in message and f"fedguide run {tmp_path / 'run' / 'config.yaml'} --out NEW_FOLDER" in message
    assert load_run(tmp_path / "run").status.startswith("diverged after round")


def test_report_warns_about_a_line_it_skipped(tmp_path):
    from fedguide.report import load_run

    run_dir = crashed_run(tmp_path, 2)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "accur')
    record = load_run(run_dir)
    assert len(record.metrics) == 2 and "skipped a line that is not valid JSON" in record.warnings[0]


def test_files_are_created_with_the_users_umask(tmp_path):
    from fedguide.core.atomic import write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.json", "{}")
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        os.umask(0o077)
        write_text(tmp_path / "b.json", "{}")
        assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_version_flag(capsys):
    from fedguide import __version__
    from fedguide.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fedguide {__version__}"
