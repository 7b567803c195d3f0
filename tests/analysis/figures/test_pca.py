"""FedDifRC Figs. 3-4 for a diffusion-guided run: per-position PCA-as-RGB and K-means maps of the features
the method computes, with the fused features of Eq. 8; a clear error for a run without diffusion features."""
import json

import numpy as np
import pytest
import torch

from fedguide.analysis import analyze
from fedguide.analysis.figures.pca import fused_map, pca_rgb, pick_images
from fedguide.guidance.fused import FusedFeatures
from fedguide.registry import ConfigError


def test_pca_rgb_puts_the_main_direction_in_red_scaled_to_unit_range():
    # 2 images x 4 positions; the channel vectors vary along (1, 1, 0, 0) a lot and, uncorrelated with that,
    # along (0, 0, 1, 0) a little
    big, small = torch.linspace(-4, 4, 8), 0.5 * torch.tensor([1.0, -1, -1, 1, -1, 1, 1, -1])
    positions = torch.stack([big, big, small, torch.zeros(8)], dim=1)  # [8, 4]
    maps = positions.reshape(2, 2, 2, 4).permute(0, 3, 1, 2)  # [B, C, H, W]
    rgb, ratio = pca_rgb(maps)
    assert rgb.shape == (2, 2, 2, 3) and rgb.min() >= 0 and rgb.max() <= 1
    red = rgb[..., 0].reshape(-1)
    assert np.corrcoef(red, big.numpy())[0, 1] ** 2 == pytest.approx(1.0)  # first component: the big direction
    assert ratio[0] > ratio[1] and ratio.sum() == pytest.approx(1.0)


def test_fused_map_applies_each_layers_basis_per_position_and_upsamples():
    torch.manual_seed(0)
    maps = {"up.1": torch.randn(3, 6, 2, 2), "up.2": torch.randn(3, 5, 4, 4)}
    recipe = FusedFeatures(["up.1", "up.2"], d=4, samples_per_image=16).fit([maps])
    fused = fused_map(recipe, {k: v.double() for k, v in maps.items()})
    assert fused.shape == (3, 4, 4, 4)  # d = 2 + 2 channels at the larger layer's 4x4
    state = recipe.state_dict()
    at = maps["up.2"][1, :, 3, 0].double()  # one position of the larger layer: its own PCA, not resampled
    want = (at - state["up.2/mean"]) @ state["up.2/components"].T
    assert fused[1, 2:, 3, 0].tolist() == pytest.approx(want.tolist())
    # mean pooling commutes with the upsampling of a 2x2 map to 4x4 (bilinear, no corners aligned)
    pooled = ((maps["up.1"].double().mean((2, 3)) - state["up.1/mean"]) @ state["up.1/components"].T)
    torch.testing.assert_close(fused[:, :2].mean((2, 3)), pooled)


def test_images_are_of_distinct_classes_and_seeded():
    labels = np.repeat(np.arange(5), 4)
    idx = pick_images(labels, 4, seed=0)
    assert len(set(labels[idx])) == 4 and np.array_equal(idx, pick_images(labels, 4, seed=0))


def test_maps_of_a_feddifrc_run(feddifrc_run):
    result = analyze(feddifrc_run, ["pca"])
    assert sorted(p.name for p in result.written["pca"]) == ["kmeans_ndcr.png", "pca.json", "pca_ndcr.png"]
    data = json.loads((feddifrc_run / "analysis" / "pca.json").read_text())
    assert list(data["sets"]) == ["ndcr"] and len(data["images"]) == 4
    labels = [image["label"] for image in data["images"]]
    assert len(set(labels)) == 4
    for entry in data["sets"].values():
        # NDCR's timestep as the run resolved it (t: paper, matched to the pipeline; guidance/feddifrc.json)
        resolved = json.loads((feddifrc_run / "guidance" / "feddifrc.json").read_text())["ndcr_t"]["resolved"]
        assert entry["t"] == resolved and entry["condition_mode"] == "none"
        assert list(entry["maps"]) == ["up.1", "up.2", "up.3", "fused"]  # decoder layers L = 2, 3, 4, then Eq. 8
        for column in entry["maps"].values():
            h, w = column["shape"]
            rgb, clusters = np.array(column["pca_rgb"]), np.array(column["kmeans_labels"])
            assert rgb.shape == (4, h, w, 3) and 0 <= rgb.min() and rgb.max() <= 1
            assert clusters.shape == (4, h, w) and 0 <= clusters.min() and clusters.max() < column["kmeans_clusters"]
        assert entry["maps"]["fused"]["shape"] == entry["maps"]["up.3"]["shape"]  # the finest layer's resolution


def test_a_run_without_diffusion_features_is_refused_when_asked(fedavg_run):
    with pytest.raises(ConfigError, match="--pca does not apply.*no fitted feature bases"):
        analyze(fedavg_run, ["pca"])
