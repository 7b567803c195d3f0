"""FedCDA: the selection objective and the approximate selection on hand-built vectors, memory, e2e."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fedguide.fl.checkpoint import load_checkpoint
from fedguide.core.state import ClientStateStore
from fedguide.methods.classic.fedcda import (FedCDA, FedCDAParams, candidate_gram, select_models,
                                     selection_objective)
from tests.tiny import run_tiny, tiny_config


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_objective_hand_computed():
    gram = candidate_gram([t([[0.0]]), t([[3.0]]), t([[6.0]])])
    # equal weights: mean 3, J = (9 + 0 + 9)/3 = 6
    assert selection_objective(gram, [0, 1, 2], torch.full((3,), 1 / 3, dtype=torch.float64)) == pytest.approx(6.0)
    # p = [.25, .25, .5]: mean .75 + 3 = 3.75, J = .25·3.75² + .25·.75² + .5·2.25² = 6.1875
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    assert selection_objective(gram, [0, 1, 2], p) == pytest.approx(6.1875)


def test_gram_is_centred_but_distances_are_exact():
    a, b = t([[1000.0, 1.0], [1000.5, 1.0]]), t([[999.0, 3.0]])
    g = candidate_gram([a, b])
    d = lambda i, j: g[i, i] + g[j, j] - 2 * g[i, j]  # noqa: E731
    assert d(0, 1).item() == pytest.approx(0.25)
    assert d(0, 2).item() == pytest.approx(1.0 + 4.0)
    assert d(1, 2).item() == pytest.approx(1.5 ** 2 + 4.0)


def test_each_client_moves_to_the_model_nearest_the_others():
    # A: newest (0,0), older (5,5); B: newest (10,10), older (5,6).
    # Greedy from (A0, B0), J = .25·‖a − b‖²: A → A1 (50 < 200), then B → B1 (1 < 50); A stays.
    a = t([[0.0, 0.0], [5.0, 5.0]])
    b = t([[10.0, 10.0], [5.0, 6.0]])
    assert select_models([a, b]) == [1, 1]


def test_ties_keep_the_newest_model():
    same = t([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    assert select_models([same, same.clone()]) == [0, 0]
    assert select_models([t([[1.0, 2.0]]), t([[3.0, 4.0]])]) == [0, 0]  # single candidates


def test_weights_decide_whom_a_client_moves_towards():
    # C picks 8 (near B at 10) or 2 (near A at 0); J ∝ p_A·x² + p_B·(10 − x)² for C at x.
    a, b, c = t([[0.0]]), t([[10.0]]), t([[8.0], [2.0]])
    assert select_models([a, b, c], weights=[3, 1, 1]) == [0, 0, 1]  # 3·4 + 64 = 76 < 3·64 + 4 = 196
    assert select_models([a, b, c], weights=[1, 3, 1]) == [0, 0, 0]  # 64 + 3·4 = 76 < 4 + 3·64


def test_block_search_escapes_a_greedy_local_optimum():
    # A ∈ {0, 10}, B ∈ {1, 10.2}: from (0, 1) no single move helps (9² or 10.2² > 1²),
    # but moving both gives 0.2² < 1².
    a, b = t([[0.0], [10.0]]), t([[1.0], [10.2]])
    assert select_models([a, b], block_size=1) == [0, 0]
    assert select_models([a, b], block_size=2) == [1, 1]


def test_mask_ignores_buffer_entries():
    # The second entry is a buffer: without the mask A moves towards B's buffer value.
    a = t([[0.0, 0.0], [0.0, 100.0]])
    b = t([[0.0, 90.0]])
    assert select_models([a, b]) == [1, 0]
    assert select_models([a, b], mask=torch.tensor([True, False])) == [0, 0]


def test_selection_never_worse_than_fedavg_choice():
    gen = torch.Generator().manual_seed(0)
    cands = [torch.randn(3, 20, generator=gen) for _ in range(6)]
    w = [5, 1, 2, 8, 3, 1]
    p = torch.tensor(w, dtype=torch.float64) / sum(w)
    gram = candidate_gram(cands)
    offsets = [0, 3, 6, 9, 12, 15]
    j = lambda ch: selection_objective(gram, [o + c for o, c in zip(offsets, ch)], p)  # noqa: E731
    greedy = select_models(cands, w)
    exact = select_models(cands, w, block_size=6)
    assert j(greedy) <= j([0] * 6) and j(exact) <= j(greedy) + 1e-12


def test_params_default_and_validation():
    p = FedCDAParams()  # the paper's Sec. 6.1: K = 3, B = 3 batches, 50 warm-up rounds
    assert (p.memory, p.warmup_rounds, p.batches, p.block_size, p.max_sweeps) == (3, 50, 3, None, 10)
    with pytest.raises(ValueError):
        FedCDAParams(memory=0)


# ---- the aggregate hook on a hand-built server ------------------------------------------------------
def _method(tmp_path, **params):
    run = SimpleNamespace(server_store=ClientStateStore(tmp_path / "server"))
    method = FedCDA(FedCDAParams(**params), run)
    method._mask = torch.tensor([True, True])
    return method, run.server_store


def _uploads(vectors, sizes=(1, 1)):
    return [{"weights": t(v), "num_samples": n, "client_id": i} for i, (v, n) in enumerate(zip(vectors, sizes))]


def test_aggregate_selects_from_memory_after_warmup(tmp_path):
    method, store = _method(tmp_path, memory=2, warmup_rounds=1)
    out1 = method.aggregate(1, None, _uploads([[5.0, 5.0], [5.0, 6.0]]))
    assert torch.allclose(out1, t([5.0, 5.5]))
    store.commit(1)
    # Round 2 uploads drift apart; each client's round-1 model is closer to the other's.
    out2 = method.aggregate(2, None, _uploads([[0.0, 0.0], [10.0, 10.0]]))
    assert torch.allclose(out2, t([5.0, 5.5]))
    assert method._last == {"fedcda_mean_age": 1.0, "fedcda_older_picks": 2.0}
    store.commit(2)
    state = store.get(0)
    assert state["models"].shape == (2, 2) and state["rounds"].tolist() == [2, 1]
    method.aggregate(3, None, _uploads([[1.0, 1.0], [1.0, 1.0]]))
    store.commit(3)
    assert store.get(0)["rounds"].tolist() == [3, 2], "memory keeps the newest M models only"


def test_warmup_is_fedavg(tmp_path):
    method, store = _method(tmp_path, memory=2, warmup_rounds=2)
    method.aggregate(1, None, _uploads([[5.0, 5.0], [5.0, 6.0]]))
    store.commit(1)
    out = method.aggregate(2, None, _uploads([[0.0, 0.0], [10.0, 10.0]], sizes=(1, 3)))
    assert torch.allclose(out, t([7.5, 7.5]))  # sample-weighted mean of this round's uploads


def test_participants_are_searched_in_b_blocks_unless_a_block_size_is_given(tmp_path, monkeypatch):
    import fedguide.methods.classic.fedcda as fedcda

    blocks = []
    real = fedcda.select_models
    monkeypatch.setattr(fedcda, "select_models", lambda c, w, block, *a: blocks.append(block) or real(c, w, block, *a))
    vectors = [[float(i), 0.0] for i in range(7)]
    method, _ = _method(tmp_path / "b", warmup_rounds=0)
    method.aggregate(1, None, _uploads(vectors, sizes=[1] * 7))
    method, _ = _method(tmp_path / "s", warmup_rounds=0, block_size=2)
    method.aggregate(1, None, _uploads(vectors, sizes=[1] * 7))
    assert blocks == [3, 2]  # ⌈7 / 3⌉, then the explicit size


# ---- in-process runs on 8x8 digits ------------------------------------------------------------------
def config(**over):
    return tiny_config({"method": {"name": "fedcda", "warmup_rounds": 1, "memory": 2},
                        "clients": {"num": 4, "per_round": 3}}, **over)


def run(tmp_path, name="run", resume=False, **over):
    return run_tiny(tmp_path, config(**over), name, resume)


def test_learns_and_keeps_at_most_m_models_per_client(tmp_path):
    summary, rows, run_dir = run(tmp_path)
    assert summary["final_accuracy"] > 0.5
    assert all("fedcda_mean_age" in r and "fedcda_older_picks" in r for r in rows)
    assert rows[0]["fedcda_mean_age"] == 0.0  # warm-up
    store = ClientStateStore(run_dir / "server_state")
    n_weights = load_checkpoint(run_dir / "checkpoints").global_weights.numel()
    for cid in range(4):
        rounds_in = [r["round"] for r in rows if cid in r["clients"]]
        state = store.get(cid)
        if not rounds_in:
            assert state == {}
            continue
        assert state["rounds"].tolist() == sorted(rounds_in, reverse=True)[:2]
        assert state["models"].shape == (min(2, len(rounds_in)), n_weights)


def test_all_warmup_equals_fedavg(tmp_path):
    cda, _, _ = run(tmp_path, "cda", method={"name": "fedcda", "warmup_rounds": 3, "memory": 2})
    avg, _, _ = run(tmp_path, "avg", method={"name": "fedavg"})
    assert cda["accuracy_curve"] == avg["accuracy_curve"]


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    full, full_rows, full_dir = run(tmp_path, "full", train={"rounds": 4})
    run(tmp_path, "cut", train={"rounds": 2})
    resumed, cut_rows, cut_dir = run(tmp_path, "cut", resume=True, train={"rounds": 4})
    assert resumed["accuracy_curve"] == full["accuracy_curve"]
    assert [r["fedcda_mean_age"] for r in full_rows] == [r["fedcda_mean_age"] for r in cut_rows]
    a, b = load_checkpoint(full_dir / "checkpoints"), load_checkpoint(cut_dir / "checkpoints")
    assert torch.equal(a.global_weights, b.global_weights)
