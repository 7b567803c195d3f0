"""What the diffusion features of a guided run look like per position (FedDifRC Sec. 3.2): the first three
PCA components of each UNet layer's channel vectors as RGB (Fig. 4, with the fused features of Eq. 8) and
K-means clusters of each layer's positions (Fig. 3, 5 clusters), for a few test images.

Which features: those the run's method computes, found as the ``DiffusionFeatures`` it holds once set up
(FedDifRC: the TDCL features at t = 0 and the NDCR features at its t; SemanticFL: its visual features),
with their layers, timestep, noise seed and condition mode, on the run's guidance model. A run without
fitted feature bases in its folder (``guidance/*.safetensors``) has no diffusion features.

Decisions
- Prompt: each image's true-class prompt "a photo of a {class}" (the prompt P_{y_i} of FedDifRC Eqs. 7
  and 9); features whose condition mode injects the client condition get h(x) of the final global encoder.
- PCA to RGB: one PCA per layer, fitted on the positions of all the shown images together so that one
  colour means one direction in every image; each component is min-max scaled to [0, 1] over those positions.
- Fused (FusedFeatures only, FedDifRC Eq. 8): each layer's positions reduced by the method's own fitted
  per-layer PCA, upsampled (bilinear) to the largest layer's resolution and concatenated; shown like a layer.
  SemanticFL's recipe pools before its PCA, so it has no per-position fused map.
- K-means: scikit-learn, per image and layer, min(5, positions) clusters, the analysis seed.
- Images: ``IMAGES`` test images of different classes, drawn with the analysis seed.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import new_figure, save_numbers, save_png
from fedguide.methods.base import Method

# The guidance modules are imported where they are used: 'fedguide --help' imports this module to list
# its option, and only a diffusion-guided run needs them.
if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun
    from fedguide.guidance.features import DiffusionFeatures
    from fedguide.guidance.fused import FusedFeatures

IMAGES = 4
CLUSTERS = 5  # FedDifRC Sec. 3.2: "cluster size set as 5"
IMAGES_TAG = 0xD1F
FUSED = "fused"


def feature_sets(method: Method) -> list[tuple[str, DiffusionFeatures]]:
    """(name, features) of every fitted DiffusionFeatures the set-up method (or its parts) holds."""
    from fedguide.guidance.features import DiffusionFeatures

    holders = [method, *method.regularizers]
    out = []
    for holder in holders:
        for attr, value in vars(holder).items():
            if isinstance(value, DiffusionFeatures) and value.recipe is not None and value.recipe.fitted:
                out.append((str(value.spec.extra.get("role", attr)), value))
    return out


def pick_images(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Up to ``count`` indices, one per class in a seeded order of the classes present."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, IMAGES_TAG]))
    classes = rng.permutation(np.unique(labels))[:count]
    return np.array([rng.choice(np.flatnonzero(labels == c)) for c in classes], dtype=np.int64)


def pca_rgb(maps: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[B, C, H, W] -> (RGB [B, H, W, 3] in [0, 1], explained variance ratio [3]): one PCA over every position
    of every image; components beyond the channels or positions available stay 0."""
    from sklearn.decomposition import PCA

    b, c, h, w = maps.shape
    positions = maps.movedim(1, -1).reshape(-1, c).double().numpy()
    k = min(3, c, len(positions))
    rgb = np.zeros((len(positions), 3))
    ratio = np.zeros(3)
    if k >= 1 and len(positions) >= 2:
        pca = PCA(n_components=k, svd_solver="full").fit(positions)
        rgb[:, :k] = pca.transform(positions)
        ratio[:k] = pca.explained_variance_ratio_
        low, high = rgb.min(0), rgb.max(0)
        rgb = (rgb - low) / np.where(high > low, high - low, 1.0)
    return rgb.reshape(b, h, w, 3), ratio


def kmeans_labels(maps: torch.Tensor, seed: int) -> tuple[np.ndarray, list[float], int]:
    """[B, C, H, W] -> (cluster of each position [B, H, W], inertia per image, clusters)."""
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    b, c, h, w = maps.shape
    k = min(CLUSTERS, h * w)
    labels, inertia = np.zeros((b, h, w), dtype=np.int64), []
    for i in range(b):
        positions = maps[i].reshape(c, h * w).T.double().numpy()
        if k < 2:
            inertia.append(0.0)
            continue
        # One image's positions are a small problem: threads cost more than they save (and far more when
        # the machine is busy, as OpenMP threads then wait for each other).
        with threadpool_limits(limits=1):
            km = KMeans(n_clusters=k, n_init=4, random_state=seed).fit(positions)
        labels[i] = km.labels_.reshape(h, w)
        inertia.append(float(km.inertia_))
    return labels, inertia, k


def fused_map(recipe: FusedFeatures, maps: dict[str, torch.Tensor]) -> torch.Tensor:
    """Eq. 8 per position: each layer's channels through its fitted PCA, upsampled to the largest layer's
    resolution, concatenated: [B, d, H, W]."""
    from fedguide.guidance.fused import PCABasis

    state = recipe.state_dict()
    size = max((maps[layer].shape[-2:] for layer in recipe.layers), key=lambda s: s[0] * s[1])
    parts = []
    for layer in recipe.layers:
        basis = PCABasis(state[f"{layer}/mean"], state[f"{layer}/components"], state[f"{layer}/explained_variance_ratio"])
        reduced = basis.transform(maps[layer].double().movedim(1, -1)).movedim(-1, 1)
        parts.append(F.interpolate(reduced, size=tuple(size), mode="bilinear", align_corners=False))
    return torch.cat(parts, dim=1)


def layer_title(name: str) -> str:
    if name.startswith("up.") and not name.endswith(".pre"):
        return f"{name} (L={int(name.split('.')[1]) + 1})"  # FedDifRC's decoder layer L
    return name


def analyse_set(run: AnalysisRun, feats: DiffusionFeatures, idx: np.ndarray, seed: int) -> dict[str, Any]:
    """The numbers of one feature set on the test images ``idx``: per column (layer, fused) its PCA-RGB and
    K-means maps."""
    from fedguide.guidance.fused import FusedFeatures
    from fedguide.guidance.shared import class_prompts, guidance_pixels
    from fedguide.methods.diffusion_guided._diffusion_features import prompt_maps

    splits, spec = run.splits, feats.spec
    x = splits.test_x[torch.from_numpy(idx)]
    labels = splits.test_y[torch.from_numpy(idx)]
    tokens = feats.model.encode_text(tuple(class_prompts(run.class_names))).tokens
    condition = run.outputs(x)[0] if spec.condition_mode != "none" else None
    maps = prompt_maps(feats, guidance_pixels(splits, x), idx, tokens, labels.unsqueeze(1), condition)
    columns = {layer: maps[layer].float().cpu() for layer in spec.layers}
    if isinstance(feats.recipe, FusedFeatures):
        columns[FUSED] = fused_map(feats.recipe, {k: v.double().cpu() for k, v in maps.items()}).float()
    out = {}
    for name, m in columns.items():
        rgb, ratio = pca_rgb(m)
        clusters, inertia, k = kmeans_labels(m, seed)
        out[name] = {"shape": list(m.shape[-2:]), "channels": int(m.shape[1]), "pca_explained_variance_ratio": ratio,
                     "pca_rgb": np.round(rgb, 4), "kmeans_clusters": k, "kmeans_labels": clusters,
                     "kmeans_inertia": inertia}
    return {"t": spec.t, "layers": list(spec.layers), "condition_mode": spec.condition_mode,
            "noise_seed": spec.noise_seed, "fused": FUSED in columns, "maps": out}


@FIGURES.register(
    "pca",
    summary="diffusion-guided runs: PCA-as-RGB and K-means maps of the diffusion features of a few test images")
class DiffusionMaps(Figure):
    order = 20

    def applies(self, run: AnalysisRun) -> Optional[str]:
        if not any((run.run_dir / "guidance").glob("*.safetensors")):
            return ("the run uses no diffusion features (no fitted feature bases in its guidance/ folder): only the "
                    "diffusion-guided methods (feddifrc, semanticfl) have them")
        if not feature_sets(run.method()):
            return "the run's method holds no fitted diffusion features once set up"
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        from fedguide.guidance.shared import guidance_pixels

        method = run.method()
        splits = run.splits
        idx = np.sort(pick_images(splits.test_y.numpy(), IMAGES, seed))
        numbers: dict[str, Any] = {
            "figure": "per-position diffusion features: PCA to RGB (FedDifRC Fig. 4) and K-means clusters (Fig. 3)",
            "run": str(run.run_dir), "method": run.method_label, "seed": seed,
            "guidance_model": run.config.guidance.model, "prompt": "a photo of a {true class} per image",
            "images": [{"test_index": int(i), "label": int(splits.test_y[i])} for i in idx], "sets": {},
        }
        written = []
        shown = ((guidance_pixels(splits, splits.test_x[torch.from_numpy(idx)]) + 1) / 2).clamp(0, 1)
        for name, feats in feature_sets(method):
            entry = numbers["sets"][name] = analyse_set(run, feats, idx, seed)
            written.append(save_png(draw(entry, shown, name, "pca", numbers), run.out_dir / f"pca_{name}.png"))
            written.append(save_png(draw(entry, shown, name, "kmeans", numbers), run.out_dir / f"kmeans_{name}.png"))
        return written + [save_numbers(run.out_dir / "pca.json", numbers)]


def draw(entry: dict, images: torch.Tensor, name: str, kind: str, numbers: dict):
    columns = list(entry["maps"])
    rows = len(images)
    fig = new_figure((1.6 * (len(columns) + 1), 1.6 * rows + 0.6))
    names = [numbers["images"][r]["label"] for r in range(rows)]
    for r in range(rows):
        ax = fig.add_subplot(rows, len(columns) + 1, r * (len(columns) + 1) + 1)
        img = images[r].permute(1, 2, 0).numpy()
        ax.imshow(img if img.shape[-1] == 3 else img[..., 0], cmap=None if img.shape[-1] == 3 else "gray")
        ax.set_axis_off()
        if r == 0:
            ax.set_title("image", fontsize="small")
        ax.text(-0.05, 0.5, f"class {names[r]}", transform=ax.transAxes, rotation=90, va="center", ha="right",
                fontsize="x-small")
        for j, col in enumerate(columns):
            m = entry["maps"][col]
            ax = fig.add_subplot(rows, len(columns) + 1, r * (len(columns) + 1) + j + 2)
            if kind == "pca":
                ax.imshow(np.asarray(m["pca_rgb"])[r], interpolation="nearest")
            else:
                ax.imshow(np.asarray(m["kmeans_labels"])[r], cmap="tab10", vmin=0, vmax=9, interpolation="nearest")
            ax.set_axis_off()
            if r == 0:
                ax.set_title(layer_title(col), fontsize="small")
    what = "first 3 PCA components as RGB" if kind == "pca" else f"K-means, {CLUSTERS} clusters"
    fig.suptitle(f"{numbers['method']} {name} features (t={entry['t']}): {what}", fontsize="medium")
    return fig
