"""FedDISC's baselines: CLIP zero-shot, fine-tuning on the uploaded centroids, FedAvg-sm, SemiFL and RSCFed
(their pieces on hand-made cases, each end to end for one or two rounds on a tiny unCLIP pipeline)."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from fedguide.guidance.shared import class_prompts, guidance_model, guidance_pixels
from fedguide.guidance.tiny import IMAGE_EMBED
from fedguide.methods.frozen_encoder.heads._augment import strong_augment
from fedguide.methods.frozen_encoder._frozen_encoder import head_logits, new_head, train_head
from fedguide.methods.frozen_encoder.heads.rscfed import distance_reweighted, head_distance, sharpen
from fedguide.methods.frozen_encoder.heads.semifl import confident_pseudo_labels, mixup_loss
from fedguide.registry import ConfigError
from tests.tiny import run_tiny


# tiny_clip, digits_config (semi-supervised digits_domains, tiny unCLIP guidance) and cached_digits: conftest.py
pytestmark = pytest.mark.usefixtures("cached_digits")


@pytest.fixture(scope="module")
def config(digits_config):
    """conftest's digits_config with these baselines' defaults: two rounds at lr 0.05."""
    return functools.partial(digits_config, rounds=2, train={"lr": 0.05})


# ---- zero-shot ------------------------------------------------------------------------------------------
def test_zero_shot_is_the_encoders_text_image_similarity(config, tiny_clip, tmp_path):
    cfg = config({"name": "zero_shot"}, rounds=1, image_encoder=tiny_clip)
    summary, (row,), _ = run_tiny(tmp_path, cfg)
    from fedguide.fl.setup import prepare

    splits = prepare(cfg).data.splits
    encoder = guidance_model(cfg.guidance).image_encoder
    sims = encoder.zero_shot(guidance_pixels(splits, splits.test_x), class_prompts(splits.class_names))
    expected = float((sims.argmax(1) == splits.test_y).double().mean())
    assert row["accuracy"] == pytest.approx(expected)
    assert row["bytes_up"] == 0 and row["bytes_down"] == 0  # no client takes part


def test_zero_shot_needs_a_text_tower(config, tmp_path):
    # the unCLIP pipeline's own image_encoder/ is a vision tower only
    with pytest.raises(ConfigError, match="text tower"):
        run_tiny(tmp_path, config({"name": "zero_shot"}, rounds=1))


# ---- fine-tuning on the centroids ---------------------------------------------------------------------------
def test_centroid_finetune_trains_the_head_on_the_uploaded_centroids(config, tmp_path):
    cfg = config({"name": "centroid_finetune", "num_centroids": 3, "head_epochs": 20}, rounds=1)
    _, (row,), run_dir = run_tiny(tmp_path, cfg)
    assert 0 < row["train_centroids"] <= 2 * 10 * 3  # clients × classes × L
    assert math.isfinite(row["head_train_loss"]) and row["head_train_loss"] < math.log(10)  # learned the centroids
    assert row["privacy"]["min_samples_per_vector"] == 2 and (run_dir / "privacy.json").is_file()


# ---- shared head training -------------------------------------------------------------------------------------
def test_linear_head_training_fits_separable_features():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(90, 4, generator=gen) + torch.repeat_interleave(torch.eye(3, 4) * 6, 30, dim=0)
    y = torch.repeat_interleave(torch.arange(3), 30)
    head = new_head(4, 3, seed=0)
    before = float((head_logits(head, x).argmax(1) == y).float().mean())
    trained, loss = train_head(head, x, y, epochs=30, lr=0.1, batch_size=16)
    assert float((head_logits(trained, x).argmax(1) == y).float().mean()) == 1.0 > before
    assert torch.equal(new_head(4, 3, seed=0)["weight"], head["weight"])  # the input head is untouched


# ---- FedAvg-sm ---------------------------------------------------------------------------------------------
def test_fedavg_sm_runs_rounds_and_communicates_the_head(config, tmp_path):
    summary, rows, _ = run_tiny(tmp_path, config({"name": "fedavg_sm"}))
    head_bytes = (10 * IMAGE_EMBED + 10) * 4
    # down: head + prototypes + presence mask per client; up: head + two scalars per client
    assert rows[0]["bytes_down"] == 2 * (head_bytes + 10 * IMAGE_EMBED * 4 + 10)
    assert rows[0]["bytes_up"] == 2 * (head_bytes + 16)
    assert all(math.isfinite(r["client_train_loss"]) for r in rows)
    assert len(summary["accuracy_curve"]) == 2


# ---- SemiFL --------------------------------------------------------------------------------------------------
def test_semifl_pieces_hand_computed():
    logits = torch.tensor([[4.0, 0.0], [0.2, 0.0]])
    labels, mask = confident_pseudo_labels(logits, 0.95)
    # softmax([4, 0]) = [0.982, 0.018] ≥ 0.95;  softmax([0.2, 0]) = [0.550, 0.450] < 0.95
    assert labels.tolist() == [0, 0] and mask.tolist() == [True, False]
    out = torch.tensor([[1.0, 0.0]])
    lam = 0.25
    expected = lam * F.cross_entropy(out, torch.tensor([0])) + (1 - lam) * F.cross_entropy(out, torch.tensor([1]))
    assert torch.allclose(mixup_loss(out, torch.tensor([0]), torch.tensor([1]), lam), expected)


def test_semifl_runs_and_server_training_fits_the_labeled_set(config, tmp_path):
    cfg = config({"name": "semifl", "threshold": 0.3, "strong_views": 2})
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    assert len(rows) == 2 and all(r["bytes_up"] > 0 for r in rows)
    from fedguide.fl.setup import open_run, prepare

    ctx, method = open_run(prepare(cfg), tmp_path / "probe")
    method.setup()
    _, x, y = method.labeled()
    start = method.global_head()
    method.server_payload(1, 0, ctx.initial_weights)  # step 1: supervised training on the labeled set
    loss = lambda h: float(F.cross_entropy(head_logits(h, x), y))
    assert loss(method.head) < loss(start)
    # a client whose pseudo-labels are all below the threshold sits the round out (weight 0)
    method.params = method.params.model_copy(update={"threshold": 1.0})
    from fedguide.methods import ClientContext

    payload = method.server_payload(1, 0, ctx.initial_weights)
    cctx = ClientContext(0, 1, ctx.data.client(0), payload, {})
    _, trained = method.fit(ctx.model, cctx, ctx.train)
    up = method.client_upload(ctx.model, cctx, trained)
    assert up["num_samples"] == 0.0 and torch.equal(up["head_weight"], payload["head_weight"])
    assert method.server_update(1, [up]) is method.head  # nobody active: the head stays


def test_semifl_evaluates_after_its_server_training_step(config, tmp_path, monkeypatch):
    """The released code's round: clients, aggregation, supervised server training, test."""
    from fedguide.methods.frozen_encoder.heads.semifl import SemiFL

    events = []
    for name, tag in (("_supervised", "server"), ("client_train", "client"), ("server_update", "aggregate"),
                      ("evaluate", "evaluate")):
        real = getattr(SemiFL, name)

        def spy(self, *args, _real=real, _tag=tag, **kwargs):
            events.append(_tag)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(SemiFL, name, spy)
    run_tiny(tmp_path, config({"name": "semifl", "threshold": 0.3, "strong_views": 2}, rounds=2))
    # round 1 opens with its own server step; every round closes with one, before it is evaluated
    assert events == ["server", "client", "client", "aggregate", "server", "evaluate",
                      "client", "client", "aggregate", "server", "evaluate"]


# ---- RSCFed ----------------------------------------------------------------------------------------------------
def test_rscfed_pieces_hand_computed():
    p = torch.tensor([[0.6, 0.4]])
    # sharpen with T = 0.5: [0.36, 0.16] / 0.52 = [0.6923, 0.3077]
    assert torch.allclose(sharpen(p, 0.5), torch.tensor([[0.36 / 0.52, 0.16 / 0.52]]))
    a = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    b = {"weight": torch.full((2, 2), 3.0), "bias": torch.tensor([0.0, 4.0])}
    assert head_distance(a, b) == pytest.approx(6.0 + 4.0)  # ‖W‖ = √(4·9) = 6, ‖b‖ = 4
    # identical heads: distances 0, weights = sizes with the labeled party ×6 twice (base and reweighting)
    same = [dict(a), dict(a)]
    model, w = distance_reweighted(same, [10.0, 20.0], [True, False], 6.0, 100.0, 1e4)
    assert w == pytest.approx([360 / 380, 20 / 380])
    # far from the mean -> down-weighted: two unlabeled parties, the second at distance from the mean
    _, w = distance_reweighted([a, b], [1000.0, 1000.0], [False, False], 6.0, 100.0, 0.1)
    # mean = b/2, both at distance 5 -> equal weights
    assert w == pytest.approx([0.5, 0.5])
    _, w = distance_reweighted([a, a, b], [1000.0, 1000.0, 1000.0], [False, False, False], 6.0, 100.0, 100.0)
    assert w[2] < w[0] == pytest.approx(w[1])


def test_rscfed_runs_with_persistent_teachers(config, tmp_path):
    cfg = config({"name": "rscfed", "strong_views": 2, "subset_size": 2})
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    assert len(rows) == 2 and all(math.isfinite(r["client_train_loss"]) for r in rows)
    from fedguide.core.state import ClientStateStore

    state = ClientStateStore(run_dir / "client_state").get(0)
    assert state["teacher_weight"].shape == (10, IMAGE_EMBED) and state["ema_steps"] > 0


# ---- augmentation ---------------------------------------------------------------------------------------------
def test_strong_augment_is_seeded_and_keeps_shape_and_range():
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    a = strong_augment(x, torch.Generator().manual_seed(0))
    b = strong_augment(x, torch.Generator().manual_seed(0))
    c = strong_augment(x, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= -1 and a.max() <= 1 and not torch.allclose(a, x)
