"""FedDW Fig. 4's numbers: each class's classifier-row norm against its share of the data, for the final
global head and, where the run folder keeps them, the clients' own models."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedguide.analysis import analyze
from fedguide.analysis.figures.weight_norms import rank_correlation, row_norms
from fedguide.analysis.opened import AnalysisRun
from fedguide.core.state import ClientStateStore


def test_row_norms_hand_computed():
    norms, relative = row_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]]))
    assert norms.tolist() == [5.0, 1.0, 0.0]
    assert relative.tolist() == pytest.approx([5 / 6, 1 / 6, 0.0])


def test_rank_correlation_is_null_when_every_share_is_equal():
    assert rank_correlation(np.array([1.0, 2.0, 3.0]), np.array([0.2, 0.2, 0.2])) is None
    assert rank_correlation(np.array([3.0, 2.0, 1.0]), np.array([0.1, 0.3, 0.6])) == pytest.approx(-1.0)


def test_global_rows_are_the_norms_of_the_saved_head(fedavg_run):
    analyze(fedavg_run, ["weight_norms"])
    data = json.loads((fedavg_run / "analysis" / "weight_norms.json").read_text())
    head = load_file(fedavg_run / "model.safetensors")["head.weight"]
    assert data["global"]["norms"] == pytest.approx(torch.linalg.norm(head, dim=1).tolist(), rel=1e-6)
    counts = np.array(json.loads((fedavg_run / "partition.json").read_text())["counts"]).sum(0)
    assert data["global"]["class_share"] == pytest.approx((counts / counts.sum()).tolist())
    assert sum(data["global"]["relative_norms"]) == pytest.approx(1.0)
    assert data["clients"] == [] and "no client models" in data["used"][-1]
    assert (fedavg_run / "analysis" / "weight_norms.png").stat().st_size > 0


def test_client_rows_come_from_each_clients_stored_model(moon_run):
    analyze(moon_run, ["weight_norms"])
    data = json.loads((moon_run / "analysis" / "weight_norms.json").read_text())
    counts = np.array(json.loads((moon_run / "partition.json").read_text())["counts"])
    layout = AnalysisRun(moon_run).ctx.layout
    store = ClientStateStore(moon_run / "client_state")
    assert [c["client"] for c in data["clients"]] == [0, 1, 2, 3]
    for entry in data["clients"]:
        cid = entry["client"]
        assert entry["state_key"] == "prev_weights"
        head = store.get(cid)["prev_weights"][layout.span("head.weight")].view(10, -1)
        assert entry["norms"] == pytest.approx(torch.linalg.norm(head, dim=1).tolist(), rel=1e-6)
        assert entry["counts"] == counts[cid].tolist()
        assert entry["class_share"] == pytest.approx((counts[cid] / counts[cid].sum()).tolist())


def test_personal_heads_are_drawn_and_the_untrained_global_head_is_not(tmp_path):
    """FedRep averages the body and keeps each client's head: the global head is its initialisation, so the
    figure draws the clients' personal heads (from the client store) and says why the global one is missing."""
    from tests.tiny import run_tiny, tiny_config

    cfg = tiny_config(method={"name": "fedrep"}, clients={"num": 3, "per_round": 3}, train={"rounds": 2})
    _, _, run_dir = run_tiny(tmp_path, cfg, name="fedrep")
    analyze(run_dir, ["weight_norms"])
    data = json.loads((run_dir / "analysis" / "weight_norms.json").read_text())
    assert data["global"] is None and "untouched initial one" in data["used"][0]
    run = AnalysisRun(run_dir)
    store = ClientStateStore(run_dir / "client_state")
    assert [c["client"] for c in data["clients"]] == [0, 1, 2]
    for entry in data["clients"]:
        personal = store.get(entry["client"])["personal"]  # the flat vector's tail, from where the body ends
        start, span = run.ctx.layout.numel - personal.numel(), run.ctx.layout.span("head.weight")
        head = personal[span.start - start: span.stop - start]
        assert entry["state_key"] == "personal_model"
        assert entry["norms"] == pytest.approx(torch.linalg.norm(head.view(10, -1), dim=1).tolist(), rel=1e-5)


def test_equal_class_shares_are_said_not_left_as_a_puzzle():
    """FedAvg on balanced data: every class's share is 0.1, so every point sits on one vertical line."""
    from fedguide.analysis.figures.weight_norms import draw, model_entry

    entry = model_entry(torch.rand(10, 4), np.full(10, 50))
    assert entry["spearman"] is None
    fig = draw({"global": entry, "clients": [], "method": "fedavg"})
    assert "every class has the same share" in fig.axes[0].get_title()
