"""Supervised FedDISC (``client_labels: own``, FedDifRC Table 6): labeled clients group their samples by their
own labels instead of the prototypes' pseudo-labels; unlabeled clients refuse it."""
import pytest
import torch

from fedguide.config import build_config
from fedguide.fl.setup import open_run, prepare
from fedguide.methods import ClientContext
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_raw

pytestmark = pytest.mark.usefixtures("cached_digits")
FAST = {"num_centroids": 2, "images_per_centroid": 2, "steps": 2, "head_epochs": 3, "sample_grid": 0}


def labeled_config(tiny_unclip, feature_cache, **method):
    raw = tiny_raw({"data": {"name": "digits_domains", "image_size": 16, "per_class": 20, "fraction": 0.5},
                    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
                    "clients": {"num": 2, "per_round": 2}, "train": {"rounds": 1},
                    "guidance": {"model": str(tiny_unclip), "feature_cache": str(feature_cache)}},
                   method={"name": "feddisc", **FAST, **method})
    return build_config(raw)


def test_labeled_clients_upload_groups_of_their_own_classes(tiny_unclip, feature_cache, tmp_path):
    ctx, method = open_run(prepare(labeled_config(tiny_unclip, feature_cache, client_labels="own")),
                             tmp_path / "run")
    method.setup()
    payload = method.server_payload(1, 0, ctx.initial_weights)
    data = ctx.data.client(0)
    upload = method.client_upload(ctx.model, ClientContext(0, 1, data, payload, {}), None)
    counts = data.class_counts()
    assert torch.equal(upload["pseudo_label_counts"].long(), counts)  # the true class counts, not pseudo-labels
    held = {int(c) for c in torch.nonzero(counts >= method.params.min_cluster_size).flatten()}
    assert set(upload["centroid_labels"].tolist()) == held


def test_supervised_feddisc_runs_one_shot(tiny_unclip, feature_cache, tmp_path):
    summary, (row,), _ = run_tiny(tmp_path, labeled_config(tiny_unclip, feature_cache, client_labels="own"))
    assert row["generated_images"] > 0 and 0.0 <= summary["final_accuracy"] <= 1.0


def test_unlabeled_clients_refuse_own_labels(digits_config, tmp_path):
    cfg = digits_config({"name": "feddisc", **FAST, "client_labels": "own"})
    with pytest.raises(ConfigError, match="client_labels=own .* unlabeled"):
        run_tiny(tmp_path, cfg)
