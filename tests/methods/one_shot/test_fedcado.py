"""FedCADO and SD_Gen: the BN-statistics loss, classifier guidance and noise editing through the samplers,
the aggregation losses of Eq. 6, pixels for the classifiers, heterogeneous clients, the synthetic set on
disk (resumable, reusable) and one-shot runs end to end on a tiny random pipeline."""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedguide.methods.one_shot.fedcado import BatchNormStatistics, FedCADOParams, bn_statistics_loss, guidance_loss
from fedguide.methods.one_shot._distill import aggregation_loss, distillation_loss, teacher_targets, train_on_labeled
from fedguide.methods.one_shot._one_shot import client_class_accuracy
from fedguide.methods._synthetic import (GenerationJob, SyntheticStore, check_image_data, from_uint8,
                                         generate_set, round_robin_labels, to_model_input, to_uint8)
from fedguide.config import build_config, load_config
from fedguide.data.sources.base import DatasetSplits
from fedguide.fl.setup import prepare
from fedguide.core.weights import WeightLayout
from fedguide.guidance import samplers
from fedguide.config import GuidanceConfig
from fedguide.guidance.model import GuidanceModel
from fedguide.guidance.shared import guidance_pixels
from fedguide.guidance.tiny import build_tiny_pipeline
from fedguide.methods import METHODS
from fedguide.models import MODELS, build_model
from fedguide.registry import ConfigError
from tests.tiny import BASE, run_tiny

REPO = Path(__file__).resolve().parents[3]


# --- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("fedcado-sd"), seed=0)


@pytest.fixture(scope="module")
def gmodel(tiny_folder) -> GuidanceModel:
    return GuidanceModel.from_config(GuidanceConfig(model=str(tiny_folder), device="cpu"))


def splits_of(shape=(3, 8, 8), stats=(0.5, 0.25), names=("cat", "dog", "car")) -> DatasetSplits:
    x = torch.zeros(4, *shape)
    y = torch.zeros(4, dtype=torch.long)
    return DatasetSplits(x, y, x, y, list(names), pixel_stats=stats)


def bn_classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 3))
    with torch.no_grad():
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 2.0)
    return net.eval().requires_grad_(False)


def raw_config(tiny_folder: Path, tmp_path: Path, method: dict, **sections) -> dict:
    """A one-shot run in a few seconds: 2 clients with 2 disjoint digit classes each, 8x8 RGB images."""
    raw = copy.deepcopy(BASE)
    raw.update({
        "data": {"name": "digits_domains", "image_size": 8, "per_class": 4, "fraction": 0.3, "public_fraction": 0.1},
        "partition": {"name": "disjoint_classes", "k": 2},
        "model": {"name": "resnet10", "width": 4},
        "clients": {"num": 2, "per_round": 2},
        "train": {"rounds": 1, "epochs": 1, "batch_size": 32, "lr": 0.05},
        "method": {"local_epochs": 2, "images_per_class": 2, "steps": 2, "gen_batch_size": 4, "agg_epochs": 2,
                   "progress": False, **method},
        "guidance": {"model": str(tiny_folder), "feature_cache": str(tmp_path / "cache")},
    })
    raw["method"].setdefault("name", "fedcado")
    if raw["method"]["name"] == "fedcado":
        raw["method"].setdefault("edit_steps", 2)
    for k, v in sections.items():
        raw[k] = {**raw[k], **v} if isinstance(raw.get(k), dict) else v
    return raw


@pytest.fixture()
def sampler_calls(monkeypatch):
    calls = []
    real = samplers.sample

    def counting(model, prompts, config, *args, **kwargs):
        calls.append(len(prompts))
        return real(model, prompts, config, *args, **kwargs)

    monkeypatch.setattr(samplers, "sample", counting)
    return calls


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- L_BN ----------------------------------------------------------------------------------------------
def test_bn_loss_hand_computed():
    bn = nn.BatchNorm2d(2)
    bn.running_mean.copy_(torch.tensor([0.5, -1.0]))
    bn.running_var.copy_(torch.tensor([1.0, 4.0]))
    net = nn.Sequential(bn).eval()
    # channel 0 holds 1, 2 (sample 0) and 3, 4 (sample 1): mean 2.5, biased variance 1.25; channel 1 is all 2.
    x = torch.tensor([[[[1.0, 2.0]], [[2.0, 2.0]]], [[[3.0, 4.0]], [[2.0, 2.0]]]])
    with BatchNormStatistics(net) as stats:
        net(x)
        value = stats.loss()
        # ‖(2.5, 2) − (0.5, −1)‖ + ‖(1.25, 0) − (1, 4)‖ = √13 + √16.0625
        assert value.item() == pytest.approx(math.sqrt(13) + math.sqrt(16.0625), rel=1e-6)
        stats.reset()
        assert stats.loss().item() == 0.0
    net(x)
    assert stats.inputs == []  # hooks removed on exit


def test_bn_loss_sums_layers_skips_those_without_running_statistics_and_reaches_the_input():
    net = nn.Sequential(nn.BatchNorm2d(2), nn.Flatten(), nn.BatchNorm1d(4),
                        nn.BatchNorm1d(4, track_running_stats=False))
    net[0].running_mean.fill_(1.0)
    net[2].running_var.fill_(3.0)
    net.eval()
    x = torch.randn(5, 2, 1, 2, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with BatchNormStatistics(net) as stats:
        assert len(stats.layers) == 2
        net(x)
        first, second = stats.inputs
        expected = (bn_statistics_loss([first]) + bn_statistics_loss([second])).item()
        loss = stats.loss()
        assert loss.item() == pytest.approx(expected, rel=1e-6)
        assert torch.equal(first[0], x)  # statistics of the layer's input
        (grad,) = torch.autograd.grad(loss, x)
        assert grad.abs().sum() > 0


def test_guidance_loss_rows_are_ce_plus_lambda_bn():
    splits = splits_of()
    clf = bn_classifier()
    images = torch.rand(3, 3, 32, 32) * 2 - 1
    labels = torch.tensor([0, 1, 2, 1])
    idx = torch.tensor([3, 0, 2])
    with BatchNormStatistics(clf) as bn:
        rows = guidance_loss(clf, splits, labels, True, bn, 0.1)(images, idx)
        bn.reset()
        ce = F.cross_entropy(clf(to_model_input(splits, images)), labels[idx], reduction="none")
        torch.testing.assert_close(rows, ce + 0.1 * bn.loss())
        only_bn = guidance_loss(clf, splits, labels, False, bn, 0.1)(images, idx)
        assert torch.allclose(only_bn, only_bn[0].expand(3)) and only_bn[0] > 0


# --- guidance through the sampler ----------------------------------------------------------------------
def test_classifier_guidance_lowers_ce_on_the_images_versus_unguided_from_the_same_seed(gmodel):
    splits, clf = splits_of(), bn_classifier()
    prompts, labels = ["a photo of a cat"] * 4, torch.tensor([1, 1, 1, 1])

    def ce(images):
        with torch.no_grad():
            return F.cross_entropy(clf(to_model_input(splits, images)), labels).item()

    # The tiny random decoder passes small gradients; a large scale shows the direction plainly.
    config = samplers.SamplerConfig(steps=3, batch_size=4, progress=False, loss_scale=1000.0)
    unguided = samplers.sample(gmodel, prompts, config)
    guided = samplers.sample(gmodel, prompts, config, loss_fn=guidance_loss(clf, splits, labels, True, None, 0.1))
    assert ce(guided.images) < ce(unguided.images) - 1e-3


def test_noise_editing_lowers_the_loss_over_its_steps(gmodel):
    splits, clf = splits_of(), bn_classifier()
    labels = torch.tensor([2, 2, 2, 2])
    config = samplers.SamplerConfig(steps=2, batch_size=4, progress=False, edit_steps=5, edit_lr=100.0)
    with BatchNormStatistics(clf) as bn:
        result = samplers.sample(gmodel, ["a photo of a car"] * 4, config,
                                 loss_fn=guidance_loss(clf, splits, labels, True, bn, 0.1))
    losses = result.edit_losses
    assert len(losses) == 5
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 1e-3


# --- aggregation losses (Eq. 6) ------------------------------------------------------------------------
def test_teacher_targets_md_and_sd_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [0.0, 0.0]],             # teacher 0: (0.5, 0.5) on both images
                           [[math.log(3.0), 0.0], [0.0, 0.0]]])  # teacher 1: (0.75, 0.25), then (0.5, 0.5)
    assert teacher_targets(logits, "ft") is None
    torch.testing.assert_close(teacher_targets(logits, "md"), torch.tensor([[0.625, 0.375], [0.5, 0.5]]))
    torch.testing.assert_close(teacher_targets(logits, "sd", torch.tensor([1, 0])),
                               torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    # temperature 2: softmax(ln3 / 2, 0) = (√3, 1) / (√3 + 1)
    t2 = teacher_targets(logits, "sd", torch.tensor([1, 1]), temperature=2.0)
    assert t2[0, 0].item() == pytest.approx(math.sqrt(3) / (math.sqrt(3) + 1), rel=1e-6)


def test_aggregation_losses_hand_computed():
    student = torch.tensor([[0.0, 0.0]])  # (0.5, 0.5)
    label = torch.tensor([0])
    target = torch.tensor([[0.625, 0.375]])
    ce = math.log(2)
    assert aggregation_loss(student, label, None).item() == pytest.approx(ce, rel=1e-6)  # FT
    assert aggregation_loss(student, label, target, weight=0.0).item() == pytest.approx(ce, rel=1e-6)
    kl_ts = 0.625 * math.log(0.625 / 0.5) + 0.375 * math.log(0.375 / 0.5)
    assert aggregation_loss(student, label, target).item() == pytest.approx(ce + kl_ts, rel=1e-6)  # MD/SD
    kl_st = 0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375)
    assert distillation_loss(student, target, direction="student_teacher").item() == pytest.approx(kl_st, rel=1e-6)
    assert kl_ts != pytest.approx(kl_st)
    # T² scaling: at T = 2 the student (2, 0) becomes softmax(1, 0)
    s1 = 1 / (1 + math.exp(-1))
    kl_t2 = 0.625 * math.log(0.625 / s1) + 0.375 * math.log(0.375 / (1 - s1))
    assert distillation_loss(torch.tensor([[2.0, 0.0]]), target, temperature=2.0).item() == \
        pytest.approx(4 * kl_t2, rel=1e-5)


def test_matching_teacher_gives_zero_distillation_and_gradient():
    student = torch.tensor([[1.0, -2.0, 0.5]], requires_grad=True)
    target = F.softmax(student.detach(), dim=1)
    loss = distillation_loss(student, target)
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    (grad,) = torch.autograd.grad(loss, student)
    assert grad.abs().max() < 1e-6


# --- pixels --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels,stats", [(3, ((0.4, 0.5, 0.6), (0.2, 0.25, 0.3))), (1, (0.286, 0.353))])
def test_model_input_inverts_guidance_pixels(channels, stats):
    splits = splits_of((channels, 32, 32), stats)
    x = torch.rand(2, channels, 32, 32, generator=torch.Generator().manual_seed(0))
    x = (x - torch.as_tensor(stats[0]).reshape(1, -1, 1, 1)) / torch.as_tensor(stats[1]).reshape(1, -1, 1, 1)
    generated = guidance_pixels(splits, x).expand(-1, 3, -1, -1)  # the generators see grey as 3 equal channels
    torch.testing.assert_close(to_model_input(splits, generated), x, atol=1e-5, rtol=1e-5)


def test_model_input_resizes_to_the_dataset_and_keeps_flat_images_flat():
    splits = splits_of((1, 8, 8), (0.5, 0.25))
    out = to_model_input(splits, torch.full((2, 3, 32, 32), 0.5))  # pixel 0.75 everywhere
    assert out.shape == (2, 1, 8, 8)
    torch.testing.assert_close(out, torch.full_like(out, (0.75 - 0.5) / 0.25))


def test_image_data_without_pixel_statistics_is_refused():
    plain = DatasetSplits(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, 8, 8),
                          torch.zeros(2, dtype=torch.long), ["0", "1"])
    with pytest.raises(ConfigError, match="pixel statistics"):
        check_image_data(plain, "fedcado")
    tokens = DatasetSplits(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                           torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long), ["a", "b"])
    with pytest.raises(ConfigError, match="image dataset"):
        check_image_data(tokens, "fedcado")


def test_uint8_round_trip_and_round_robin_labels():
    images = torch.linspace(-1, 1, 2 * 3 * 4 * 4).reshape(2, 3, 4, 4)
    assert (from_uint8(to_uint8(images)) - images).abs().max() <= 1 / 127.5
    assert round_robin_labels([4, 7], 3) == [4, 7, 4, 7, 4, 7]


def test_client_class_accuracy_only_under_label_skew():
    preds, labels = torch.tensor([0, 1, 1, 3]), torch.tensor([0, 1, 2, 3])
    assert client_class_accuracy(preds, labels, {0: [0, 1], 1: [0, 1]}) == {}
    assert client_class_accuracy(preds, labels, {0: [0, 1], 1: [2, 3]}) == \
        {"client_class_accuracy": {"0": 1.0, "1": 0.5}}


# --- params --------------------------------------------------------------------------------------------
def test_params_defaults_are_the_papers_and_switches_are_checked():
    p = FedCADOParams()
    assert (p.images_per_class, p.cfg_scale, p.bn_weight, p.edit_steps, p.edit_lr, p.local_epochs, p.agg_epochs,
            p.agg_lr) == (30, 3.0, 0.1, 10, 0.1, 20, 20, 0.01)
    assert p.ce_loss and p.bn_loss and p.noise_editing and p.aggregation == "ft"
    with pytest.raises(ConfigError, match="noise_editing"):
        METHODS.parse_params("fedcado", {"ce_loss": False, "bn_loss": False}, "method")
    METHODS.parse_params("fedcado", {"ce_loss": False, "bn_loss": False, "noise_editing": False}, "method")
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        METHODS.parse_params("fedcado", {"client_models": ["resnet10", "nope"]}, "method")
    with pytest.raises(ConfigError, match="ce_loss"):
        METHODS.parse_params("sd_gen", {"ce_loss": True}, "method")  # SD_Gen has no guidance switches


# --- runs end to end -----------------------------------------------------------------------------------
def test_one_shot_run_end_to_end(tiny_folder, tmp_path, sampler_calls):
    summary, rows, run_dir = run_tiny(tmp_path, build_config(raw_config(tiny_folder, tmp_path, {})))
    (m,) = rows
    assert summary["rounds"] == 1 and m["bytes_down"] == 0
    assert m["generated_images"] == 8 and m["generation_images_per_second"] > 0 and m["synthetic_images"] == 8
    assert set(m["client_class_accuracy"]) == {"0", "1"}
    assert 0 <= m["synthetic_teacher_accuracy"] <= 1 and math.isfinite(m["aggregation_loss"])
    assert sampler_calls == [4, 4]  # one sampler call per client: 2 classes x 2 images
    store = SyntheticStore.of_run(run_dir)
    partition = json.loads((run_dir / "partition.json").read_text())["counts"]
    for cid in (0, 1):
        part = store.load(cid)  # stored at the classifiers' input size (8x8 RGB), not the generator's 32x32
        assert part.images.dtype == torch.uint8 and part.images.shape == (4, 3, 8, 8)
        assert [p.name for p in store.chunk_files(cid)] == ["chunk_0000.safetensors"]
        held = {c for c, n in enumerate(partition[cid]) if n > 0}
        assert set(part.labels.tolist()) == held  # every class the client holds, only those
        assert store.path(cid, ".png").stat().st_size > 0
        recipe = json.loads(store.metadata(cid)["recipe"])
        assert recipe["edit_steps"] == 2 and recipe["bn_loss"] and recipe["teacher"]["name"] == "resnet10"
    index = json.loads((store.folder / "index.json").read_text())
    assert index["images"] == 8 and [c["client"] for c in index["clients"]] == [0, 1]
    assert index["clients"][0]["files"] == ["client_000/chunk_0000.safetensors"]
    log = [json.loads(line) for line in (store.folder / "generation.jsonl").read_text().splitlines()]
    assert [(r["client"], r["chunk"]) for r in log] == [(0, 0), (1, 0)] and all(r["images_per_second"] > 0 for r in log)


class Killed(Exception):
    """Stands for the process dying while the server generates."""


def test_a_killed_run_resumes_per_chunk_to_the_uninterrupted_set(tiny_folder, tmp_path, sampler_calls, monkeypatch):
    # two chunks of two images per client: the run dies while generating client 0's second chunk
    cfg = build_config(raw_config(tiny_folder, tmp_path, {"gen_batch_size": 2, "chunk_images": 2}))
    counting = samplers.sample

    def dies_on_the_second_chunk(model, prompts, config, *args, **kwargs):
        if len(sampler_calls) == 1:
            raise Killed
        return counting(model, prompts, config, *args, **kwargs)

    monkeypatch.setattr(samplers, "sample", dies_on_the_second_chunk)
    with pytest.raises(Killed):
        run_tiny(tmp_path, cfg)
    store = SyntheticStore.of_run(tmp_path / "run")
    assert [p.name for p in store.chunk_files(0)] == ["chunk_0000.safetensors"]  # written as soon as it was done
    assert store.clients() == [0] and len(sampler_calls) == 1
    first = store.load(0).images.clone()
    monkeypatch.setattr(samplers, "sample", counting)
    _, rows, _ = run_tiny(tmp_path, cfg, resume=True)  # what `fedguide resume` does
    assert len(sampler_calls) == 4 and rows[0]["generation_chunks_skipped"] == 1 and rows[0]["generated_images"] == 6
    assert torch.equal(store.load(0).images[:2], first)  # read back, not regenerated
    _, _, ref_dir = run_tiny(tmp_path, cfg, name="uninterrupted")
    reference = SyntheticStore.of_run(ref_dir)
    for cid in (0, 1):  # the resumed set is the set of a run that was never killed
        assert torch.equal(store.load(cid).images, reference.load(cid).images)
        assert torch.equal(store.load(cid).labels, reference.load(cid).labels)
    calls = len(sampler_calls)
    changed = build_config(raw_config(tiny_folder, tmp_path, {"gen_batch_size": 2, "chunk_images": 2,
                                                              "images_per_class": 1}))
    with pytest.raises(ConfigError, match="already holds a run"):  # a finished run is never overwritten
        run_tiny(tmp_path, changed, name="run")
    (tmp_path / "run" / "config.yaml").unlink()  # the folder emptied of its run but for the synthetic files
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    run_tiny(tmp_path, changed, name="run")
    assert len(sampler_calls) == calls + 2  # another recipe: every chunk is stale, none is reused
    assert len(store.load(0).labels) == 2 and len(store.chunk_files(0)) == 1  # the surplus chunk is removed


def test_chunks_give_the_images_of_one_sampler_call(gmodel, tmp_path):
    """Chunked generation (first_index carries each image's noise; chunks end between sampler batches) gives
    the images of generating the client's whole sequence at once, guidance batch statistics included."""
    splits, clf = splits_of((3, 8, 8)), bn_classifier()
    config = dict(steps=2, batch_size=2, progress=False, edit_steps=1, edit_lr=1.0, seed=5)

    def generate(prompts, labels, first_index):
        with BatchNormStatistics(clf) as bn:
            return samplers.sample(gmodel, prompts, samplers.SamplerConfig(**config, first_index=first_index),
                                   loss_fn=guidance_loss(clf, splits, labels, True, bn, 0.1))

    job = GenerationJob(0, [0, 2], {"test": 1}, generate)
    prompts = ["a photo of a cat", "a photo of a dog", "a photo of a car"]
    sets = {}
    for chunk in (2, 6):
        store = SyntheticStore(tmp_path / f"chunk{chunk}")
        synthetic, stats = generate_set(store, [job], lambda ls: [prompts[c] for c in ls], 3, chunk, splits)
        assert stats.generated_images == 6 and len(store.chunk_files(0)) == 6 // chunk
        sets[chunk] = (store.load(0), synthetic)
    (a, set_a), (b, set_b) = sets[2], sets[6]
    assert torch.equal(a.images, b.images) and a.labels.tolist() == [0, 2, 0, 2, 0, 2]
    # the set reads rows in any order from its chunk files, as the classifiers take them
    idx = torch.tensor([5, 0, 3])
    torch.testing.assert_close(set_a.inputs(idx), set_b.inputs(idx))
    torch.testing.assert_close(set_a.inputs(idx), (a.images[idx].float() / 255 - 0.5) / 0.25)


def _peak_rss_growth_mb(work) -> float:
    """How far the process's resident memory peaks above where it stood, during ``work()`` (Linux: the
    peak is reset through /proc/self/clear_refs)."""
    def status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
        raise KeyError(key)

    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory kept by the allocator would hide a rise
    before = status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")
    work()
    return status("VmHWM:") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is reset through Linux's /proc")
def test_peak_memory_does_not_grow_with_the_number_of_images(gmodel, tmp_path):
    """Generation and training from the set, N and 4N images: the peak stays where it was. The tiny
    pipeline's images are enlarged to 256 px, a generator's size, so a set held in memory at the
    generator's resolution (0.8 MB per image as float) would add ≥ 18 MB per N = 8 images."""
    splits = splits_of((3, 32, 32))

    def generate(prompts, labels, first_index):
        config = samplers.SamplerConfig(steps=1, guidance_scale=1.0, batch_size=8, progress=False,
                                        first_index=first_index)
        result = samplers.sample(gmodel, prompts, config)
        result.images = F.interpolate(result.images, size=256, mode="nearest")
        return result

    def generate_and_train(n: int, folder: Path) -> None:
        job = GenerationJob(0, [0, 1], {"n": n}, generate)
        synthetic, _ = generate_set(SyntheticStore(folder), [job], lambda ls: ["a photo of a cat"] * len(ls),
                                    n // 2, 8, splits)
        torch.manual_seed(0)
        model = build_model("mlp", MODELS.parse_params("mlp", {"hidden": 16}, "m"), splits.model_spec())
        train_on_labeled(model, synthetic.inputs, synthetic.labels, None, 1, 8,
                         torch.optim.SGD(model.parameters(), lr=0.01), torch.Generator().manual_seed(0))

    generate_and_train(8, tmp_path / "warm-up")  # first-call allocations (threads, caches) are not the set's
    # The least of three runs each: the allocator's state left by other tests moves single readings by a few
    # MB (up to 8 MB seen within the whole suite); a set held in memory would add >= 18 MB, so the bar sits
    # between the two.
    small = min(_peak_rss_growth_mb(lambda: generate_and_train(8, tmp_path / f"n{i}")) for i in range(3))
    large = min(_peak_rss_growth_mb(lambda: generate_and_train(32, tmp_path / f"4n{i}")) for i in range(3))
    assert large < small + 13, (small, large)


def test_a_set_written_before_chunking_is_still_read(tmp_path):
    """One client_000.safetensors of uint8 RGB at the generator's 32x32: read as one chunk, brought to 8x8 grey."""
    from safetensors.torch import save_file

    from fedguide.methods._synthetic import SyntheticSet

    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    folder = tmp_path / "synthetic"
    folder.mkdir()
    save_file({"images": images, "labels": torch.tensor([2, 0, 2])}, folder / "client_000.safetensors",
              metadata={"recipe": json.dumps({"class_names": ["a", "b", "c"]})})
    store = SyntheticStore.reused(str(tmp_path))
    assert store.clients() == [0] and json.loads(store.metadata(0)["recipe"])["class_names"] == ["a", "b", "c"]
    splits = splits_of((1, 8, 8))
    synthetic = SyntheticSet(splits, store.parts(0))
    torch.testing.assert_close(synthetic.inputs(torch.tensor([2, 0])),
                               to_model_input(splits, from_uint8(images[[2, 0]])))
    assert synthetic.labels.tolist() == [2, 0, 2]


def test_chunk_size_is_whole_sampler_batches():
    assert METHODS.parse_params("sd_gen", {"gen_batch_size": 4}, "method").chunk == 16
    assert METHODS.parse_params("sd_gen", {"gen_batch_size": 4, "chunk_images": 8}, "method").chunk == 8
    with pytest.raises(ConfigError, match="multiple of gen_batch_size.*use e.g. 12"):
        METHODS.parse_params("fedcado", {"gen_batch_size": 4, "chunk_images": 10}, "method")


def test_reused_synthetic_set_trains_another_aggregation_without_generating(tiny_folder, tmp_path, sampler_calls):
    _, _, first = run_tiny(tmp_path, build_config(raw_config(tiny_folder, tmp_path, {})), name="first")
    assert len(sampler_calls) == 2
    raw = raw_config(tiny_folder, tmp_path, {"aggregation": "sd", "reuse_synthetic": str(first)})
    _, rows, _ = run_tiny(tmp_path, build_config(raw), name="second")
    assert len(sampler_calls) == 2 and rows[0]["synthetic_reused"] == 1 and rows[0]["synthetic_images"] == 8
    assert "synthetic_teacher_accuracy" in rows[0]
    raw = raw_config(tiny_folder, tmp_path, {"reuse_synthetic": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="no synthetic set"):
        run_tiny(tmp_path, build_config(raw), name="third")


def test_heterogeneous_client_models_load_and_guide(tiny_folder, tmp_path, sampler_calls):
    models = [{"name": "resnet10", "width": 2}, {"name": "mlp", "hidden": 16}]
    raw = raw_config(tiny_folder, tmp_path, {"client_models": models, "aggregation": "md"})
    _, rows, run_dir = run_tiny(tmp_path, build_config(raw))
    assert len(sampler_calls) == 2 and math.isfinite(rows[0]["accuracy"])
    store = SyntheticStore.of_run(run_dir)
    teachers = [json.loads(store.metadata(c)["recipe"])["teacher"] for c in (0, 1)]
    assert [t["name"] for t in teachers] == ["resnet10", "mlp"] and teachers[0]["width"] == 2
    # the uploads carried two different architectures' whole states (BN buffers included)
    spec = prepare(build_config(raw)).data.splits.model_spec()
    sizes = []
    for t in teachers:
        params = MODELS.parse_params(t["name"], {k: v for k, v in t.items() if k != "name"}, "m")
        sizes.append(WeightLayout.of(build_model(t["name"], params, spec)).numel)
    assert sizes[0] != sizes[1]
    assert rows[0]["bytes_up"] == 4 * (sum(sizes) + 2 * 10) + 2 * 8


def test_bn_loss_alone_needs_batchnorm_layers(tiny_folder, tmp_path):
    raw = raw_config(tiny_folder, tmp_path, {"ce_loss": False, "client_models": ["mlp"]})
    with pytest.raises(ConfigError, match="no BatchNorm layer"):
        run_tiny(tmp_path, build_config(raw))


def test_later_rounds_are_idle(tiny_folder, tmp_path, sampler_calls):
    raw = raw_config(tiny_folder, tmp_path, {}, train={"rounds": 2})
    summary, rows, _ = run_tiny(tmp_path, build_config(raw))
    assert len(rows) == 2 and len(sampler_calls) == 2
    assert rows[1]["accuracy"] == rows[0]["accuracy"] and rows[1]["bytes_up"] == 2 * 8 and rows[1]["bytes_down"] == 0
    assert "generated_images" not in rows[1]


def test_sd_gen_generates_without_classifiers_and_clients_do_not_train(tiny_folder, tmp_path, sampler_calls):
    raw = raw_config(tiny_folder, tmp_path, {"name": "sd_gen"})
    summary, rows, run_dir = run_tiny(tmp_path, build_config(raw))
    assert summary["method"] == "sd_gen" and len(sampler_calls) == 2
    assert rows[0]["loss"] is None  # no client trained: no training loss to report (null, not NaN)
    assert rows[0]["bytes_up"] == 2 * (4 * 10 + 8)  # class masks only
    recipe = json.loads(SyntheticStore.of_run(run_dir).metadata(0)["recipe"])
    assert recipe["method"] == "text-only" and "teacher_weights" not in recipe


def test_prompt_template_is_a_parameter(tiny_folder, tmp_path, monkeypatch):
    assert FedCADOParams().prompt == "a photo of a {}"  # the class name only: no client or domain words
    seen = []
    real = samplers.sample

    def recording(model, prompts, config, *args, **kwargs):
        seen.extend(prompts)
        return real(model, prompts, config, *args, **kwargs)

    monkeypatch.setattr(samplers, "sample", recording)
    raw = raw_config(tiny_folder, tmp_path, {"name": "sd_gen", "prompt": "an image of {}"})
    _, _, run_dir = run_tiny(tmp_path, build_config(raw))
    names = prepare(build_config(raw)).data.splits.class_names
    assert seen and set(seen) <= {f"an image of {n.lower()}" for n in names}
    assert json.loads(SyntheticStore.of_run(run_dir).metadata(0)["recipe"])["prompt"] == "an image of {}"
    with pytest.raises(ConfigError, match="must contain \\{\\} once"):
        METHODS.parse_params("fedcado", {"prompt": "a photo"}, "method")


def test_smoke_config_validates_and_runs_where_the_embedded_weights_exist(tmp_path):
    cfg = load_config(REPO / "configs/fedcado_smoke.yaml")
    prepared = prepare(cfg)
    assert prepared.config.method.name == "fedcado" and prepared.data.num_clients == 2
    assert sum(1 for row in prepared.data.class_counts() for n in row if n > 0) == 2
    for name in ("fedcado_digits.yaml", "fedcado_fmnist.yaml"):
        prepare(load_config(REPO / "configs" / name))
    summary, _, _ = run_tiny(tmp_path, load_config(REPO / "configs/fedcado_smoke.yaml",
                                                   ["method.progress=false", f"guidance.feature_cache={tmp_path}"]))
    # Its wall time (under a minute on two idle cores) is a benchmark figure, not asserted.
    assert summary["rounds"] == 1 and 0.0 <= summary["final_accuracy"] <= 1.0


def test_a_dataset_without_pixel_statistics_is_refused_before_clients_train(tiny_folder, tmp_path):
    raw = raw_config(tiny_folder, tmp_path, {})
    raw["data"] = {"name": "digits"}  # scikit-learn's 8x8 digits declare no pixel statistics
    with pytest.raises(ConfigError, match="pixel statistics"):
        run_tiny(tmp_path, build_config(raw))
    assert not list((tmp_path / "run").glob("client_state/committed/*"))
