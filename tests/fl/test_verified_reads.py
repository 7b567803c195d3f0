"""Every file fedguide reads back is verified, and every failure is a sentence: the checkpoint's metadata
(its metrics history and pinned config) under a digest, model, client-state and pretraining stage files
sealed, a renamed checksum key refused, the lock file never followed, a damaged config.yaml or JSON file
named in one line, a full disk said to lose nothing, Ctrl-C in pretrain-guidance ending with a continue hint,
and the smaller gaps around them (report's settings, a lowered train.rounds, resume --rebuild, a refused first
round, a sweep's diverged run, PNG modes, $FEDGUIDE_DATA)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from fedguide.cli import main
from fedguide.core.checksums import tensors_sha256
from fedguide.core.state import ClientStateStore
from fedguide.fl.checkpoint import FILE, DamagedCheckpoint, load_checkpoint
from fedguide.fl.run_folder import RunFolder
from fedguide.registry import ConfigError
from tests.fl.test_reliability import crashed_run, edit_config, flip_a_tensor_byte
from tests.tiny import run_tiny, tiny_config, tiny_raw, without_timing


def header_bounds(data: bytes) -> tuple[int, int]:
    return 8, 8 + int.from_bytes(data[:8], "little")


def replace_in_header(path: Path, old: bytes, new: bytes) -> None:
    """One edit of a safetensors header that keeps its length (a flipped digit, a renamed key)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    start, stop = header_bounds(data)
    at = data.index(old, start, stop)
    path.write_bytes(data[:at] + new + data[at + len(old):])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# ---- the checkpoint's metadata ------------------------------------------------------------------------
def test_a_flipped_digit_of_the_metrics_history_is_a_damaged_checkpoint(tmp_path):
    run_dir = crashed_run(tmp_path, 2)
    path = run_dir / "checkpoints" / FILE
    accuracy = load_checkpoint(run_dir / "checkpoints").metrics[0]["accuracy"]
    digits = json.dumps(accuracy).encode()  # as the history holds it, e.g. 0.1842
    flipped = digits[:2] + (b"9" if digits[2:3] != b"9" else b"1") + digits[3:]  # 0.18 -> 0.98
    replace_in_header(path, digits, flipped)
    with pytest.raises(DamagedCheckpoint, match="its metadata does not match the sha256"):
        load_checkpoint(run_dir / "checkpoints")


@pytest.mark.parametrize("key", [b'"sha256"', b'"metadata_sha256"'])
def test_a_renamed_checksum_key_is_refused_not_loaded_unverified(tmp_path, key):
    run_dir = crashed_run(tmp_path, 1)
    path = run_dir / "checkpoints" / FILE
    replace_in_header(path, key, key[:-2] + b'X"')
    with pytest.raises(DamagedCheckpoint, match="damaged checkpoint: .*fedguide run"):
        load_checkpoint(run_dir / "checkpoints")


def write_old_checkpoint(folder: Path, with_digest: bool) -> None:
    """A checkpoint as fedguide wrote it before its metadata was sealed (a tensor sha256 at most)."""
    from safetensors.torch import save_file

    tensors = {"global": torch.arange(4.0)}
    meta = {"progress": json.dumps({"round": 1, "metrics": [{"round": 1, "accuracy": 0.5}], "wall_seconds": 1.0})}
    if with_digest:
        meta["sha256"] = tensors_sha256(tensors)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / FILE), metadata=meta)


def test_an_old_checkpoint_with_a_tensor_digest_loads_once_with_a_warning(tmp_path, capsys):
    write_old_checkpoint(tmp_path / "old", with_digest=True)
    assert load_checkpoint(tmp_path / "old").metrics == [{"round": 1, "accuracy": 0.5}]
    assert "written before checkpoints sealed their metadata" in capsys.readouterr().err
    write_old_checkpoint(tmp_path / "none", with_digest=False)
    with pytest.raises(DamagedCheckpoint, match="carries no checksum"):
        load_checkpoint(tmp_path / "none")


# ---- the lock file ------------------------------------------------------------------------------------
def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path, capsys):
    run_dir = crashed_run(tmp_path, 1)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    (run_dir / ".lock").unlink()
    (run_dir / ".lock").symlink_to(precious)
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    assert "is not a lock file fedguide wrote" in one_line_error(capsys)
    assert precious.read_text() == "keep me\n"
    (run_dir / ".lock").unlink()
    os.mkfifo(run_dir / ".lock")
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    assert "it is not a regular file" in one_line_error(capsys)


# ---- analyze: the model and the run's files -----------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    return run_tiny(tmp_path_factory.mktemp("finished"), tiny_config())[2]


def copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_analyze_refuses_a_damaged_model_with_a_sentence(finished, tmp_path, capsys, damage):
    run_dir = copy_run(finished, tmp_path / "run")
    model = run_dir / "model.safetensors"
    if damage == "truncated":
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    else:
        flip_a_tensor_byte(model)
    assert main(["analyze", str(run_dir)]) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"error: damaged model: {model}") and "fedguide run" in line
    assert not (run_dir / "analysis").exists()  # nothing drawn from it


@pytest.mark.parametrize("command", ["analyze", "resume"])
@pytest.mark.parametrize("text,said", [(b"train: [\n", "config.yaml:2:1: not valid YAML"),
                                       (b"\x00\xff\xfe", "config.yaml is not text (byte 1 is not UTF-8)"),
                                       (b"- a\n- b\n", "config.yaml: expected a mapping of settings, found list")])
def test_a_malformed_config_yaml_is_one_line_naming_the_file(finished, tmp_path, capsys, command, text, said):
    run_dir = copy_run(finished, tmp_path / "run")
    (run_dir / "config.yaml").write_bytes(text)
    assert main([command, str(run_dir)]) == 2
    line = one_line_error(capsys)
    assert f"{run_dir}/{said}" in line and "restore the file the run wrote" in line, line


def test_a_damaged_summary_json_is_named_in_analyze(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    (run_dir / "summary.json").write_text('{"rounds": 3,')
    assert main(["analyze", str(run_dir)]) == 2
    assert f"{run_dir / 'summary.json'}: not valid JSON" in one_line_error(capsys)


# ---- client state -------------------------------------------------------------------------------------
def scaffold_crashed(tmp_path) -> Path:
    return crashed_run(tmp_path, 2, method={"name": "scaffold"}, clients={"num": 2, "per_round": 2})


@pytest.mark.parametrize("damage,said", [("flipped", "do not match the sha256"), ("truncated", "cannot be read")])
def test_damaged_client_state_stops_the_resume_naming_the_client(tmp_path, capsys, damage, said):
    from fedguide.core.state import DamagedState

    run_dir = scaffold_crashed(tmp_path)
    path = run_dir / "client_state" / "committed" / "1" / "tensors.safetensors"
    assert ClientStateStore(run_dir / "client_state").get(1)  # intact, it reads back
    if damage == "flipped":
        flip_a_tensor_byte(path)
    else:
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DamagedState, match=f"damaged client state: {path} \\(client 1\\): .*{said}"):
        ClientStateStore(run_dir / "client_state").get(1)
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    assert "damaged client state" in one_line_error(capsys)


def test_client_state_written_before_sealing_is_read_with_one_warning(tmp_path, capsys):
    from safetensors.torch import save_file

    from fedguide.core.state import DamagedState

    store = ClientStateStore(tmp_path / "client_state")
    for cid in (0, 1):
        folder = store.committed / str(cid)
        folder.mkdir(parents=True)
        save_file({"c": torch.full((3,), float(cid))}, str(folder / "tensors.safetensors"))
        (folder / "scalars.json").write_text(json.dumps({"steps": cid}))
    assert store.get(1)["steps"] == 1 and torch.equal(store.get(1)["c"], torch.ones(3))
    assert store.get(0)["steps"] == 0
    assert capsys.readouterr().err.count("written before state files were sealed") == 1
    (store.committed / "0" / "scalars.json").unlink()  # no digest and not the old layout: refused
    with pytest.raises(DamagedState, match="carries no checksum"):
        store.get(0)


# ---- a full disk ----------------------------------------------------------------------------------------
def test_a_full_disk_at_a_checkpoint_loses_nothing_and_says_how_to_continue(tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw()))
    real, saves = safetensors.torch.save_file, []

    def full_at_second_checkpoint(tensors, filename, metadata=None):
        if ".last.safetensors." in str(filename):
            saves.append(filename)
            if len(saves) == 2:  # as safetensors reports ENOSPC
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_at_second_checkpoint)
    run_dir = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(run_dir), "--quiet"]) == 2
    line = one_line_error(capsys)
    assert "could not write the checkpoint of round 2 (No space left on device" in line
    assert "Nothing is lost: the checkpoint of round 1 is intact" in line
    assert line.endswith(f"continue with: fedguide resume {run_dir}")
    assert load_checkpoint(run_dir / "checkpoints").round == 1
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name != FILE]  # no temporary left
    monkeypatch.undo()
    assert main(["resume", str(run_dir), "--quiet"]) == 0
    _, ref_rows, _ = run_tiny(tmp_path, tiny_config(), "ref")
    rows = RunFolder(run_dir).read_metrics()
    assert without_timing(rows) == without_timing(ref_rows)


def test_a_full_disk_elsewhere_in_a_run_says_nothing_is_lost(tmp_path, capsys, monkeypatch):
    import errno

    from fedguide.fl import run_folder

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw()))

    def full(self, rows):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path / "metrics.jsonl"))

    monkeypatch.setattr(run_folder.RunFolder, "write_metrics", full)
    assert main(["run", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    line = one_line_error(capsys)
    assert "No space left on device" in line and "Nothing is lost" in line
    assert f"continue with: fedguide resume {tmp_path / 'run'}" in line


# ---- pretrain-guidance ----------------------------------------------------------------------------------
def test_a_flipped_stage_file_is_refused_not_reused(tmp_path):
    from fedguide.guidance.embedded.pretrain.partial import load_stage, save_atomic

    path = tmp_path / "vae.safetensors"
    key = {"stage": "vae", "steps": 12}
    save_atomic({"key": key, "weights": torch.arange(64.0), "step": 40}, path)
    assert load_stage(path, key)["step"] == 40
    original = path.read_bytes()
    flip_a_tensor_byte(path)
    with pytest.raises(ValueError, match="not intact .*do not match the sha256.*delete it"):
        load_stage(path, key)
    path.write_bytes(original)
    replace_in_header(path, b'\\"step\\"}, {\\"value\\": 40', b'\\"step\\"}, {\\"value\\": 90')
    with pytest.raises(ValueError, match="its metadata does not match"):
        load_stage(path, key)


def test_an_unsealed_stage_file_is_trained_again_not_reused(tmp_path, capsys):
    import json as json_

    from safetensors.torch import save_file

    from fedguide.guidance.embedded.pretrain.partial import FORMAT, _pack, load_stage

    tensors: dict = {}
    meta = {FORMAT: json_.dumps(_pack({"key": {"stage": "clip"}, "w": torch.ones(2)}, tensors))}
    save_file(tensors, str(tmp_path / "clip.safetensors"), metadata=meta)
    assert load_stage(tmp_path / "clip.safetensors", {"stage": "clip"}) is None
    assert "not reused, its stage is trained again" in capsys.readouterr().err


def test_ctrl_c_in_pretrain_guidance_prints_a_continue_hint_not_a_traceback(tmp_path, capsys, monkeypatch):
    pytest.importorskip("diffusers")
    from fedguide.guidance.embedded.pretrain import run as pretrain_run

    def interrupted(out, *args, **kwargs):
        (out.parent / f".{out.name}.partial").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain_run, "pretrain", interrupted)
    out = tmp_path / "models"
    with pytest.raises(SystemExit) as exit_:
        try:
            main(["pretrain-guidance", "--out", str(out), "--vae-steps", "5", "--quiet"])
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C left pretrain-guidance as a KeyboardInterrupt (a traceback)")
    assert exit_.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"finished stages are kept in {tmp_path / '.models.partial'}" in err
    assert f"continue with: fedguide pretrain-guidance --out {out} --vae-steps 5 --quiet" in err


# ---- the warnings -------------------------------------------------------------------------------------
def test_report_shows_the_pinned_settings_of_an_edited_config_and_says_so(finished, tmp_path):
    from fedguide.report import load_run

    run_dir = copy_run(finished, tmp_path / "run")
    edit_config(run_dir, "train.lr", 0.5)
    record = load_run(run_dir)
    assert record.config["train"]["lr"] == 0.05
    assert any("was edited since the run wrote it (train.lr: 0.5 (config.yaml) vs 0.05 (checkpoint))" in w
               for w in record.warnings), record.warnings


def test_lowering_rounds_of_a_finished_run_is_refused(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    edit_config(run_dir, "train.rounds", 2)
    assert main(["resume", str(run_dir), "--quiet"]) == 2
    assert "train.rounds may only be raised" in capsys.readouterr().err


def test_resume_takes_the_rebuild_that_cache_errors_name(tmp_path, monkeypatch):
    import fedguide.api as api
    from fedguide.fl import preflight

    run_dir = crashed_run(tmp_path, 1)
    seen = []
    monkeypatch.setattr(preflight, "check", lambda cfg, *a, **k: seen.append(cfg.guidance.rebuild) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        api.resume(run_dir, rebuild=True, quiet=True)
    assert seen == [True]
    monkeypatch.undo()
    assert main(["resume", str(run_dir), "--rebuild", "--quiet"]) == 0  # the option the errors name exists


def test_a_run_refused_in_its_first_round_does_not_block_the_corrected_command(tmp_path, monkeypatch, capsys):
    from fedguide.fl import engine

    real = engine.round_evaluation

    def refused(*args, **kwargs):  # as a setting the first round turns down (a split it cannot score)
        raise ConfigError("this split cannot be scored; write another setting")

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(method={"name": "scaffold"})))
    monkeypatch.setattr(engine, "round_evaluation", refused)
    run_dir = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(run_dir), "--quiet"]) == 2
    assert "cannot be scored" in one_line_error(capsys)
    assert not (run_dir / "config.yaml").exists() and not list(run_dir.glob("client_state/pending-*"))
    monkeypatch.setattr(engine, "round_evaluation", real)
    assert main(["run", str(cfg), "--out", str(run_dir), "--quiet"]) == 0  # the corrected command, same --out
    _, ref_rows, _ = run_tiny(tmp_path, tiny_config(method={"name": "scaffold"}), "ref")
    assert without_timing(RunFolder(run_dir).read_metrics()) == without_timing(ref_rows)
    assert main(["run", str(cfg), "--out", str(run_dir), "--quiet"]) == 2  # a run with rounds stays protected
    assert "already holds a run" in capsys.readouterr().err


def test_a_sweep_run_again_with_a_diverged_combination_exits_2(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw(train={"rounds": 2})))
    command = ["run", str(cfg), "--sweep", "train.lr=0.05,1e12", "--out", str(tmp_path / "sweep"), "--quiet"]
    assert main(command) == 2
    capsys.readouterr()
    assert main(command) == 2  # run again: the diverged one is skipped, and still said
    err = capsys.readouterr().err
    assert "diverged before" in err and "1 of 2 runs diverged" in err


def test_report_pngs_follow_the_umask(finished, tmp_path):
    from fedguide.report import report

    old = os.umask(0o077)
    try:
        result = report([finished], tmp_path / "report")
    finally:
        os.umask(old)
    assert result.plot_paths
    assert {p.stat().st_mode & 0o777 for p in result.plot_paths} == {0o600}


def test_fedguide_data_pointing_nowhere_is_said(tmp_path, monkeypatch, capsys):
    from fedguide.data.sources import _files

    monkeypatch.setenv("FEDGUIDE_DATA", str(tmp_path / "typo"))
    monkeypatch.setattr(_files, "_WARNED_ENV", set())
    bases = _files.search_bases(None, "fashion-mnist")
    assert tmp_path / "typo" in bases
    assert f"$FEDGUIDE_DATA is {tmp_path / 'typo'}, which is not a folder" in capsys.readouterr().err
