"""The embedded guidance models: shipped files, loading offline by default, and their pretraining."""
import hashlib
import json
import re

import numpy as np
import pytest
import torch

from fedguide.config import GuidanceConfig
from fedguide.guidance.embedded import SHIPPED
from fedguide.guidance.model import GuidanceModel


def card_hashes(folder):
    block = re.search(r"## Files \(sha256\)\s*```\n(.*?)```", (folder / "MODEL_CARD.md").read_text(), re.S)
    assert block, "MODEL_CARD.md has no sha256 block"
    return dict(reversed(line.split("  ", 1)) for line in block.group(1).strip().splitlines())


@pytest.fixture(scope="module")
def embedded():
    return GuidanceModel.from_config(GuidanceConfig())


def test_shipped_files_match_the_model_card():
    listed = card_hashes(SHIPPED)
    present = {p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*") if p.is_file() and p.name != "MODEL_CARD.md"}
    assert set(listed) == present
    for name, digest in listed.items():
        assert hashlib.sha256((SHIPPED / name).read_bytes()).hexdigest() == digest, name
    assert sum((SHIPPED / n).stat().st_size for n in present) <= 40 * 2 ** 20


def test_embedded_is_the_default_and_loads_offline(embedded):
    assert GuidanceConfig().model == "embedded"
    m = embedded
    assert m.image_conditioning == "token" and m.context_dim == 384
    assert (m.latent_channels, m.latent_size, m.image_size) == (4, 8, 32)
    assert m.model_id.startswith("embedded@")
    emb = m.encode_text(["a photo of a sneaker", "a photo of a 3"])
    assert emb.tokens.shape == (2, 17, 384) and emb.pooled.shape == (2, 384)
    assert torch.equal(emb.tokens[:, -1], torch.zeros(2, 384))  # the empty image slot
    x = torch.rand(2, 1, 28, 28) * 2 - 1
    assert m.encode_image(x).shape == (2, 4, 8, 8)
    assert m.decode(m.encode_image(x)).shape == (2, 3, 32, 32)


def test_image_token_and_zero_shot(embedded):
    m = embedded
    x = torch.rand(3, 3, 32, 32) * 2 - 1
    emb = m.image_encoder.embed(x)
    assert emb.shape == (3, 384)
    context, labels = m.condition_inputs(m.encode_text(["a"] * 3).tokens, emb)
    assert labels is None and context.shape == (3, 17, 384)
    torch.testing.assert_close(context[:, -1].norm(dim=-1), torch.full((3,), m.image_token_scale))
    scores = m.image_encoder.zero_shot(x, ["a photo of a bag", "a photo of a trouser"])
    assert scores.shape == (3, 2) and scores.abs().max() <= 1 + 1e-5


def test_pretrain_writes_a_loadable_sd_layout(tmp_path):
    from fedguide.guidance.embedded.pretrain.data import load_pool
    from fedguide.guidance.embedded.pretrain.run import pretrain

    settings = small_settings(max_per_class=3, clip_augmented_views=(0, 2), clip_image_size=48, unet_steps=2)
    pool = load_pool(settings)
    assert len(pool.images) == 60 and pool.images.shape[1:] == (3, 32, 32)
    assert pool.images.min() >= -1 and pool.images.max() <= 1 and len(pool.prompts) == 20
    out = pretrain(tmp_path / "models", settings, quiet=True, threads=1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    for name, digest in card_hashes(out).items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    m = GuidanceModel.from_config(GuidanceConfig(model=str(out)))
    assert m.image_conditioning == "token" and m.unet.config.block_out_channels == [16, 16, 16, 16]
    assert m.unet.dtype == torch.float32  # stored in fp16, cast to the run's dtype
    # The projection is loaded with the backbone input size it was trained at.
    assert json.loads((out / "image_encoder" / "config.json").read_text())["image_size"] == 48
    assert m.image_encoder.backbone.image_size == 48


def test_the_pool_is_the_runs_public_slice():
    """A run with data.public_fraction 0.1 (public_seed 0) never gives a client an image the models saw."""
    from fedguide.config import build_config
    from fedguide.fl.setup import prepare
    from fedguide.guidance.embedded.pretrain.data import load_pool
    from fedguide.guidance.embedded.pretrain.settings import PretrainSettings

    prepared = prepare(build_config({"data": {"name": "digits_domains", "public_fraction": 0.1},
                                     "partition": {"name": "iid"}, "clients": {"num": 3, "per_round": 3}}))
    public = prepared.data.public_indices
    pool = load_pool(PretrainSettings())
    digits = next(s for s in pool.slices if s["dataset"] == "digits_domains")
    assert digits["indices_sha256"] == hashlib.sha256(np.asarray(public, np.int64).tobytes()).hexdigest()
    clients = np.concatenate([c for c in prepared.data.client_indices])
    assert not np.intersect1d(clients, public).size


def small_settings(**changes):
    from fedguide.guidance.embedded.pretrain.settings import PretrainSettings

    return PretrainSettings(**{**dict(max_per_class=2, clip_epochs=1, clip_batch=16, clip_augmented_views=(0, 1),
                                      vae_steps=2, vae_batch=8, unet_steps=4, unet_batch=8,
                                      unet_channels=(16, 16, 16, 16), checkpoint_every=2, clip_image_size=32), **changes})


@pytest.fixture(scope="module")
def small_pretrained(tmp_path_factory):
    """One finished pretraining at small_settings(), read (never written) by the tests that compare with one or
    reuse its parts: the same folder each of them would train for itself."""
    from fedguide.guidance.embedded.pretrain import run as pt

    return pt.pretrain(tmp_path_factory.mktemp("pretrained") / "first", small_settings(), quiet=True, threads=1)


def kill_before_writing(pt, monkeypatch, out, settings):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pt, "write_card", killed)
    with pytest.raises(KeyboardInterrupt):
        pt.pretrain(out, settings, quiet=True, threads=1)
    monkeypatch.undo()
    return out.parent / f".{out.name}.partial"


def test_a_killed_pretraining_resumes_to_the_same_models(tmp_path, monkeypatch, small_pretrained):
    from safetensors.torch import load_file

    from fedguide.guidance.embedded.pretrain import run as pt

    settings = small_settings()
    clean = small_pretrained  # uninterrupted

    partial = kill_before_writing(pt, monkeypatch, tmp_path / "resumed", settings)
    assert {"clip.safetensors", "vae.safetensors", "unet.safetensors"} <= {p.name for p in partial.iterdir()}
    calls = []
    for stage in ("train_clip", "train_vae"):
        monkeypatch.setattr(pt, stage, lambda *a, stage=stage, **k: calls.append(stage))
    resumed = pt.pretrain(tmp_path / "resumed", settings, quiet=True, threads=1)
    assert calls == [] and not partial.exists()
    log = [json.loads(line) for line in (resumed / "train_log.jsonl").read_text().splitlines()]
    assert {"stage": "unet", "resumed_at": 2} == {k: log_row[k] for log_row in log if "resumed_at" in log_row
                                                    for k in ("stage", "resumed_at")}
    for part in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        a, b = load_file(clean / part), load_file(resumed / part)
        assert all(torch.equal(a[k], b[k]) for k in a), part
    card = (resumed / "MODEL_CARD.md").read_text()
    assert "train_zero_shot=" in card and "reused=True" in card  # the killed run's lines stay beside the resumed run's


def test_mixed_batches_hold_each_datasets_share_and_cycle_the_small_one():
    from fedguide.guidance.embedded.pretrain.batches import MixedStepBatches

    groups = torch.tensor([0] * 600 + [1] * 43)
    draw = MixedStepBatches(groups, (0.6, 0.4), 20, seed=3)
    again = MixedStepBatches(groups, (0.6, 0.4), 20, seed=3)
    batches = [draw(step) for step in range(30)]
    assert all(torch.equal(b, again(step)) for step, b in enumerate(batches))  # a pure function of the step
    for b in batches:
        assert len(b) == 20 and int((groups[b] == 1).sum()) == 8 and len(set(b.tolist())) == 20
    small = torch.cat(batches)[groups[torch.cat(batches)] == 1]
    assert set(small.tolist()) == set(range(600, 643))  # 240 draws from 43 images: every one revisited
    uneven = MixedStepBatches(groups, (0.55, 0.45), 7, seed=0)(0)
    assert len(uneven) == 7 and int((groups[uneven] == 1).sum()) == 3


@pytest.mark.parametrize("share", [(1.0,), (0.7, 0.4), (1.2, -0.2)])
def test_a_bad_dataset_share_is_refused_before_training(share):
    from fedguide.guidance.embedded.pretrain.settings import PretrainSettings

    with pytest.raises(ValueError, match="unet_dataset_share needs one non-negative share per dataset"):
        PretrainSettings(unet_dataset_share=share)


def test_a_unet_checkpoint_is_not_continued_on_another_clip(tmp_path, monkeypatch):
    """The UNet learns from the CLIP stage's image tokens: retraining CLIP restarts the UNet too."""
    from fedguide.guidance.embedded.pretrain import run as pt

    kill_before_writing(pt, monkeypatch, tmp_path / "models", small_settings())
    out = pt.pretrain(tmp_path / "models", small_settings(clip_augmented_views=(0, 2)), quiet=True, threads=1)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert not [row for row in log if "resumed_at" in row]
    assert [row["stage"] for row in log if row.get("reused")] == ["vae"]


@pytest.mark.parametrize("views", [(3,), (0, -1)])
def test_bad_augmented_view_counts_are_refused(views):
    from fedguide.guidance.embedded.pretrain.settings import PretrainSettings

    with pytest.raises(ValueError, match="clip_augmented_views needs one count >= 0 per dataset"):
        PretrainSettings(clip_augmented_views=views)


def test_a_bad_backbone_input_size_is_refused_by_the_cli(tmp_path, capsys):
    from fedguide.cli import main

    assert main(["pretrain-guidance", "--out", str(tmp_path / "m"), "--clip-image-size", "8"]) != 0
    assert "clip_image_size must be within [32, 512] px" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_finished_folders_vae_is_reused_when_its_settings_match(tmp_path, monkeypatch, small_pretrained):
    from fedguide.guidance.embedded.pretrain import run as pt

    first = small_pretrained
    monkeypatch.setattr(pt, "train_vae", lambda *a, **k: pytest.fail("the VAE was trained instead of reused"))
    second = pt.pretrain(tmp_path / "second", small_settings(clip_augmented_views=(0, 2)), quiet=True, threads=1,
                         vae_source=first)
    for name in ("vae/diffusion_pytorch_model.safetensors", "vae/config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    log = [json.loads(line) for line in (second / "train_log.jsonl").read_text().splitlines()]
    vae_rows = [row for row in log if row["stage"] == "vae"]
    # The card still shows how the VAE was trained, and where it came from.
    assert any("scaling_factor" in row for row in vae_rows) and {"reused_from": "first"}.items() <= vae_rows[-1].items()
    assert "reused_from=first" in (second / "MODEL_CARD.md").read_text()


def test_a_vae_trained_with_other_settings_is_refused_before_anything_is_written(tmp_path, capsys):
    from fedguide.cli import main
    from fedguide.guidance.embedded.pretrain import run as pt

    first = pt.pretrain(tmp_path / "first", small_settings(vae_steps=1), quiet=True, threads=1)
    with pytest.raises(ValueError, match=r"vae_steps: 1 there, 2 here.*drop --reuse-vae"):
        pt.pretrain(tmp_path / "second", small_settings(), quiet=True, threads=1, vae_source=first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first"]
    assert main(["pretrain-guidance", "--out", str(tmp_path / "third"), "--reuse-vae", str(tmp_path)]) != 0
    assert "not a folder written by fedguide pretrain-guidance" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first"]


def test_a_finished_folders_clip_is_reused_with_the_same_image_tokens(tmp_path, monkeypatch, small_pretrained):
    from fedguide.guidance.embedded.pretrain import run as pt

    first = small_pretrained
    monkeypatch.setattr(pt, "train_clip", lambda *a, **k: pytest.fail("the mini-CLIP was trained instead of reused"))
    second = pt.pretrain(tmp_path / "second", small_settings(), quiet=True, threads=1, vae_source=first,
                         clip_source=first)
    # The UNet learns from the pool's image tokens: the same tokens and latents give the same UNet.
    for name in ("image_encoder/projection.safetensors", "unet/diffusion_pytorch_model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    log = [json.loads(line) for line in (second / "train_log.jsonl").read_text().splitlines()]
    clip_rows = [row for row in log if row["stage"] == "clip"]
    assert any("train_zero_shot" in row for row in clip_rows) and clip_rows[-1]["reused_from"] == "first"


def test_a_clip_trained_with_other_settings_is_refused_before_anything_is_written(tmp_path, small_pretrained):
    from fedguide.guidance.embedded.pretrain import run as pt

    first = small_pretrained  # clip_epochs 1
    before = sorted(str(p.relative_to(first)) for p in first.rglob("*"))
    with pytest.raises(ValueError, match=r"mini-CLIP .*clip_epochs: 1 there, 2 here.*drop --reuse-clip"):
        pt.pretrain(tmp_path / "second", small_settings(clip_epochs=2), quiet=True, threads=1, clip_source=first)
    assert not list(tmp_path.iterdir())
    assert sorted(str(p.relative_to(first)) for p in first.rglob("*")) == before
