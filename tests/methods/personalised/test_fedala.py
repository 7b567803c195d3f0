"""FedALA's adaptive local aggregation: the element-wise weight update on hand-computed numbers, the lower layers
taking the global model, and the first-time convergence versus one epoch later."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedguide.methods import ClientContext
from fedguide.methods.personalised.fedala import ala_update, learn_weights
from fedguide.registry import ConfigError
from tests.methods.pfl_cases import client_round, opened


def test_weight_update_hand_computed():
    local, glob = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 0.0])]  # Θ − θ = [2, −2]
    # W = 1, g = [0.5, −1], η = 1: W − η·g⊙(Θ − θ) = [1 − 1, 1 − 2] = [0, −1] -> clipped [0, 0]; θ̂ = θ.
    w, mixed = ala_update([torch.tensor([0.5, -1.0])], local, glob, [torch.ones(2)], 1.0)
    assert torch.equal(w[0], torch.tensor([0.0, 0.0])) and torch.equal(mixed[0], torch.tensor([1.0, 2.0]))
    # W = 0.5, g = [0.1, 0.2], η = 1: [0.5 − 0.2, 0.5 + 0.4] = [0.3, 0.9]; θ̂ = [1 + 2·0.3, 2 − 2·0.9] = [1.6, 0.2].
    w, mixed = ala_update([torch.tensor([0.1, 0.2])], local, glob, [torch.full((2,), 0.5)], 1.0)
    assert torch.allclose(w[0], torch.tensor([0.3, 0.9])) and torch.allclose(mixed[0], torch.tensor([1.6, 0.2]))
    # η scales the step; the upper clip holds too: W = 0.5, g = [−1, 0], η = 2 -> [0.5 + 4, 0.5] -> [1, 0.5].
    w, _ = ala_update([torch.tensor([-1.0, 0.0])], local, glob, [torch.full((2,), 0.5)], 2.0)
    assert torch.equal(w[0], torch.tensor([1.0, 0.5]))


def test_one_epoch_takes_the_gradient_at_the_mixed_model():
    torch.manual_seed(0)
    model = nn.Linear(2, 2, bias=False)
    x, y = torch.tensor([[1.0, -1.0], [0.5, 2.0]]), torch.tensor([0, 1])
    local, glob = [torch.tensor([[0.2, -0.1], [0.0, 0.3]])], [torch.tensor([[1.0, 0.5], [-0.5, 0.1]])]
    start = [torch.full((2, 2), 0.5)]
    w = learn_weights(model, [model.weight], local, glob, start, [(x, y)], eta=0.7, converge=False, max_epochs=1,
                      threshold=0.1, num_pre_loss=10)
    # By hand: θ̂ = θ + (Θ − θ)·0.5, g = ∇ CE at θ̂, W' = clip(0.5 − 0.7·g⊙(Θ − θ), 0, 1).
    theta = (local[0] + (glob[0] - local[0]) * 0.5).requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(x @ theta.T, y), theta)
    expected = torch.clamp(0.5 - 0.7 * g * (glob[0] - local[0]), 0, 1)
    assert torch.allclose(w[0], expected)
    assert torch.allclose(model.weight.detach(), local[0] + (glob[0] - local[0]) * expected)


def test_client_start_mixes_only_the_top_layer_and_converges_only_the_first_time(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedala", "threshold": 1e9, "num_pre_loss": 3, "rand_percent": 50})
    glob = ctx.initial_weights
    # Round 1: no local model yet, so the client starts from the global model and learns no weights.
    client_round(ctx, method, 0, 1, glob)
    ctx.store.commit(1)
    state = ctx.store.get(0)
    assert "ala_weights" not in state and "weights" in state
    local = state["weights"]
    new_glob = glob + 0.01 * torch.randn(glob.shape, generator=torch.Generator().manual_seed(0))

    forwards = []
    hook = ctx.model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    cctx = ClientContext(0, 2, ctx.data.client(0), {"weights": new_glob}, dict(state), device_data=ctx.device_data)
    start = method.client_start(cctx)
    hook.remove()
    top = method._start
    assert torch.equal(start[:top], new_glob[:top])  # the lower layers take the global model
    lo, hi = torch.minimum(local[top:], new_glob[top:]), torch.maximum(local[top:], new_glob[top:])
    assert bool(((start[top:] >= lo - 1e-6) & (start[top:] <= hi + 1e-6)).all())  # between θ and Θ
    weights = cctx.state["ala_weights"]
    assert weights.numel() == glob.numel() - top and bool(((weights >= 0) & (weights <= 1)).all())
    batches = len(method._batches(cctx))
    # The first time: until the loss std test passes, which needs more than num_pre_loss epochs.
    assert len(forwards) == (3 + 1) * batches

    forwards.clear()
    hook = ctx.model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    method.client_start(ClientContext(0, 3, ctx.data.client(0), {"weights": new_glob}, dict(cctx.state),
                                      device_data=ctx.device_data))
    hook.remove()
    assert len(forwards) == batches  # later rounds: one epoch


@pytest.mark.parametrize("global_eval", ["clients", "server"])
def test_global_accuracy_is_the_clients_mean_or_the_servers_model(tmp_path, global_eval):
    ctx, method = opened(tmp_path, {"name": "fedala", "global_eval": global_eval})
    out = method.evaluate(1, ctx.initial_weights)
    assert ("client_accuracy_min" in out) == (global_eval == "clients")


def _two_of_four_trained(ctx, method):
    uploads = []
    for cid in (0, 1):
        upload, _ = client_round(ctx, method, cid, 1, ctx.initial_weights)
        uploads.append({**upload, "client_id": cid})
    return uploads


def test_every_client_initialises_with_ala_every_round_as_the_released_server_does(tmp_path):
    """serverALA.py L45 and L90-94: each round ``send_models`` runs ``local_initialization`` (ALA) for every
    client, not only the selected ones, and L47-50 evaluates those models. Here: when round 1 is aggregated,
    every client's model is mixed with Θ_1 and kept, a client that never trained mixing the initial model
    (clientALA.py L15); a chosen client starts round 2 from it without mixing again."""
    ctx, method = opened(tmp_path, {"name": "fedala", "first_max_epochs": 2})
    assert method.params.ala_clients == "all"
    uploads = _two_of_four_trained(ctx, method)
    glob = method.aggregate(1, ctx.initial_weights, uploads)
    top = method._start
    for cid in range(4):
        state = ctx.store.get(cid, 1)
        local = uploads[cid]["weights"] if cid < 2 else ctx.initial_weights
        assert state["ala_round"] == 1 and "ala_weights" in state
        assert torch.equal(state["weights"][:top], glob[:top])  # the lower layers take Θ_1
        lo, hi = torch.minimum(local[top:], glob[top:]), torch.maximum(local[top:], glob[top:])
        assert bool(((state["weights"][top:] >= lo - 1e-6) & (state["weights"][top:] <= hi + 1e-6)).all())
        assert torch.equal(method.personal_model(1, cid, glob), state["weights"].to(glob.device))
    ctx.store.commit(1)
    state = ctx.store.get(3)
    forwards = []
    hook = ctx.model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    start = method.client_start(ClientContext(3, 2, ctx.data.client(3), {"weights": glob}, dict(state),
                                              device_data=ctx.device_data))
    hook.remove()
    assert torch.equal(start, state["weights"]) and not forwards


def test_participants_only_leaves_the_others_as_they_were(tmp_path):
    """FedDW's main.py L656-659: ALA runs inside the participants' local update only."""
    ctx, method = opened(tmp_path, {"name": "fedala", "ala_clients": "participants"})
    uploads = _two_of_four_trained(ctx, method)
    glob = method.aggregate(1, ctx.initial_weights, uploads)
    assert ctx.store.get(2, 1) == {} and "ala_round" not in ctx.store.get(0, 1)
    # A client joining in round 2 mixes the initial model it holds (FedDW's main.py L643-644; ALA.py L82 skips
    # only while the first parameters agree).
    cctx = ClientContext(2, 2, ctx.data.client(2), {"weights": glob}, {}, device_data=ctx.device_data)
    start = method.client_start(cctx)
    assert "ala_weights" in cctx.state and torch.equal(start[: method._start], glob[: method._start])


def test_every_client_needs_the_clients_on_the_server_and_no_server_optimiser(tmp_path):
    ctx, method = opened(tmp_path, {"name": "fedala"})
    uploads = _two_of_four_trained(ctx, method)
    ctx.store = type("OnClients", (), {"get": lambda self, cid, r=None: {}})()
    with pytest.raises(ConfigError, match="method.ala_clients: participants"):
        method.aggregate(1, ctx.initial_weights, uploads)
    with pytest.raises(ConfigError, match="remove server_optimizer"):
        opened(tmp_path / "opt", {"name": "fedala"}, server_optimizer={"name": "avgm"})
    opened(tmp_path / "opt2", {"name": "fedala", "ala_clients": "participants"}, server_optimizer={"name": "avgm"})


def test_feddws_preset_learns_the_weights_on_one_pass_over_the_whole_set(tmp_path):
    """FedDW's Updata.py L769 (``trainloader_w``: the client's whole set, shuffled, last batch kept) and L805
    (one pass, no convergence phase)."""
    ctx, method = opened(tmp_path, {"name": "fedala", "protocol": "feddw"})
    p = method.params
    assert (p.ala_clients, p.rand_percent, p.first_max_epochs, p.partial_batch) == ("participants", 100.0, 1, True)
    cctx = ClientContext(0, 2, ctx.data.client(0), {}, {}, device_data=ctx.device_data)
    batches = method._batches(cctx)
    n, size = len(ctx.data.client(0)), ctx.config.train.batch_size
    assert len(batches) == -(-n // size) and sum(len(y) for _, y in batches) == n
