"""Representation alignment (REPA) in the UNet stage of ``fedguide pretrain-guidance``, and the partial
folder's stage files, which are never unpickled."""
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file

from fedguide.config import GuidanceConfig
from fedguide.guidance.model import GuidanceModel

from tests.guidance.test_embedded import card_hashes, kill_before_writing, small_settings

# At 64 px the backbone's feature map is 2 x 2: pooled to mid's 1 x 1 grid, resized up to up.1's 4 x 4.
REPA = dict(repa_weight=0.5, repa_layers=("mid", "up.1"), repa_target="effnet", clip_image_size=64)


# A large learning rate, so that four steps show in the fp16 weights.
REPA_RUN = dict(REPA, unet_lr=0.1)


@pytest.fixture(scope="module")
def repa_pretrained(tmp_path_factory):
    """One finished REPA pretraining at REPA_RUN, read (never written) by the tests that compare with one."""
    from fedguide.guidance.embedded.pretrain.run import pretrain

    return pretrain(tmp_path_factory.mktemp("repa") / "aligned", small_settings(**REPA_RUN), quiet=True, threads=1)


def test_a_repa_run_writes_the_same_layout_with_an_ordinary_unet(tmp_path, repa_pretrained):
    from fedguide.guidance.embedded.pretrain.run import pretrain

    plain = pretrain(tmp_path / "plain", small_settings(clip_image_size=64, unet_lr=0.1), quiet=True, threads=1)
    aligned = repa_pretrained
    assert set(card_hashes(plain)) == set(card_hashes(aligned))
    unet = "unet/diffusion_pytorch_model.safetensors"
    a, b = load_file(plain / unet), load_file(aligned / unet)
    assert a.keys() == b.keys()  # no projection head in the written UNet
    assert not all(torch.equal(a[k], b[k]) for k in a if k.startswith("up_blocks.1."))  # but trained with it
    assert (plain / "unet" / "config.json").read_text() == (aligned / "unet" / "config.json").read_text()
    m = GuidanceModel.from_config(GuidanceConfig(model=str(aligned)))
    assert m.unet.config.block_out_channels == [16, 16, 16, 16]
    card = (aligned / "MODEL_CARD.md").read_text()
    assert '"repa_weight": 0.5' in card and '"repa_target": "effnet"' in card
    assert "## Representation alignment (REPA)" in card and "(a per-position MLP) of blocks mid, up.1" in card
    assert "Representation alignment" not in (plain / "MODEL_CARD.md").read_text()
    log = [json.loads(line) for line in (aligned / "train_log.jsonl").read_text().splitlines()]
    assert "align" in [row for row in log if row["stage"] == "unet"][-1]


def test_the_alignment_loss_decreases(tmp_path):
    """A few steps on one batch: the heads and the UNet learn to match the targets (the mini-CLIP
    image tokens here, so no backbone is needed)."""
    from fedguide.guidance.embedded.pretrain.repa import Alignment
    from fedguide.guidance.embedded.pretrain.unet_stage import Inputs, _loss, _start, noise_scheduler

    s = small_settings(repa_weight=1.0, repa_layers=("up.1",), repa_target="clip", unet_lr=0.1, p_drop_image=0.0)
    n, dim = 8, 32
    torch.manual_seed(0)
    image_tokens = torch.nn.functional.normalize(torch.randn(n, dim), dim=-1) * 4
    inputs = Inputs(torch.arange(n) % 2, torch.randn(n, 4, 8, 8), torch.full((n, 4, 8, 8), 0.1),
                    torch.randn(2, 5, dim), torch.randn(1, 5, dim), image_tokens)
    training = _start(s, dim)
    align = Alignment(training.heads, image_tokens[:, :, None, None], s.repa_layers)
    ddpm, idx = noise_scheduler(), torch.arange(n)
    losses = []
    for _ in range(25):
        terms = _loss(training.unet, ddpm, inputs, idx, training.gen, s, align)
        training.step(terms["loss"] + s.repa_weight * terms["align"])
        losses.append(terms["align"].item())
    assert losses[0] > 0.95 and sum(losses[-5:]) / 5 < 0.85 * losses[0], losses


def test_a_linear_head_is_one_convolution_the_features_must_match_linearly(tmp_path):
    """repa_head: linear projects each block by a single 1x1 convolution: the cosine term is then that
    of a linear map of the hidden state, computed here by hand."""
    from fedguide.guidance.embedded.pretrain.repa import Alignment, build_heads

    s = small_settings(repa_weight=1.0, repa_layers=("up.1", "mid"), repa_target="clip", repa_head="linear")
    heads = build_heads(s, context_dim=3)
    for name in ("up.1", "mid"):
        head = heads.heads[name.replace(".", "_")]
        assert isinstance(head, torch.nn.Conv2d) and head.kernel_size == (1, 1) and head.out_channels == 3
    mlp = build_heads(small_settings(repa_weight=1.0, repa_layers=("up.1",), repa_target="clip"), context_dim=3)
    assert isinstance(mlp.heads["up_1"], torch.nn.Sequential) and len(mlp.heads["up_1"]) == 5

    torch.manual_seed(1)
    target = torch.randn(2, 3)
    hidden = {"up.1": torch.randn(2, 16, 2, 2), "mid": torch.randn(2, 16, 1, 1)}
    loss = Alignment(heads, target[:, :, None, None], s.repa_layers).loss(hidden, torch.arange(2))
    expected = []
    for name, h in hidden.items():
        conv = heads.heads[name.replace(".", "_")]
        w, b = conv.weight[:, :, 0, 0], conv.bias
        proj = torch.einsum("oc,bchw->bohw", w, h) + b[None, :, None, None]  # the linear map, position by position
        cos = (proj * target[:, :, None, None]).sum(1) / (proj.norm(dim=1) * target.norm(dim=1)[:, None, None])
        expected.append(1 - cos.mean())
    assert torch.allclose(loss, torch.stack(expected).mean(), atol=1e-6)


def test_a_killed_repa_run_resumes_to_the_same_files(tmp_path, monkeypatch, repa_pretrained):
    from fedguide.guidance.embedded.pretrain import run as pt

    settings = small_settings(**REPA_RUN)
    clean = repa_pretrained  # uninterrupted
    partial = kill_before_writing(pt, monkeypatch, tmp_path / "resumed", settings)
    assert "heads" in json.dumps(_metadata(partial / "unet.safetensors"))  # the heads are checkpointed
    assert (partial / "repa_targets.safetensors").is_file()
    # The targets are read back, not computed again: the backbone is not run on the resumed start.
    from fedguide.guidance.embedded.pretrain import repa
    monkeypatch.setattr(repa, "ImageBackbone", lambda *a, **k: pytest.fail("the alignment targets were recomputed"))
    resumed = pt.pretrain(tmp_path / "resumed", settings, quiet=True, threads=1)
    assert not partial.exists()  # removed with everything else once the models are written
    log = [json.loads(line) for line in (resumed / "train_log.jsonl").read_text().splitlines()]
    assert [row["resumed_at"] for row in log if "resumed_at" in row] == [2]
    for name in card_hashes(clean):
        if name.endswith(".safetensors"):
            assert (clean / name).read_bytes() == (resumed / name).read_bytes(), name


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_a_checkpoint_without_alignment_is_not_continued_with_it(tmp_path, monkeypatch):
    from fedguide.guidance.embedded.pretrain import run as pt

    kill_before_writing(pt, monkeypatch, tmp_path / "models", small_settings(clip_image_size=64))
    out = pt.pretrain(tmp_path / "models", small_settings(**REPA), quiet=True, threads=1)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert not [row for row in log if "resumed_at" in row]
    assert {row["stage"] for row in log if row.get("reused")} == {"clip", "vae"}


@pytest.mark.parametrize("change, message", [
    (dict(repa_weight=-1.0), "repa_weight must be a finite number >= 0"),
    (dict(repa_weight=float("nan")), "repa_weight must be a finite number >= 0"),
    (dict(repa_target="dino"), "repa_target must be one of"),
    (dict(repa_head="attention"), "repa_head must be one of"),
    (dict(repa_layers=("up.4",)), "repa_layers needs UNet blocks among mid, down.0..down.3, up.0..up.3"),
    (dict(repa_layers=("decoder",)), "repa_layers needs UNet blocks"),
    (dict(repa_layers=()), "repa_layers needs UNet blocks"),
    (dict(unet_channels=(64, 120, 128)), "unet_channels needs 2 to 4 levels of positive multiples of 16"),
    (dict(unet_channels=(64, 128, 128, 128, 128)), "unet_channels needs 2 to 4 levels"),
])
def test_bad_alignment_settings_are_refused(change, message):
    from fedguide.guidance.embedded.pretrain.settings import PretrainSettings

    with pytest.raises(ValueError, match=message):
        PretrainSettings(**change)


def test_the_cli_passes_the_alignment_options_and_refuses_bad_ones(tmp_path, capsys, monkeypatch):
    from fedguide.cli import main
    from fedguide.guidance.embedded.pretrain import run as pt

    seen = {}
    monkeypatch.setattr(pt, "pretrain", lambda out, settings, **k: seen.setdefault("s", settings) and out)
    assert main(["pretrain-guidance", "--out", str(tmp_path / "m"), "--repa-weight", "0.5", "--repa-layers",
                 "mid, up.1", "--repa-target", "clip", "--repa-head", "linear"]) == 0
    assert ((seen["s"].repa_weight, seen["s"].repa_layers, seen["s"].repa_target, seen["s"].repa_head)
            == (0.5, ("mid", "up.1"), "clip", "linear"))
    seen.clear()
    assert main(["pretrain-guidance", "--out", str(tmp_path / "m"), "--unet-channels", "96,192,192"]) == 0
    assert seen["s"].unet_channels == (96, 192, 192)
    assert main(["pretrain-guidance", "--out", str(tmp_path / "m"), "--repa-layers", "up.7"]) != 0
    assert "repa_layers needs UNet blocks" in capsys.readouterr().err


class _Payload:
    """Unpickling this makes a folder: proof that the file was executed."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.mkdir, (self.marker,)


def test_a_pickled_object_in_the_partial_folder_is_refused_not_run(tmp_path):
    from fedguide.guidance.embedded.pretrain.partial import load_stage
    from fedguide.guidance.embedded.pretrain.run import pretrain

    marker = tmp_path / "executed"
    partial = tmp_path / ".models.partial"
    partial.mkdir()
    for name in ("clip.safetensors", "clip.pt", "unet.pt"):
        (partial / name).write_bytes(pickle.dumps({"key": {}, "payload": _Payload(marker)}))
    torch.save({"key": {}, "payload": _Payload(marker)}, partial / "vae.safetensors")
    for name in ("clip.safetensors", "vae.safetensors"):
        with pytest.raises(ValueError, match="is not a stage file written by fedguide pretrain-guidance.*not loaded"):
            load_stage(partial / name, {})
    with pytest.raises(ValueError, match="clip.safetensors is not a stage file"):
        pretrain(tmp_path / "models", small_settings(), quiet=True, threads=1)
    assert not marker.exists() and not (tmp_path / "models").exists()
    # Files of the old pickle format are never read: the run trains the stages again.
    for name in ("clip.safetensors", "vae.safetensors"):
        (partial / name).unlink()
    pretrain(tmp_path / "models", small_settings(), quiet=True, threads=1)
    assert not marker.exists() and not partial.exists()
