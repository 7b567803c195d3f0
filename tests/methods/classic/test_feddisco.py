"""FedDisco: discrepancy metrics and p_k ∝ ReLU(n_k − a·d_k + b) on hand-computed histograms, e2e."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fedguide.core.aggregation import weighted_average
from fedguide.fl.checkpoint import load_checkpoint
from fedguide.fl.setup import prepare
from fedguide.core.state import ClientStateStore
from fedguide.methods.classic.feddisco import FedDisco, FedDiscoParams, disco_weights, label_discrepancy
from tests.tiny import run_tiny, tiny_config

# Three clients, four classes, uniform reference T = [.25, .25, .25, .25]:
#   A = [10, 10, 10, 10]  (40 samples)  D_A = [.25, .25, .25, .25]
#   B = [40,  0,  0,  0]  (40 samples)  D_B = [1, 0, 0, 0]
#   C = [10, 10,  0,  0]  (20 samples)  D_C = [.5, .5, 0, 0]
HIST = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [10, 10, 0, 0]])
SIZES = [40, 40, 20]  # n = [.4, .4, .2]
UNIFORM = torch.ones(4)


def test_l2_discrepancy_hand_computed():
    d = label_discrepancy(HIST, UNIFORM, "l2")
    # B: sqrt(.75² + 3·.25²) = sqrt(.75); C: sqrt(4·.25²) = .5
    assert torch.allclose(d, torch.tensor([0.0, math.sqrt(0.75), 0.5], dtype=torch.float64))


def test_other_discrepancies_hand_computed():
    # L1: B: .75 + 3·.25 = 1.5; C: 4·.25 = 1
    assert torch.allclose(label_discrepancy(HIST, UNIFORM, "l1"), torch.tensor([0.0, 1.5, 1.0], dtype=torch.float64))
    # KL(D‖T): B: 1·log(1/.25) = log 4; C: 2·.5·log(.5/.25) = log 2; divided by the sum 3·log 2
    assert torch.allclose(label_discrepancy(HIST, UNIFORM, "kl"), torch.tensor([0.0, 2 / 3, 1 / 3], dtype=torch.float64))
    # cosine: B: 1 − .25/(1·.5) = .5; C: 1 − .25/(sqrt(.5)·.5) = 1 − 1/sqrt(2)
    cos = label_discrepancy(HIST, UNIFORM, "cosine")
    assert torch.allclose(cos, torch.tensor([0.0, 0.5, 1 - 1 / math.sqrt(2)], dtype=torch.float64), atol=1e-7)


def test_disco_weights_l2_hand_computed():
    p = disco_weights(SIZES, HIST, a=0.5, b=0.1, metric="l2")
    # scores n − a·d + b: A .4 − 0 + .1 = .5; B .4 − .5·.8660254 + .1 = .0669873; C .2 − .25 + .1 = .05
    scores = torch.tensor([0.5, 0.5 - 0.5 * math.sqrt(0.75), 0.05], dtype=torch.float64)
    assert torch.allclose(p, scores / scores.sum())
    assert p.sum().item() == pytest.approx(1.0)
    assert p[0] > 0.8  # the balanced client dominates; FedAvg would give it .4


def test_disco_weights_kl_hand_computed():
    p = disco_weights(SIZES, HIST, a=0.5, b=0.1, metric="kl")
    # scores: A .5; B .4 − .5·(2/3) + .1 = 1/6; C .2 − .5·(1/3) + .1 = 2/15; sum .8
    assert torch.allclose(p, torch.tensor([0.625, (1 / 6) / 0.8, (2 / 15) / 0.8], dtype=torch.float64))


def test_relu_clips_negative_scores():
    p = disco_weights(SIZES, HIST, a=0.5, b=0.1, metric="l1")
    # scores: A .5; B .4 − .75 + .1 < 0 → 0; C .2 − .5 + .1 < 0 → 0
    assert torch.equal(p, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_all_scores_clipped_falls_back_to_sizes():
    p = disco_weights([40, 20], HIST[1:], a=5.0, b=0.1)
    # B: .667 − 5·.866 + .1 < 0, C: .333 − 2.5 + .1 < 0 → n_k = [2/3, 1/3]
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))


def test_a_zero_b_zero_is_fedavg():
    p = disco_weights(SIZES, HIST, a=0.0, b=0.0)
    assert torch.allclose(p, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64))


def test_global_reference_hand_computed():
    # T = column sums [60, 20, 10, 10] / 100 = [.6, .2, .1, .1]
    ref = HIST.sum(0)
    d = label_discrepancy(HIST, ref, "l2")
    # A: [-.35, .05, .15, .15] → sqrt(.1225 + .0025 + .0225 + .0225) = sqrt(.17)
    # B: [.4, -.2, -.1, -.1]   → sqrt(.16 + .04 + .01 + .01) = sqrt(.22)
    # C: [-.1, .3, -.1, -.1]   → sqrt(.01 + .09 + .01 + .01) = sqrt(.12)
    assert torch.allclose(d, torch.tensor([0.17, 0.22, 0.12], dtype=torch.float64).sqrt())
    p = disco_weights(SIZES, HIST, 0.5, 0.1, reference=ref, metric="l2")
    scores = torch.tensor([0.5 - 0.5 * math.sqrt(0.17), 0.5 - 0.5 * math.sqrt(0.22), 0.3 - 0.5 * math.sqrt(0.12)],
                          dtype=torch.float64)
    assert torch.allclose(p, scores / scores.sum())


def test_params_default_and_validation():
    p = FedDiscoParams()
    assert (p.a, p.b, p.metric, p.reference) == (0.5, 0.1, "kl", "uniform")
    with pytest.raises(ValueError):
        FedDiscoParams(metric="emd")
    with pytest.raises(ValueError):
        FedDiscoParams(reference="test")


# ---- the method's hooks on a hand-built server ------------------------------------------------------
def test_aggregate_asks_once_stores_and_uses_disco_weights(tmp_path):
    run = SimpleNamespace(server_store=ClientStateStore(tmp_path / "server"), num_classes=4)
    method = FedDisco(FedDiscoParams(metric="l2"), run)
    method.setup()
    w = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0])]
    assert method.server_payload(1, 7, w[0])["send_label_counts"] is True
    uploads = [{"weights": w[i], "num_samples": SIZES[i], "label_counts": HIST[i], "client_id": i} for i in range(3)]
    out = method.aggregate(1, torch.zeros(2), uploads)
    expected = weighted_average(w, disco_weights(SIZES, HIST, 0.5, 0.1, metric="l2").tolist())
    assert torch.allclose(out, expected)
    run.server_store.commit(1)
    assert "send_label_counts" not in method.server_payload(2, 1, w[0])
    assert torch.equal(method.global_counts, HIST.sum(0).to(torch.float64))
    # Round 2: no histograms travel; the stored ones are used.
    without_counts = [{k: v for k, v in u.items() if k != "label_counts"} for u in uploads]
    again = method.aggregate(2, torch.zeros(2), without_counts)
    assert torch.allclose(again, expected)
    assert torch.equal(method.global_counts, HIST.sum(0).to(torch.float64)), "counted once per client"


# ---- in-process runs on 8x8 digits ------------------------------------------------------------------
def config(**over):
    return tiny_config({"method": {"name": "feddisco"}}, **over)


def run(tmp_path, name="run", resume=False, **over):
    return run_tiny(tmp_path, config(**over), name, resume)


def test_learns_and_sends_each_histogram_once(tmp_path):
    summary, rows, run_dir = run(tmp_path)
    assert summary["final_accuracy"] > 0.5
    n_weights = load_checkpoint(run_dir / "checkpoints").global_weights.numel()
    seen: set[int] = set()
    for r in rows:
        new = [c for c in r["clients"] if c not in seen]
        seen.update(r["clients"])
        # up: weights + num_samples per client, plus 10 int64 class counts from first-timers
        assert r["bytes_up"] == len(r["clients"]) * (4 * n_weights + 8) + len(new) * 10 * 8
        # down: weights, plus the 8-byte request flag to first-timers
        assert r["bytes_down"] == len(r["clients"]) * 4 * n_weights + len(new) * 8
    counts = prepare(config()).data.class_counts()
    store = ClientStateStore(run_dir / "server_state")
    for cid in seen:
        assert store.get(cid)["label_counts"].tolist() == counts[cid].tolist()
    for cid in set(range(4)) - seen:
        assert store.get(cid) == {}


@pytest.mark.parametrize("reference", ["uniform", "global"])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, reference):
    method = {"name": "feddisco", "reference": reference}
    full, _, full_dir = run(tmp_path, "full", method=method, train={"rounds": 3})
    run(tmp_path, "cut", method=method, train={"rounds": 2})
    resumed, _, cut_dir = run(tmp_path, "cut", resume=True, method=method, train={"rounds": 3})
    assert resumed["accuracy_curve"] == full["accuracy_curve"]
    a, b = load_checkpoint(full_dir / "checkpoints"), load_checkpoint(cut_dir / "checkpoints")
    assert torch.equal(a.global_weights, b.global_weights)
    assert torch.equal(a.method_state["global_counts"], b.method_state["global_counts"])
