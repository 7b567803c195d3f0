"""FedDW's SL and CR matrices of any finished run, from the final model (Eqs. 4, 7, 11)."""
import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedguide.analysis import analyze
from fedguide.analysis.figures.sl_cr import soft_labels
from fedguide.analysis.opened import AnalysisRun


def test_soft_labels_hand_computed():
    # class 0: two samples with softmax (0.5, 0.5) and (e/(1+e), 1/(1+e)); class 1: one sample; class 2: none
    logits = torch.tensor([[0.0, 0.0, -math.inf], [1.0, 0.0, -math.inf], [0.0, 2.0, -math.inf]])
    sl, counts = soft_labels(logits, torch.tensor([0, 0, 1]), 3)
    e = math.e
    assert counts.tolist() == [2, 1, 0]
    assert sl[0].tolist() == pytest.approx([(0.5 + e / (1 + e)) / 2, (0.5 + 1 / (1 + e)) / 2, 0.0])
    assert sl[1].tolist() == pytest.approx([1 / (1 + e ** 2), e ** 2 / (1 + e ** 2), 0.0])
    assert sl[2].tolist() == [0.0, 0.0, 0.0]


def test_matrices_of_a_run_without_dw_state(fedavg_run):
    analyze(fedavg_run, ["sl_cr"])
    data = json.loads((fedavg_run / "analysis" / "sl_cr.json").read_text())
    sl, cr = np.array(data["sl"]), np.array(data["cr"])
    # SL: per class, the mean softmax of the final model over every client sample of that class
    run = AnalysisRun(fedavg_run)
    idx = torch.from_numpy(run.client_samples())
    with torch.no_grad():
        probs = torch.softmax(run.model(run.splits.train_x[idx]).double(), dim=1)
    labels = run.splits.train_y[idx]
    for c in range(10):
        assert sl[c] == pytest.approx(probs[labels == c].mean(0).numpy(), abs=1e-6)
    # CR: softmax_rows(ω ωᵀ) of the saved head; L_reg = ‖Ω − CR‖²_F / C²
    omega = load_file(fedavg_run / "model.safetensors")["head.weight"].double()
    assert cr == pytest.approx(torch.softmax(omega @ omega.T, dim=1).numpy(), abs=1e-9)
    assert data["l_reg"] == pytest.approx(((sl - cr) ** 2).sum() / 100)
    assert data["samples"] == len(idx) and data["head_bias_ignored"] is True
    assert "sl_server" not in data


def test_a_dw_run_also_shows_the_servers_soft_labels(feddw_run):
    analyze(feddw_run, ["sl_cr"])
    data = json.loads((feddw_run / "analysis" / "sl_cr.json").read_text())
    with safe_open(str(feddw_run / "checkpoints" / "last.safetensors"), framework="pt") as fh:
        stored = fh.get_tensor("method.dw.sl").double()
    assert np.array(data["sl_server"]) == pytest.approx(stored.numpy())
    assert data["l_reg_server"] == pytest.approx(float(((stored - torch.tensor(data["cr"])) ** 2).sum() / 100))
    assert data["head_bias_ignored"] is False
