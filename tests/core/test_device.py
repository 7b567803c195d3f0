"""train.device, data.on_device, train.augment, train.precision and friends, on a CPU (the CUDA paths are
tests/gpu/, run by scripts/device-check.sh where a GPU is present)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from fedguide.core.device import autocast, check_precision, deterministic, resolve_device, to_cpu, to_device
from fedguide.data.augment import build_augment, check_augment
from fedguide.data.device_data import DeviceData, as_uint8, bytes_needed
from fedguide.data.sources._images import normalise
from fedguide.data.sources.base import DatasetSplits
from fedguide.fl.run_folder import RunFolder
from fedguide.fl.setup import open_run, prepare
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config, without_timing

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def image_splits(n: int = 64, channels: int = 3, size: int = 16, seed: int = 0) -> DatasetSplits:
    """8-bit images standardised the way the sources do it (``normalise``)."""
    gen = torch.Generator().manual_seed(seed)
    mean, std = MEAN[:channels], STD[:channels]
    u = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    return DatasetSplits(normalise(u, mean, std), y, normalise(u[:16], mean, std), y[:16],
                         [f"c{i}" for i in range(4)], pixel_stats=(mean, std))


# ---- devices ------------------------------------------------------------------------------------

def test_auto_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_cuda_names_auto_and_cpu(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no usable CUDA device.*auto.*cpu"):
        resolve_device(spec)


def test_missing_device_index_says_how_many_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="cuda:5 does not exist.*2 CUDA devices.*cuda:0 .. cuda:1"):
        resolve_device("cuda:5")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_device_name_that_is_no_device_is_refused():
    with pytest.raises(ConfigError, match="not a device; write auto, cpu, cuda, cuda:N, mps or simulated"):
        resolve_device("gpu0")


def test_fp16_needs_a_gpu_bf16_does_not():
    with pytest.raises(ConfigError, match="fp16 needs a GPU.*bf16 or fp32"):
        check_precision("fp16", torch.device("cpu"))
    check_precision("bf16", torch.device("cpu"))
    check_precision("fp16", torch.device("cuda", 0))


def test_config_errors_come_at_prepare(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device: cuda"):
        prepare(tiny_config(train={"device": "cuda"}))
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        prepare(tiny_config(train={"precision": "fp16"}))
    with pytest.raises(ConfigError, match="train.augment: crop .*does not declare"):
        prepare(tiny_config(train={"augment": "crop"}))  # 8x8 digits: standardised globally, no pixel stats


def test_records_move_whole():
    rec = {"w": torch.ones(2), "nested": {"t": [torch.zeros(1), 3]}, "n": 5}
    out = to_device(rec, torch.device("cpu"))
    assert out["n"] == 5 and out["nested"]["t"][1] == 3 and torch.equal(out["nested"]["t"][0], torch.zeros(1))
    assert to_cpu(rec)["w"] is rec["w"]  # already there: no copy


def test_deterministic_is_restored_after_the_block():
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic(True):
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.parametrize("benchmark", [True, False])
def test_cudnns_algorithm_search_follows_the_config_and_is_restored(benchmark, tmp_path, monkeypatch):
    """train.cudnn_benchmark: the search per input shape in a run that is not deterministic (never in one that
    is), in the engine's process and, for the run's life, in each client-side process (open_run(setup=True))."""
    before = torch.backends.cudnn.benchmark
    with deterministic(False, benchmark):
        assert torch.backends.cudnn.benchmark is benchmark
        with deterministic(True, benchmark):
            assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.benchmark is before
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not benchmark)  # restored after the test
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    cfg = tiny_config(train={"rounds": 1, "cudnn_benchmark": benchmark})
    opened = open_run(prepare(cfg), tmp_path / "client", setup=True)
    assert torch.backends.cudnn.benchmark is benchmark
    del opened  # the settings are the process's, not an object's that could take them back when collected
    import gc
    gc.collect()
    assert torch.backends.cudnn.benchmark is benchmark
    # a deterministic run's client side keeps deterministic algorithms for its life
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    try:
        open_run(prepare(tiny_config(train={"rounds": 1, "deterministic": True})), tmp_path / "det", setup=True)
        gc.collect()
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(deterministic_before)


# ---- data on the device -------------------------------------------------------------------------

def test_uint8_encoding_gives_back_the_sources_floats_bit_for_bit():
    splits = image_splits()
    u = as_uint8(splits.train_x, splits.pixel_stats)
    assert u is not None and u.dtype == torch.uint8
    dd = DeviceData(splits, torch.device("cpu"), encode=True)
    assert dd.train.uint8 and dd.train.values.dtype == torch.uint8
    idx = torch.tensor([5, 0, 63, 7])
    x, y = dd.train_batch(idx)
    assert torch.equal(x, splits.train_x[idx]) and torch.equal(y, splits.train_y[idx])
    xt, _ = dd.test_batch(0, 16)
    assert torch.equal(xt, splits.test_x)


def test_floats_that_are_not_8_bit_stay_float():
    splits = image_splits()
    splits.train_x = splits.train_x + 1e-3  # no longer k/255 standardised
    assert as_uint8(splits.train_x, splits.pixel_stats) is None
    dd = DeviceData(splits, torch.device("cpu"), encode=True)
    assert not dd.train.uint8 and dd.train.values.dtype == torch.float32


def test_on_the_cpu_the_host_tensors_are_used_as_they_are():
    splits = image_splits()
    dd = DeviceData(splits, torch.device("cpu"))
    assert dd.train.values is splits.train_x and dd.on_device


def test_uint8_takes_a_quarter_of_float32():
    splits = image_splits(n=100)
    assert bytes_needed(splits) == 100 * 3 * 16 * 16 + 16 * 3 * 16 * 16 + 8 * 116


def test_on_device_true_that_does_not_fit_says_how_much(monkeypatch):
    splits = image_splits()
    with pytest.raises(ConfigError, match=r"needs 0.00 GiB on cuda:0.*0.00 GiB are free.*on_device: auto"):
        DeviceData(splits, torch.device("cuda", 0), True, free_bytes=lambda d: 10)


# ---- augmentation -------------------------------------------------------------------------------

def test_augment_is_seeded_by_the_global_generator_and_changes_the_batch():
    splits = image_splits()
    dd = DeviceData(splits, torch.device("cpu"), augment=build_augment("crop_flip", (3, 16, 16)), encode=True)
    idx = torch.arange(32)
    torch.manual_seed(3)
    a, _ = dd.train_batch(idx)
    torch.manual_seed(3)
    b, _ = dd.train_batch(idx)
    torch.manual_seed(4)
    c, _ = dd.train_batch(idx)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, splits.train_x[idx]) and a.shape == splits.train_x[idx].shape


def test_crop_pads_with_black_pixels():
    splits = image_splits(n=512)
    splits.train_x = normalise(torch.full((512, 3, 16, 16), 255, dtype=torch.uint8), MEAN, STD)
    dd = DeviceData(splits, torch.device("cpu"), augment=build_augment("crop", (3, 16, 16)))
    torch.manual_seed(0)
    x, _ = dd.train_batch(torch.arange(512))
    black = normalise(torch.zeros(1, 3, 1, 1, dtype=torch.uint8), MEAN, STD)
    white = splits.train_x[0, :, 0, 0].view(1, 3, 1, 1)
    is_black = torch.isclose(x, black, atol=1e-5).all(1)
    is_white = torch.isclose(x, white, atol=1e-5).all(1)
    assert (is_black | is_white).all() and is_black.any()  # shifted images show the padding, nothing else


@pytest.mark.parametrize("name,shape,floating,stats,message", [
    ("rotate", (3, 8, 8), True, True, "not a recipe"),
    ("crop_flip", (40,), False, True, "token ids"),
    ("autoaugment", (1, 28, 28), True, True, "three-channel"),
])
def test_augmentations_the_data_cannot_take_are_refused(name, shape, floating, stats, message):
    with pytest.raises(ConfigError, match=message):
        check_augment(name, shape, floating, stats)


def test_autoaugment_runs_on_rgb_batches():
    torch.manual_seed(0)
    out = build_augment("autoaugment", (3, 16, 16))(torch.rand(8, 3, 16, 16))
    assert out.shape == (8, 3, 16, 16) and out.min() >= 0 and out.max() <= 1


# ---- runs ---------------------------------------------------------------------------------------

def test_bf16_autocast_runs_on_the_cpu_and_differs_from_fp32(tmp_path):
    with autocast(torch.device("cpu"), "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    _, fp32, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 1}), "fp32")
    _, bf16, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 1, "precision": "bf16"}), "bf16")
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=0.05) and bf16[0]["loss"] != fp32[0]["loss"]


def test_channels_last_and_deterministic_leave_the_cpu_result_alone(tmp_path):
    cfg = {"model": {"name": "resnet10"}, "train": {"rounds": 1}}
    _, plain, _ = run_tiny(tmp_path, tiny_config(cfg), "plain")
    _, other, _ = run_tiny(tmp_path, tiny_config(cfg, train={"rounds": 1, "channels_last": True,
                                                            "deterministic": True}), "other")
    assert other[0]["accuracy"] == pytest.approx(plain[0]["accuracy"], abs=0.02)
    assert not torch.are_deterministic_algorithms_enabled()


def test_checkpoints_and_client_state_are_on_the_cpu_and_resume_ignores_the_device(tmp_path):
    cfg = tiny_config(method={"name": "scaffold"}, train={"rounds": 2, "device": "cpu"})
    _, whole, _ = run_tiny(tmp_path, cfg, "whole")
    _, _, run_dir = run_tiny(tmp_path, tiny_config(method={"name": "scaffold"}, train={"rounds": 1, "device": "cpu"}),
                             "split")
    with safe_open(str(run_dir / "checkpoints/last.safetensors"), framework="pt") as f:
        assert all(f.get_tensor(k).device.type == "cpu" for k in f.keys())
    # Where it computes is not pinned: the run continues under train.device: auto (here the CPU again).
    text = (run_dir / "config.yaml").read_text().replace("device: cpu", "device: auto").replace("\n  rounds: 1\n", "\n  rounds: 2\n")
    (run_dir / "config.yaml").write_text(text)
    from fedguide.fl.engine import Experiment
    Experiment(prepare(RunFolder(run_dir).read_config()), run_dir, log=lambda s: None).run(resume=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert without_timing(rows) == without_timing(whole)


def test_run_context_carries_the_device_and_its_data(tmp_path):
    ctx, _ = open_run(prepare(tiny_config(train={"device": "cpu"})), tmp_path)
    assert ctx.device == torch.device("cpu") and ctx.device_data.device == ctx.device
    assert next(ctx.model.parameters()).device == ctx.device


def test_resume_takes_another_device_from_the_command_line(tmp_path, monkeypatch, capsys):
    from fedguide.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, _, run_dir = run_tiny(tmp_path, tiny_config(train={"rounds": 1}), "run")
    text = (run_dir / "config.yaml").read_text().replace("\n  rounds: 1\n", "\n  rounds: 2\n")
    (run_dir / "config.yaml").write_text(text.replace("\n  device: auto", "\n  device: cuda"))
    assert main(["resume", str(run_dir), "--quiet"]) != 0
    assert "train.device: cuda was asked for" in capsys.readouterr().err
    assert main(["resume", str(run_dir), "--device", "cpu", "--quiet"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
