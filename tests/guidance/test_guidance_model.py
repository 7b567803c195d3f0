"""Loading SD-layout pipelines, and the GuidanceModel's encoders, noising, conditioning and hooks."""
import shutil

import pytest
import torch

from fedguide.guidance.condition import ConditionMap, inject
from fedguide.config import GuidanceConfig
from fedguide.guidance.hooks import capture, decoder_layer, layer_order, unet_features
from fedguide.guidance.model import GuidanceModel
from fedguide.guidance.sources import GuidanceLoadError, fingerprint
from fedguide.registry import ConfigError


def images(n, seed=0, size=32):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_round_trip_loads_every_component_frozen(sd_model, tiny_sd):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    m = sd_model
    assert isinstance(m.unet, UNet2DConditionModel) and isinstance(m.vae, AutoencoderKL)
    assert m.image_encoder is not None and not m.is_unclip
    assert m.dtype == torch.float32 and m.device.type == "cpu"  # fp32 on a CPU
    for module in (m.unet, m.vae, m.text_encoder, m.image_encoder.vision):
        assert not module.training and not any(p.requires_grad for p in module.parameters())
    # The saved weights are what was loaded.
    again = UNet2DConditionModel.from_pretrained(tiny_sd / "unet")
    for (k, a), b in zip(m.unet.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k


def test_loaded_weights_sit_in_aligned_memory_as_on_a_device(sd_model):
    """oneDNN may round differently on weights 8 bytes off a 64-byte boundary (from_pretrained's views into the
    safetensors file); a loaded pipeline's CPU weights are all aligned, as the simulated device's copies are."""
    from fedguide.guidance.components import ALIGNMENT, align_weights

    m = sd_model
    for module in (m.unet, m.vae, m.text_encoder, m.image_encoder.vision):
        assert all(t.data_ptr() % ALIGNMENT == 0 for t in (*module.parameters(), *module.buffers()))
    # an unaligned view is copied (same values, aligned); an aligned weight keeps its memory
    storage = torch.arange(34, dtype=torch.float32)
    layer = torch.nn.Linear(4, 4)
    layer.weight.data = storage[2:18].view(4, 4)  # 8 bytes in
    layer.bias.data = storage[16:20]  # 64 bytes in
    kept = layer.bias.data_ptr()
    assert layer.weight.data_ptr() % ALIGNMENT and storage.data_ptr() % ALIGNMENT == 0
    encoder = type("Encoder", (), {})()  # an encoder wrapper holding its modules, as ClipImageEncoder does
    encoder.vision = layer
    align_weights(encoder)
    assert layer.weight.data_ptr() % ALIGNMENT == 0
    assert torch.equal(layer.weight, torch.arange(2, 18, dtype=torch.float32).view(4, 4))
    assert layer.bias.data_ptr() == kept


def test_fingerprint_follows_the_weights(tiny_sd, tmp_path):
    copy = shutil.copytree(tiny_sd, tmp_path / "copy")
    assert fingerprint(copy, "x") == fingerprint(tiny_sd, "x")
    weights = copy / "unet" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert fingerprint(copy, "x") != fingerprint(tiny_sd, "x")


def test_offline_hub_id_fails_fast_naming_a_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(GuidanceLoadError, match="guidance.model=DIR"):
        GuidanceModel.from_config(GuidanceConfig(model="runwayml/stable-diffusion-v1-5"))


def test_bad_sources_name_the_fix(tiny_sd, tmp_path):
    with pytest.raises(GuidanceLoadError, match="needs a guidance model"):
        GuidanceModel.from_config(GuidanceConfig(model=None))
    with pytest.raises(GuidanceLoadError, match="neither a folder nor a hub id"):
        GuidanceModel.from_config(GuidanceConfig(model="./missing/folder"))
    broken = shutil.copytree(tiny_sd, tmp_path / "broken")
    shutil.rmtree(broken / "unet")
    with pytest.raises(GuidanceLoadError, match="no unet/ folder"):
        GuidanceModel.from_config(GuidanceConfig(model=str(broken)))


def test_cuda_without_a_gpu_names_the_fix(tiny_sd, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a machine with a GPU
    with pytest.raises(GuidanceLoadError, match="no CUDA.*guidance.device=cpu"):
        GuidanceModel.from_config(GuidanceConfig(model=str(tiny_sd), device="cuda"))


def test_image_encoder_none_and_override(tiny_sd, tiny_clip):
    assert GuidanceModel.from_config(GuidanceConfig(model=str(tiny_sd), image_encoder="none")).image_encoder is None
    m = GuidanceModel.from_config(GuidanceConfig(model=str(tiny_sd), image_encoder=str(tiny_clip)))
    assert m.image_encoder.can_zero_shot


def test_encode_text_shapes_and_cache(sd_model):
    emb = sd_model.encode_text(["a photo of a cat", "a photo of a dog"])
    assert emb.tokens.shape == (2, 16, sd_model.context_dim) and emb.pooled.shape == (2, sd_model.context_dim)
    assert emb.mask[0].sum() < 16  # padded
    assert sd_model.encode_text(["a photo of a cat", "a photo of a dog"]) is emb
    assert not torch.equal(emb.tokens[0], emb.tokens[1])


def test_encode_image_scales_latents(sd_model):
    x = images(2)
    raw = sd_model.vae.encode(x).latent_dist.mean
    lat = sd_model.encode_image(x)
    assert lat.shape == (2, 4, 8, 8)
    torch.testing.assert_close(lat, raw * sd_model.vae.config.scaling_factor)
    # Grey-scale inputs of another size are resized and repeated to RGB.
    assert sd_model.encode_image(images(2, size=28)[:, :1]).shape == (2, 4, 8, 8)
    with pytest.raises(ConfigError, match=r"\[B, 3, H, W\]"):
        sd_model.encode_image(torch.zeros(2, 5, 32, 32))


def test_add_noise_and_x0_invert_each_other(sd_model):
    lat = sd_model.encode_image(images(3))
    t = 150
    noisy, noise = sd_model.add_noise(lat, t, generator=torch.Generator().manual_seed(0))
    a = sd_model.noise_scheduler.alphas_cumprod[t]
    torch.testing.assert_close(noisy, a.sqrt() * lat + (1 - a).sqrt() * noise)
    torch.testing.assert_close(sd_model.predict_x0(noisy, t, noise), lat, atol=1e-5, rtol=1e-5)
    again, _ = sd_model.add_noise(lat, t, generator=torch.Generator().manual_seed(0))
    assert torch.equal(noisy, again)


def test_unclip_image_condition(unclip_model, sd_model):
    emb = unclip_model.image_encoder.embed(images(2))
    labels = unclip_model.image_condition(emb)
    assert labels.shape == (2, 2 * emb.shape[1])
    torch.testing.assert_close(labels[:, : emb.shape[1]], emb)  # noise level 0: the embedding itself
    noisy = unclip_model.image_condition(emb, noise_level=500, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(noisy[:, : emb.shape[1]], emb)
    lat = unclip_model.encode_image(images(2))
    out = unclip_model.eps(lat, 10, unclip_model.encode_text(["a", "b"]).tokens, class_labels=labels)
    assert out.shape == lat.shape
    with pytest.raises(ConfigError, match="unCLIP"):
        sd_model.image_condition(emb)


def test_condition_map_modes():
    cmap = ConditionMap(8, 32, seed=3)
    assert torch.equal(cmap.weight, ConditionMap(8, 32, seed=3).weight)
    assert not torch.equal(cmap.weight, ConditionMap(8, 32, seed=4).weight)
    ctx = torch.randn(2, 5, 32)
    cond = torch.randn(2, 8)
    appended = inject(ctx, cond, "append", cmap)
    assert appended.shape == (2, 6, 32) and torch.equal(appended[:, :5], ctx)
    torch.testing.assert_close(appended[:, 5], cond @ cmap.weight.T)
    torch.testing.assert_close(inject(ctx, cond, "add", cmap), ctx + (cond @ cmap.weight.T)[:, None])
    assert inject(ctx, cond, "none", cmap) is ctx
    with pytest.raises(ConfigError):
        inject(ctx, torch.randn(2, 7), "append", cmap)


def test_hook_shapes_per_block(sd_model):
    lat = sd_model.encode_image(images(2))
    ctx = sd_model.encode_text(["a", "b"]).tokens
    layers = ["down.0", "down.3", "mid", "up.0.pre", "up.0", "up.1", "up.2", "up.3"]
    with torch.no_grad():
        maps = unet_features(sd_model, lat, 150, ctx, layers)
    shapes = {k: tuple(v.shape) for k, v in maps.items()}
    assert list(maps) == layers
    # 8x8 latents; down blocks 0-2 downsample; up blocks 0-2 upsample (pre = before the upsampler).
    assert shapes == {"down.0": (2, 32, 4, 4), "down.3": (2, 64, 1, 1), "mid": (2, 64, 1, 1),
                      "up.0.pre": (2, 64, 1, 1), "up.0": (2, 64, 2, 2), "up.1": (2, 64, 4, 4),
                      "up.2": (2, 32, 8, 8), "up.3": (2, 32, 8, 8)}
    assert decoder_layer(1) == "up.0" and decoder_layer(4) == "up.3"


def test_hooks_match_the_full_forward_and_stop_early(sd_model):
    lat = sd_model.encode_image(images(2))
    ctx = sd_model.encode_text(["a", "b"]).tokens
    calls = []
    handle = sd_model.unet.up_blocks[3].register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            early = unet_features(sd_model, lat, 150, ctx, ["mid"])
            assert calls == []  # the decoder never ran
            with capture(sd_model.unet, ["mid", "up.3"], stop_early=False) as full:
                sd_model.eps(lat, 150, ctx)
    finally:
        handle.remove()
    assert calls == [1]
    torch.testing.assert_close(early["mid"], full["mid"])
    assert not sd_model.unet._forward_hooks and not sd_model.unet.mid_block._forward_hooks  # hooks removed


def test_hook_names_are_validated(sd_model):
    with pytest.raises(ConfigError, match="unknown UNet layer"):
        layer_order(sd_model.unet, ["decoder.1"])
    with pytest.raises(ConfigError, match="4 up blocks"):
        layer_order(sd_model.unet, ["up.4"])
    with pytest.raises(ConfigError, match="no upsampler"):
        layer_order(sd_model.unet, ["up.3.pre"])
    assert layer_order(sd_model.unet, ["up.1", "mid", "down.2", "up.1.pre"]) == ["down.2", "mid", "up.1.pre", "up.1"]


def test_zero_shot_matches_clip_logits(tiny_clip):
    from transformers import CLIPModel

    from fedguide.guidance.image_encoder import load_image_encoder

    enc = load_image_encoder(str(tiny_clip), None, torch.device("cpu"), torch.float32)
    x = images(3)
    prompts = ["a photo of a cat", "a photo of a dog"]
    full = CLIPModel.from_pretrained(tiny_clip)
    tok = enc.tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = full(input_ids=tok.input_ids, attention_mask=tok.attention_mask, pixel_values=enc.preprocess(x))
    torch.testing.assert_close(enc.zero_shot(x, prompts), ref.logits_per_image / full.logit_scale.exp())


def test_vision_only_encoder_refuses_zero_shot(sd_model):
    assert sd_model.image_encoder.embed(images(2)).shape == (2, sd_model.image_encoder.dim)
    with pytest.raises(ConfigError, match="no aligned text tower"):
        sd_model.image_encoder.zero_shot(images(2), ["a"])
