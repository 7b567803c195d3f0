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
