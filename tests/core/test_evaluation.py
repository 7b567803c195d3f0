"""The evaluator's CPU chunking: a test batch larger than CPU_CHUNK is computed in chunks, and every score it
reports is the one the whole batch at once gives, up to float rounding (the CPU kernels a batch size selects
may add in another order: ~1e-7 apart at odd sizes, bit-identical on the FMNIST CNN at the default 1024)."""
import pytest
import torch

from fedguide.core import evaluation
from fedguide.core.evaluation import Evaluator
from fedguide.core.weights import WeightLayout
from fedguide.models import MODELS, build_model
from fedguide.models.registry import ModelSpec


@pytest.mark.parametrize("name, shape", [("cnn", (1, 28, 28)), ("resnet10", (3, 8, 8))])
def test_chunked_cpu_evaluation_scores_what_whole_batches_score(name, shape, monkeypatch):
    torch.manual_seed(0)
    model = build_model(name, MODELS.parse_params(name, {}, "model"), ModelSpec(shape, 10))
    layout = WeightLayout.of(model)
    weights = layout.flatten(model)
    n = 3 * evaluation.CPU_CHUNK + 5  # whole chunks and a remainder; two eval batches
    x, y = torch.randn(n, *shape), torch.randint(0, 10, (n,))
    batch = 2 * evaluation.CPU_CHUNK + 3
    evaluator = Evaluator(model, layout, x, y, batch_size=batch)
    calls = []
    model.register_forward_hook(lambda mod, inp, out: calls.append(len(inp[0])))

    chunked = evaluator.evaluate(weights)
    z, logits, _ = evaluator.features(weights)
    hits = evaluator.correct(weights, torch.arange(n))
    assert max(calls) == evaluation.CPU_CHUNK  # the model never saw more than a chunk at once

    monkeypatch.setattr(evaluation, "CPU_CHUNK", 10 ** 9)  # whole batches
    calls.clear()
    whole = evaluator.evaluate(weights)
    assert whole["accuracy"] == chunked["accuracy"] and whole["test_loss"] == pytest.approx(chunked["test_loss"],
                                                                                              rel=1e-6)
    z_whole, logits_whole, _ = evaluator.features(weights)
    torch.testing.assert_close(z, z_whole, rtol=1e-5, atol=1e-5)  # in order: no chunk lost or moved
    torch.testing.assert_close(logits, logits_whole, rtol=1e-5, atol=1e-5)
    assert evaluator.correct(weights, torch.arange(n)) == hits
    assert max(calls) == batch


@pytest.mark.parametrize("name, shape", [("cnn", (1, 28, 28)), ("resnet10", (3, 8, 8))])
def test_models_sharing_an_encoder_share_one_encoder_pass_and_score_exactly_as_alone(name, shape):
    """FedRep's clients under the averaged body: within encoder_reuse each model's scores are those a whole
    forward pass gives, bit for bit, while the encoder runs once per distinct encoder (its buffers, such as
    BatchNorm's running statistics, included)."""
    torch.manual_seed(0)
    model = build_model(name, MODELS.parse_params(name, {}, "model"), ModelSpec(shape, 10))
    layout = WeightLayout.of(model)
    base = layout.flatten(model)
    head, encoder = layout.span("head."), layout.span("encoder.")
    models = []
    for i in range(3):  # three heads under one body
        w = base.clone()
        w[head] = torch.randn(head.stop - head.start)
        models.append(w)
    other_body = models[0].clone()
    other_body[encoder.stop - 1] += 0.5  # the encoder's last entry (a weight, or a BatchNorm buffer)
    models += [other_body, models[1]]
    n = 2 * evaluation.CPU_CHUNK + 7
    evaluator = Evaluator(model, layout, torch.randn(n, *shape), torch.randint(0, 10, (n,)), batch_size=200)
    alone = [evaluator.evaluate(w) for w in models]
    encoder_runs = []
    model.encoder.register_forward_hook(lambda mod, inp, out: encoder_runs.append(len(inp[0])))
    with evaluator.encoder_reuse():
        shared = [evaluator.evaluate(w) for w in models]
    assert shared == alone
    # Three encoder passes of three chunks (batches of 200 and 63 images: 128 + 72, 63): the first body for the
    # first three models, the other body, and the first again (only the last encoder's outputs are kept).
    assert encoder_runs == [128, 72, 63] * 3
    assert evaluator._reuse is None  # nothing kept after the block
