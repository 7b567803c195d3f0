"""FedPer: base and personalisation layers train together; the top personal_layers layers stay on the client."""
import pytest
import torch

from fedguide.methods._personalise import head_span, top_layers_start
from fedguide.registry import ConfigError
from tests.methods.pfl_cases import client_round, opened


def test_layers_count_from_the_output(tmp_path):
    ctx, _ = opened(tmp_path, {"name": "fedper"})
    # The tiny MLP: encoder.1 (64·128 + 128), encoder.3 (128·64 + 64), head (64·10 + 10).
    assert top_layers_start(ctx.layout, ctx.model, 1, "k") == head_span(ctx.layout).start == 64 * 128 + 128 + 128 * 64 + 64
    assert top_layers_start(ctx.layout, ctx.model, 2, "k") == 64 * 128 + 128
    with pytest.raises(ConfigError, match="would leave no shared layer"):
        top_layers_start(ctx.layout, ctx.model, 3, "personal_layers")


@pytest.mark.parametrize("layers", [1, 2])
def test_personal_layers_stay_local_and_everything_trains(tmp_path, layers):
    ctx, method = opened(tmp_path, {"name": "fedper", "personal_layers": layers})
    start = top_layers_start(ctx.layout, ctx.model, layers, "k")
    upload, _ = client_round(ctx, method, 1, 1, ctx.initial_weights)
    assert set(upload) == {"shared", "num_samples"} and upload["shared"].numel() == start
    trained = ctx.layout.flatten(ctx.model)
    assert torch.equal(ctx.store.get(1, 1)["personal"], trained[start:])
    # Unlike FedRep, base and personal layers train in the same steps.
    assert not torch.equal(trained[:start], ctx.initial_weights[:start])
    assert not torch.equal(trained[start:], ctx.initial_weights[start:])
    glob = method.aggregate(1, ctx.initial_weights, [upload])
    assert torch.equal(glob[:start], upload["shared"]) and torch.equal(glob[start:], ctx.initial_weights[start:])
    personal = method.personal_model(1, 1, glob)
    assert torch.equal(personal, torch.cat([upload["shared"], trained[start:]]))


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_last_local_reading_scores_each_clients_model_as_its_last_training_left_it(tmp_path, name):
    """FedDW's inference_by_pFL (utils.py L248-274, called at main.py L367 and L410): the mean over every client
    of ``client.model`` on the global test set, its own trained shared part included; a client that has not
    trained holds the initial model (main.py L334-335, L377-378)."""
    ctx, method = opened(tmp_path, {"name": name, "last_local_eval": True})
    uploads = [client_round(ctx, method, cid, 1, ctx.initial_weights)[0] for cid in (0, 1)]
    trained = {cid: torch.cat([uploads[cid]["shared"], ctx.store.get(cid, 1)["personal"]]) for cid in (0, 1)}
    glob = method.aggregate(1, ctx.initial_weights, uploads)
    out = method.evaluate(1, glob)
    # By hand: four clients, two trained, two at the initial model.
    accs = [ctx.evaluator.evaluate(w)["accuracy"] for w in (trained[0], trained[1], ctx.initial_weights,
                                                           ctx.initial_weights)]
    assert out["readings"]["last_local"] == pytest.approx(sum(accs) / 4)
    # Beside, not instead: the averaged shared part with each client's own personal part.
    start = method.personal_start()
    averaged = [ctx.evaluator.evaluate(torch.cat([glob[:start], trained[c][start:]]))["accuracy"] for c in (0, 1)]
    initial = ctx.evaluator.evaluate(torch.cat([glob[:start], ctx.initial_weights[start:]]))["accuracy"]
    assert out["accuracy"] == pytest.approx((sum(averaged) + 2 * initial) / 4)
    off, plain = opened(tmp_path / "off", {"name": name})
    assert "readings" not in plain.evaluate(1, off.initial_weights)


def test_feddws_preset_turns_the_reading_on():
    from fedguide.methods.personalised.split_model.fedper import FedPerParams
    assert FedPerParams(protocol="feddw").last_local_eval and not FedPerParams().last_local_eval
