"""t-SNE of the final global model's features on a stratified test subset (FedDifRC Figs. 2, 8, 9;
SemanticFL Fig. 4; FedDW Fig. 5), coloured by class, one marker per domain where the data has domains.

Decisions
- The subset: at most ``points`` test images, each class keeping its share of the test set (at least one
  image per class), drawn by a numpy generator seeded with the analysis seed.
- Vectors are L2-normalised before t-SNE (FedDW Fig. 5's "vector unitization"), so the classification
  layer's rows, normalised too, share their space: they are embedded with the images and drawn as "X"
  in their class's colour (FedDW Fig. 5), when the head is one linear map of z.
- t-SNE: scikit-learn, 2 components, PCA initialisation, perplexity min(30, (n - 1) / 3), the analysis seed.
- Beside the picture, a number that does not depend on t-SNE's randomness: the silhouette score of the
  normalised features by class (cosine distance), and the same score on the 2-D map.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import class_colors, new_figure, save_numbers, save_png
from fedguide.data.federated import stratified_fraction

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun

SUBSET_TAG = 0x75E  # the subset's random stream, apart from t-SNE's own
MARKERS = "os^Dv<>pP*h"


def stratified_subset(labels: np.ndarray, cap: int, seed: int) -> np.ndarray:
    """Sorted indices of at most about ``cap`` samples, every class keeping its share (at least one each)."""
    if len(labels) <= cap:
        return np.arange(len(labels))
    rng = np.random.default_rng(np.random.SeedSequence([seed, SUBSET_TAG]))
    return stratified_fraction(labels, cap / len(labels), rng)


def tsne_map(vectors: np.ndarray, seed: int) -> np.ndarray:
    from sklearn.manifold import TSNE

    n = len(vectors)
    perplexity = float(min(30.0, max(1.0, (n - 1) / 3)))
    return TSNE(n_components=2, perplexity=perplexity, init="pca", learning_rate="auto",
                random_state=seed).fit_transform(vectors.astype(np.float64))


def silhouette(vectors: np.ndarray, labels: np.ndarray, metric: str) -> float | None:
    from sklearn.metrics import silhouette_score

    if not 2 <= len(np.unique(labels)) < len(labels):
        return None
    return float(silhouette_score(vectors, labels, metric=metric))


@FIGURES.register(
    "tsne",
    summary="t-SNE of the final global model's features on a stratified test subset, by class (and domain)")
class TSNE(Figure):
    order = 10
    min_points = 10  # scikit-learn's perplexity (30 by default, lowered to fit) needs more than a handful

    def applies(self, run: AnalysisRun) -> Optional[str]:
        return None if run.trained else run.untrained_reason

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        splits = run.splits
        test_y = splits.test_y.numpy()
        idx = stratified_subset(test_y, points, seed)
        z, _ = run.outputs(splits.test_x[torch.from_numpy(idx)])
        features = F.normalize(z, dim=1).numpy()
        labels = test_y[idx]
        head = run.head_weight()
        rows = F.normalize(head, dim=1).numpy() if head is not None and head.shape[1] == z.shape[1] else None
        coords = tsne_map(features if rows is None else np.concatenate([features, rows]), seed)
        point_xy, row_xy = coords[: len(idx)], coords[len(idx):]
        domains = splits.test_domains.numpy()[idx] if splits.test_domains is not None else None
        numbers = {
            "figure": "t-SNE of the final global model's encoder outputs z (FedDifRC Figs. 2, 8, 9; SemanticFL Fig. 4; "
                      "FedDW Fig. 5)",
            "run": str(run.run_dir), "method": run.method_label, "seed": seed,
            "vectors": "L2-normalised z of a stratified test subset" + (
                ", embedded together with the L2-normalised rows of the classification layer" if rows is not None else ""),
            "test_images": int(len(idx)), "test_set": int(len(test_y)),
            "silhouette_features": silhouette(features, labels, "cosine"),
            "silhouette_tsne": silhouette(point_xy, labels, "euclidean"),
            "class_names": run.class_names,
            "points": [{"test_index": int(i), "label": int(c), "x": float(x), "y": float(y)}
                       for i, c, (x, y) in zip(idx, labels, point_xy)],
            "class_weights": [{"class": c, "x": float(x), "y": float(y)} for c, (x, y) in enumerate(row_xy)],
        }
        if domains is not None:
            numbers["domain_names"] = list(splits.domain_names)
            for p, d in zip(numbers["points"], domains):
                p["domain"] = int(d)
        png = save_png(draw(numbers), run.out_dir / "tsne.png")
        return [png, save_numbers(run.out_dir / "tsne.json", numbers)]


def draw(numbers: dict):
    fig = new_figure((7.5, 6.5))
    ax = fig.add_subplot()
    names = numbers["class_names"]
    colors = class_colors(len(names))
    pts = numbers["points"]
    xy = np.array([[p["x"], p["y"]] for p in pts]).reshape(-1, 2)
    labels = np.array([p["label"] for p in pts], dtype=int)
    domain_names = numbers.get("domain_names")
    domains = np.array([p.get("domain", 0) for p in pts], dtype=int)
    for d in range(len(domain_names) if domain_names else 1):
        for c in range(len(names)):
            sel = (labels == c) & (domains == d)
            if sel.any():
                ax.scatter(xy[sel, 0], xy[sel, 1], s=8, color=colors[c], marker=MARKERS[d % len(MARKERS)],
                           alpha=0.75, linewidths=0, label=str(names[c]) if d == 0 else None)
    for w in numbers["class_weights"]:
        ax.scatter(w["x"], w["y"], s=140, marker="X", color=colors[w["class"]], edgecolors="black", linewidths=1.0)
    handles, texts = ax.get_legend_handles_labels()
    if domain_names:
        from matplotlib.lines import Line2D

        handles += [Line2D([], [], color="grey", marker=MARKERS[d % len(MARKERS)], linestyle="") for d in
                    range(len(domain_names))]
        texts += [f"domain {n}" for n in domain_names]
    if numbers["class_weights"]:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="grey", marker="X", markeredgecolor="black", linestyle="", markersize=9))
        texts.append("classifier row ω_c")
    if len(texts) <= 30:
        ax.legend(handles, texts, fontsize="x-small", markerscale=1.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_xticks([])
    ax.set_yticks([])
    sil = numbers["silhouette_features"]
    ax.set_title(f"t-SNE of z, {numbers['method']}: {numbers['test_images']} test images"
                 + (f" (silhouette {sil:.3f})" if sil is not None else ""), fontsize="medium")
    return fig
