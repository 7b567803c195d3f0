"""DiffusionFeatures: noised latents -> hooked UNet -> fused vectors -> the feature cache."""
import numpy as np
import pytest
import torch

from fedguide.guidance.condition import ConditionMap
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec, sample_noise
from fedguide.guidance.fused import FusedFeatures, PooledPCAFeatures
from fedguide.guidance.hooks import unet_features
from fedguide.guidance.store import FeatureCacheError, FeatureStore
from fedguide.registry import ConfigError

LAYERS = ("up.1", "up.2", "up.3")


def images(n, seed=0):
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def prompts(n):
    return [f"a photo of a {'cat' if i % 2 else 'dog'}" for i in range(n)]


class UNetCalls:
    def __init__(self, unet):
        self.n = 0
        self.handle = unet.register_forward_pre_hook(lambda *a: setattr(self, "n", self.n + 1))


@pytest.fixture
def fused(sd_model):
    feats = DiffusionFeatures(sd_model, FeatureSpec(LAYERS, t=150), FusedFeatures(LAYERS, d=32, samples_per_image=16))
    return feats.fit(images(12, seed=5), prompts(12), np.arange(100, 112), batch_size=6)


def test_noise_depends_on_the_sample_index_only():
    a = sample_noise([3, 7, 9], (4, 2, 2), seed=1)
    b = sample_noise([9, 3], (4, 2, 2), seed=1)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a, sample_noise([3, 7, 9], (4, 2, 2), seed=2))


def test_maps_at_t_noise_the_latents(sd_model):
    x, p = images(2), prompts(2)
    feats = DiffusionFeatures(sd_model, FeatureSpec(("mid",), t=150, noise_seed=4))
    lat = sd_model.encode_image(x)
    noisy, _ = sd_model.add_noise(lat, 150, noise=sample_noise([0, 1], lat.shape[1:], 4))
    with torch.no_grad():
        want = unet_features(sd_model, noisy, 150, sd_model.encode_text(tuple(p)).tokens, ["mid"])
    torch.testing.assert_close(feats.maps(x, p, [0, 1])["mid"], want["mid"])
    clean = DiffusionFeatures(sd_model, FeatureSpec(("mid",), t=0)).maps(x, p, [0, 1])
    with torch.no_grad():
        torch.testing.assert_close(clean["mid"], unet_features(sd_model, lat, 0, sd_model.encode_text(tuple(p)).tokens, ["mid"])["mid"])


def test_fused_vectors_do_not_depend_on_batch_mates(fused):
    x, p = images(4, seed=1), prompts(4)
    together = fused(x, p, [0, 1, 2, 3])
    alone = torch.cat([fused(x[i:i + 1], p[i:i + 1], [i]) for i in range(4)])
    assert together.shape == (4, 32)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_the_prompt_and_the_condition_change_the_features(fused, sd_model):
    x = images(2, seed=1)
    assert not torch.allclose(fused(x, ["a photo of a cat"] * 2, [0, 1]), fused(x, ["a photo of a dog"] * 2, [0, 1]))
    cmap = ConditionMap(8, sd_model.context_dim, seed=0)
    cond = DiffusionFeatures(sd_model, FeatureSpec(LAYERS, t=150, condition_mode="append"), fused.recipe, cmap)
    c = torch.randn(2, 8)
    assert not torch.allclose(cond(x, prompts(2), [0, 1], condition=c), fused(x, prompts(2), [0, 1]))
    with pytest.raises(ConfigError, match="needs a condition map"):
        DiffusionFeatures(sd_model, FeatureSpec(LAYERS, condition_mode="add"), fused.recipe)
    with pytest.raises(ConfigError, match="outside"):
        DiffusionFeatures(sd_model, FeatureSpec(LAYERS, t=5000))


def test_fit_or_load_fits_once_then_reuses(sd_model, tmp_path):
    path = tmp_path / "basis.safetensors"
    asked = []

    def sample():
        asked.append(1)
        return images(8, seed=3), prompts(8), np.arange(8)

    first = DiffusionFeatures(sd_model, FeatureSpec(LAYERS), FusedFeatures(LAYERS, d=32, samples_per_image=16))
    first.fit_or_load(path, sample)
    second = DiffusionFeatures(sd_model, FeatureSpec(LAYERS), FusedFeatures(LAYERS, d=32, samples_per_image=16))
    second.fit_or_load(path, sample)
    assert asked == [1]
    x = images(2, seed=9)
    torch.testing.assert_close(first(x, prompts(2), [0, 1]), second(x, prompts(2), [0, 1]))
    other = DiffusionFeatures(sd_model, FeatureSpec(LAYERS), FusedFeatures(LAYERS, d=16, samples_per_image=16))
    with pytest.raises(ConfigError, match="--rebuild"):
        other.fit_or_load(path, sample)


def test_dataset_features_are_computed_once_and_validated(fused, sd_model, tmp_path):
    store = FeatureStore(tmp_path / "cache")
    x, p = images(10, seed=2), prompts(10)
    key = fused.key("tiny", "train")
    calls = UNetCalls(sd_model.unet)
    try:
        feats = fused.dataset(store, key, x, p, batch_size=4, progress=False)
        assert calls.n == 3  # ceil(10 / 4) batched UNet passes
        again = fused.dataset(store, key, x, p, batch_size=4, progress=False)
        assert calls.n == 3
    finally:
        calls.handle.remove()
    assert feats.shape == (10, 32) and feats.dtype == np.float32
    np.testing.assert_array_equal(feats, again)
    torch.testing.assert_close(torch.from_numpy(np.array(feats[3:5])), fused(x[3:5], p[3:5], [3, 4]), atol=1e-5, rtol=1e-4)
    data = store.path(key) / "features.npy"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(FeatureCacheError, match="features.npy"):
        fused.dataset(store, key, x, p, progress=False)
    rebuilt = fused.dataset(store, key, x, p, progress=False, rebuild=True)
    np.testing.assert_allclose(rebuilt, feats, atol=2e-4)  # another batch size: float rounding only


def test_an_interrupted_extraction_resumes_with_identical_features(fused, tmp_path, monkeypatch):
    x, p = images(6, seed=2), prompts(6)
    key = fused.key("tiny", "train")
    whole = fused.dataset(FeatureStore(tmp_path / "whole"), key, x, p, batch_size=2, progress=False, chunk_size=2)
    real, calls = DiffusionFeatures.__call__, []

    def killed_after_two_batches(self, imgs, prm, indices, *rest, **kw):
        if len(calls) == 2:  # chunks [0, 2) and [2, 4) finished, [4, 6) not begun
            raise KeyboardInterrupt
        calls.append(list(indices))
        return real(self, imgs, prm, indices, *rest, **kw)

    monkeypatch.setattr(DiffusionFeatures, "__call__", killed_after_two_batches)
    store = FeatureStore(tmp_path / "resumed")
    with pytest.raises(KeyboardInterrupt):
        fused.dataset(store, key, x, p, batch_size=2, progress=False, chunk_size=2)
    calls.clear()
    resumed = fused.dataset(store, key, x, p, batch_size=2, progress=False, chunk_size=2)
    assert calls == [[4, 5]]  # the finished chunks were not computed again
    assert (store.path(key) / "features.npy").read_bytes() == (FeatureStore(tmp_path / "whole").path(key)
                                                               / "features.npy").read_bytes()
    np.testing.assert_array_equal(resumed, whole)
    assert not store.chunks_path(key).exists()


def test_the_key_carries_the_fitted_basis(fused, sd_model):
    refit = DiffusionFeatures(sd_model, FeatureSpec(LAYERS, t=150), FusedFeatures(LAYERS, d=32, samples_per_image=16))
    refit.fit(images(12, seed=6), prompts(12), np.arange(12), batch_size=6)
    assert refit.key("tiny", "train").digest() != fused.key("tiny", "train").digest()
    assert fused.key("tiny", "train").model == sd_model.model_id


def test_semanticfl_recipe_shape(sd_model):
    layers = ("down.2", "mid", "up.1")
    feats = DiffusionFeatures(sd_model, FeatureSpec(layers), PooledPCAFeatures(layers, d=8))
    feats.fit(images(16, seed=4), prompts(16), np.arange(16), batch_size=8)
    assert feats(images(3), prompts(3), [0, 1, 2]).shape == (3, 8)
