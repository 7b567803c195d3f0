"""Fused UNet features: PCA bases fitted once and reused, the FedDifRC and SemanticFL recipes."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA

from fedguide.guidance.fused import FusedFeatures, PCABasis, PooledPCAFeatures, layer_dims, spatial_pool
from fedguide.registry import ConfigError

# Tiny stand-ins for SD-1.5's decoder maps (1280/640/320 channels at growing resolution).
CHANNELS = {"up.1": 32, "up.2": 16, "up.3": 8}
SIDES = {"up.1": 2, "up.2": 4, "up.3": 4}
LAYERS = list(CHANNELS)


def random_maps(batch: int, seed: int, channels: dict[str, int] = CHANNELS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # A per-channel offset and scale so the PCA has a non-trivial mean and spectrum.
    return {layer: torch.randn(batch, c, SIDES[layer], SIDES[layer], generator=gen)
            * torch.linspace(0.2, 3.0, c).view(1, c, 1, 1) + torch.arange(c).view(1, c, 1, 1) * 0.1
            for layer, c in channels.items()}


def fitted_fused(pool: str = "mean", **kwargs) -> FusedFeatures:
    features = FusedFeatures(LAYERS, d=16, pool=pool, samples_per_image=6, **kwargs)
    return features.fit([random_maps(4, seed) for seed in range(3)])


# --- PCABasis

def test_pca_basis_finds_known_axis_and_mean():
    rng = np.random.default_rng(0)
    t = rng.normal(scale=5.0, size=(400, 1))
    axis = np.array([[1.0, 1.0]]) / math.sqrt(2)
    points = np.array([3.0, -2.0]) + t * axis + rng.normal(scale=0.05, size=(400, 2))
    basis = PCABasis.fit(torch.from_numpy(points), dim=1)
    direction = basis.components[0].numpy()
    assert abs(abs(direction @ axis[0]) - 1.0) < 1e-4
    np.testing.assert_allclose(basis.mean.numpy(), points.mean(axis=0), atol=1e-12)
    np.testing.assert_allclose(basis.mean.numpy(), [3.0, -2.0], atol=0.5)
    assert basis.explained_variance_ratio.item() > 0.99


@pytest.mark.parametrize("num_samples,num_features,dim", [(200, 10, 4), (8, 20, 5)])
def test_pca_transform_matches_sklearn(num_samples, num_features, dim):
    rng = np.random.default_rng(1)
    samples = rng.normal(size=(num_samples, num_features)) * np.linspace(0.5, 4.0, num_features) + 1.5
    basis = PCABasis.fit(samples, dim, seed=3)
    expected = PCA(n_components=dim, random_state=3).fit(samples).transform(samples)
    got = basis.transform(torch.from_numpy(samples).float())
    assert got.dtype == torch.float32 and got.shape == (num_samples, dim)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5, rtol=1e-5)
    # Leading dimensions are batched: [2, N, C] -> [2, N, c].
    stacked = torch.from_numpy(np.stack([samples, samples]))
    np.testing.assert_allclose(basis.transform(stacked)[1].numpy(), expected, atol=1e-9)


def test_pca_basis_refuses_too_many_components_and_bad_input():
    with pytest.raises(ConfigError, match="lower dim to at most 3"):
        PCABasis.fit(np.random.default_rng(0).normal(size=(50, 3)), dim=4)
    with pytest.raises(ConfigError, match="lower dim to at most 5"):
        PCABasis.fit(np.random.default_rng(0).normal(size=(5, 30)), dim=6)
    with pytest.raises(ConfigError, match="NaN"):
        PCABasis.fit(np.array([[0.0, 1.0], [np.nan, 2.0], [1.0, 0.0]]), dim=1)
    basis = PCABasis.fit(np.random.default_rng(0).normal(size=(20, 4)), dim=2)
    with pytest.raises(ConfigError, match="expects 4 features"):
        basis.transform(torch.zeros(3, 5))


# --- layer_dims and spatial_pool

def test_layer_dims_default_split_and_given_dims():
    assert layer_dims(512, 3) == [256, 128, 128]
    assert layer_dims(512, 1) == [512]
    assert layer_dims(512, 2) == [256, 256]
    assert layer_dims(512, 4) == [256, 128, 64, 64]
    for n in range(1, 8):
        split = layer_dims(300, n)
        assert len(split) == n and sum(split) == 300 and min(split) >= 1
    assert layer_dims(16, 3, [6, 6, 4]) == [6, 6, 4]
    with pytest.raises(ConfigError, match="sum to 15"):
        layer_dims(16, 3, [6, 5, 4])
    with pytest.raises(ConfigError, match="one per layer"):
        layer_dims(16, 3, [8, 8])
    with pytest.raises(ConfigError, match="too small"):
        layer_dims(4, 4)


def test_spatial_pool_mean_and_l2_by_hand():
    maps = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])  # 1x1x2x2
    assert torch.allclose(spatial_pool(maps, "mean"), torch.tensor([[2.5]]))
    # (1 + 4 + 9 + 16) / 4 = 7.5 under the root.
    assert torch.allclose(spatial_pool(maps, "l2"), torch.tensor([[math.sqrt(7.5)]]))
    half = torch.full((1, 1, 4, 4), 300.0, dtype=torch.float16)  # squares overflow float16
    assert spatial_pool(half, "l2").item() == 300.0
    with pytest.raises(ConfigError, match="valid choices"):
        spatial_pool(maps, "max")
    with pytest.raises(ConfigError, match=r"\[B, C, H, W\]"):
        spatial_pool(maps[0], "mean")


# --- FusedFeatures (FedDifRC)

def test_fused_shape_and_fit_once():
    features = FusedFeatures(LAYERS, d=16, samples_per_image=6)
    assert not features.fitted and features.dims == [8, 4, 4]
    with pytest.raises(RuntimeError, match="not fitted"):
        features(random_maps(2, 9))
    features.fit([random_maps(4, seed) for seed in range(3)])
    assert features.fitted
    out = features(random_maps(5, 10))
    assert out.shape == (5, 16) and out.dtype == torch.float32
    with pytest.raises(RuntimeError, match="fitted once"):
        features.fit([random_maps(4, 11)])


def test_fused_bases_unchanged_by_calls():
    features = fitted_fused()
    before = features.state_dict()
    for seed in range(20):
        features(random_maps(3, 100 + seed))
    after = features.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


@pytest.mark.parametrize("pool", ["mean", "l2"])
def test_fused_image_features_do_not_depend_on_batch(pool):
    features = fitted_fused(pool)
    batch = random_maps(6, 42)
    together = features(batch)
    for i in range(6):
        alone = features({layer: m[i:i + 1] for layer, m in batch.items()})
        torch.testing.assert_close(alone[0], together[i], rtol=1e-5, atol=1e-6)
    # What a per-batch refit would do: a basis fitted on other images moves the same image's features.
    refit = FusedFeatures(LAYERS, d=16, pool=pool, samples_per_image=6).fit([batch])
    assert not torch.allclose(refit(batch), together, atol=1e-3)


@pytest.mark.parametrize("pool", ["mean", "l2"])
def test_fused_applies_pca_per_position_then_pools(pool):
    features = fitted_fused(pool)
    maps = random_maps(3, 7)
    state = features.state_dict()
    parts = []
    for layer in LAYERS:
        mean, components = state[f"{layer}/mean"].float(), state[f"{layer}/components"].float()
        reduced = torch.einsum("bchw,kc->bkhw", maps[layer] - mean.view(1, -1, 1, 1), components)
        parts.append(reduced.mean(dim=(2, 3)) if pool == "mean" else reduced.square().mean(dim=(2, 3)).sqrt())
    torch.testing.assert_close(features(maps), torch.cat(parts, dim=1), rtol=1e-5, atol=1e-5)


def test_fused_fit_is_seeded_and_independent_of_batching():
    images = random_maps(6, 5)
    in_twos = [{layer: m[i:i + 2] for layer, m in images.items()} for i in range(0, 6, 2)]
    a = FusedFeatures(LAYERS, d=16, samples_per_image=3, seed=1).fit([images]).state_dict()
    b = FusedFeatures(LAYERS, d=16, samples_per_image=3, seed=1).fit(in_twos).state_dict()
    c = FusedFeatures(LAYERS, d=16, samples_per_image=3, seed=2).fit([images]).state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(a["up.2/mean"], c["up.2/mean"])


@pytest.mark.parametrize("pool", ["mean", "l2"])
def test_fused_save_load_round_trip(tmp_path, pool):
    features = fitted_fused(pool, seed=4)
    path = tmp_path / "fused.safetensors"
    features.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["fused.safetensors"]  # no temp file left behind
    loaded = FusedFeatures.load(path)
    assert loaded.fitted and loaded.recipe() == features.recipe()
    maps = random_maps(4, 8)
    assert torch.equal(loaded(maps), features(maps))
    with pytest.raises(RuntimeError, match="fitted once"):
        loaded.fit([maps])


def test_fused_recipe_is_json_cache_key():
    recipe = FusedFeatures(LAYERS, d=16, pool="l2", samples_per_image=6, seed=3).recipe()
    assert json.loads(json.dumps(recipe)) == {"name": "fused", "layers": LAYERS, "d": 16, "dims": [8, 4, 4],
                                              "pool": "l2", "samples_per_image": 6, "seed": 3}


def test_fused_clear_errors_on_bad_maps():
    features = fitted_fused()
    maps = random_maps(2, 3)
    with pytest.raises(ConfigError, match=r"lack layer\(s\) \['up.2'\]"):
        features({layer: m for layer, m in maps.items() if layer != "up.2"})
    with pytest.raises(ConfigError, match="'up.3' has 9 channels but the fitted basis had 8"):
        features(random_maps(2, 3, {**CHANNELS, "up.3": 9}))
    with pytest.raises(ConfigError, match="batch size"):
        features({**maps, "up.1": maps["up.1"][:1]})
    extra = {**maps, "mid": torch.zeros(2, 3, 1, 1)}  # layers not chosen are ignored
    assert torch.equal(features(extra), features(maps))


def test_fused_fit_errors_name_the_fix():
    with pytest.raises(ConfigError, match="lower dims"):
        FusedFeatures(LAYERS, d=32, dims=[8, 8, 16]).fit([random_maps(4, 0)])  # up.3 has 8 channels
    with pytest.raises(ConfigError, match="raise samples_per_image"):
        FusedFeatures(LAYERS, d=16, samples_per_image=2).fit([random_maps(2, 0)])  # 4 positions < dim 8
    with pytest.raises(ConfigError, match="no feature maps"):
        FusedFeatures(LAYERS, d=16).fit([])
    with pytest.raises(ConfigError, match="wrap a single batch"):
        FusedFeatures(LAYERS, d=16).fit(random_maps(4, 0))
    with pytest.raises(ConfigError, match="earlier batches"):
        FusedFeatures(LAYERS, d=16).fit([random_maps(4, 0), random_maps(4, 1, {**CHANNELS, "up.1": 30})])
    with pytest.raises(ConfigError, match="valid choices"):
        FusedFeatures(LAYERS, pool="max")


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(ConfigError, match="missing.safetensors: no such"):
        FusedFeatures.load(missing)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(ConfigError, match="corrupt.safetensors is not a readable"):
        FusedFeatures.load(corrupt)
    pooled = tmp_path / "pooled.safetensors"
    PooledPCAFeatures(LAYERS, d=4).fit([random_maps(6, 0)]).save(pooled)
    with pytest.raises(ConfigError, match="holds a 'pooled_pca' basis"):
        FusedFeatures.load(pooled)


# --- PooledPCAFeatures (SemanticFL)

def test_pooled_pca_equals_manual_gap_concat_sklearn(tmp_path):
    batches = [random_maps(6, seed) for seed in range(3)]
    features = PooledPCAFeatures(["up.3", "up.1"], d=8, seed=2).fit(batches)
    manual = torch.cat([torch.cat([b["up.3"].mean(dim=(2, 3)), b["up.1"].mean(dim=(2, 3))], dim=1)
                        for b in batches]).double().numpy()
    expected = PCA(n_components=8, random_state=2).fit(manual).transform(manual)
    got = torch.cat([features(b) for b in batches])
    assert got.shape == (18, 8)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5, rtol=1e-5)
    path = tmp_path / "pooled.safetensors"
    features.save(path)
    loaded = PooledPCAFeatures.load(path)
    assert loaded.recipe() == {"name": "pooled_pca", "layers": ["up.3", "up.1"], "d": 8, "seed": 2}
    assert torch.equal(loaded(batches[0]), features(batches[0]))


def test_pooled_pca_errors_name_the_fix():
    with pytest.raises(ConfigError, match="lower d to at most 16"):
        PooledPCAFeatures(["up.2"], d=20).fit([random_maps(30, 0)])
    with pytest.raises(ConfigError, match="fit on more images or lower d"):
        PooledPCAFeatures(LAYERS, d=8).fit([random_maps(5, 0)])
    features = PooledPCAFeatures(LAYERS, d=4)
    with pytest.raises(RuntimeError, match="not fitted"):
        features(random_maps(2, 0))
    features.fit([random_maps(6, 0)])
    with pytest.raises(ConfigError, match="'up.1' has 31 channels"):
        features(random_maps(2, 0, {**CHANNELS, "up.1": 31}))
