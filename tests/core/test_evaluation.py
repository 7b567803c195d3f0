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
