"""t-SNE of the final model's features: the stratified, seeded test subset and one point per sampled image
with its label (and domain), beside the classification layer's rows."""
import json

import numpy as np
import pytest

from fedguide.analysis import analyze
from fedguide.analysis.figures.tsne import stratified_subset
from fedguide.analysis.opened import AnalysisRun


def test_subset_keeps_each_class_share_and_follows_the_seed():
    labels = np.repeat(np.arange(4), [100, 50, 30, 20])
    idx = stratified_subset(labels, 40, seed=0)
    assert np.bincount(labels[idx]).tolist() == [20, 10, 6, 4]
    assert np.array_equal(idx, np.unique(idx))
    assert np.array_equal(idx, stratified_subset(labels, 40, seed=0))
    assert not np.array_equal(idx, stratified_subset(labels, 40, seed=1))
    assert np.array_equal(stratified_subset(labels, 500, seed=0), np.arange(200))  # fewer than the cap: all


def test_one_point_per_sampled_test_image_with_its_label(fedavg_run):
    result = analyze(fedavg_run, ["tsne"], points=120)
    assert [p.name for p in result.written["tsne"]] == ["tsne.png", "tsne.json"]
    assert (fedavg_run / "analysis" / "tsne.png").stat().st_size > 0
    data = json.loads((fedavg_run / "analysis" / "tsne.json").read_text())
    test_y = AnalysisRun(fedavg_run).splits.test_y.numpy()
    expected = stratified_subset(test_y, 120, seed=0)
    assert [p["test_index"] for p in data["points"]] == expected.tolist()
    assert [p["label"] for p in data["points"]] == test_y[expected].tolist()
    assert data["test_images"] == len(expected) and abs(len(expected) - 120) <= 10
    assert all(np.isfinite([p["x"], p["y"]]).all() for p in data["points"])
    # the MLP's head is one linear map of z: its ten rows are embedded with the images
    assert [w["class"] for w in data["class_weights"]] == list(range(10))
    assert -1 <= data["silhouette_features"] <= 1 and "domain_names" not in data


def test_points_carry_their_domain_where_the_data_has_domains(feddifrc_run):
    analyze(feddifrc_run, ["tsne"], points=60, seed=3)
    data = json.loads((feddifrc_run / "analysis" / "tsne.json").read_text())
    splits = AnalysisRun(feddifrc_run).splits
    idx = [p["test_index"] for p in data["points"]]
    assert [p["domain"] for p in data["points"]] == splits.test_domains[idx].tolist()
    assert data["domain_names"] == list(splits.domain_names) and data["seed"] == 3


def test_too_few_points_is_refused_for_the_tsne_alone(fedavg_run):
    with pytest.raises(Exception, match="--tsne does not apply .*points=3 is too few for it; ask for at least 10"):
        analyze(fedavg_run, ["tsne"], points=3)
    result = analyze(fedavg_run, ["weight_norms"], points=3)  # a figure that samples no points is made
    assert result.written["weight_norms"]
    assert "points=3 is too few" in analyze(fedavg_run, points=3).skipped["tsne"]
