"""SemanticFL's losses on hand-computed tensors (the KL's direction, InfoNCE with the positive in the
denominator), its visual-feature recipe, the aggregated text projection, both extraction sites and
end-to-end runs on a tiny pipeline."""
import json
import math

import numpy as np
import pytest
import torch

from fedguide.fl.checkpoint import load_checkpoint
from fedguide.fl.client_step import run_client
from fedguide.fl.setup import open_run, prepare
from fedguide.methods import ClientContext
from fedguide.methods.diffusion_guided._diffusion_features import lookup
from fedguide.methods.diffusion_guided.semanticfl import info_nce, kd_loss
from fedguide.registry import ConfigError
from tests.tiny import Crash, crash_after, run_tiny, tiny_config, without_timing

# conftest.py's fmnist_root: 80 training images (the capacity test's PCA limit), a vertical band per class;
# tiny_sd and unet_calls are conftest.py's too.
FMNIST = {"n_train": 80, "vertical": True}


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def config(tiny_sd, fmnist_root, cache, model=None, **params):
    return tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)}, "model": model or {"name": "mlp"},
                        "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)}, "train": {"rounds": 2}},
                       method={"name": "semanticfl", **params})


def finite_accuracy(summary):
    return all(math.isfinite(a) and 0 <= a <= 1 for a in summary["accuracy_curve"])


# ---- L_KD (Eq. 5) -----------------------------------------------------------------------------------
def softmax(v):
    e = [math.exp(x) for x in v]
    return [x / sum(e) for x in e]


def test_kd_is_kl_of_diffusion_to_client_distribution():
    visual, f = [2.0, 0.0, -1.0], [0.6, 0.8, 0.0]
    p, q = softmax(visual), softmax(f)
    forward = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))   # KL(softmax(z_img) ‖ softmax(f)), Eq. 5
    reverse = sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
    value = kd_loss(t([visual]), t([f])).item()
    assert value == pytest.approx(forward, rel=1e-5)
    assert abs(value - reverse) > 0.05  # the direction matters here and is the paper's


def test_kd_is_a_batch_mean_and_zero_when_equal():
    a, b = t([[1, 2, 3], [0, 0, 1]]), t([[3, 2, 1], [0, 0, 1]])
    assert kd_loss(a, b).item() == pytest.approx(kd_loss(a[:1], b[:1]).item() / 2, rel=1e-5)
    assert kd_loss(a, a).item() == pytest.approx(0.0, abs=1e-7)


def test_kd_normalized_form_hand_computed():
    visual, f = [3.0, 4.0], [0.6, 0.0]
    tau = 0.5
    v_hat = [x / 5.0 / tau for x in visual]             # (0.6, 0.8) / τ
    q_in = [x / tau for x in f]
    p = [math.exp(x) / sum(math.exp(y) for y in v_hat) for x in v_hat]
    q = [math.exp(x) / sum(math.exp(y) for y in q_in) for x in q_in]
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert kd_loss(t([visual]), t([f]), "normalized", tau).item() == pytest.approx(want, rel=1e-5)
    # scale-free in the visual features, unlike Eq. 5 raw
    assert kd_loss(t([[30.0, 40.0]]), t([f]), "normalized", tau).item() == pytest.approx(want, rel=1e-5)
    assert kd_loss(t([[30.0, 40.0]]), t([f])).item() != pytest.approx(kd_loss(t([visual]), t([f])).item(), rel=1e-3)


# ---- L_CON (Eq. 6) ----------------------------------------------------------------------------------
def test_info_nce_keeps_the_positive_in_the_denominator():
    f = t([[1, 0]])
    text = t([[1, 0], [0, 2], [-3, 0]])  # cosines 1, 0, -1
    tau = 0.5
    pos, negs = 1 / tau, [0 / tau, -1 / tau]
    want = -math.log(math.exp(pos) / (math.exp(pos) + sum(math.exp(n) for n in negs)))
    assert info_nce(f, text, torch.tensor([0]), tau).item() == pytest.approx(want, rel=1e-4)
    assert want == pytest.approx(math.log(1 + math.exp(-2) + math.exp(-4)))
    without_positive = -math.log(math.exp(pos) / sum(math.exp(n) for n in negs))
    assert without_positive < 0 < info_nce(f, text, torch.tensor([0]), tau).item()
    # Label 1: the positive is the orthogonal prompt.
    pos1 = 0 / tau
    want1 = -math.log(math.exp(pos1) / (math.exp(1 / tau) + math.exp(pos1) + math.exp(-1 / tau)))
    assert info_nce(f, text, torch.tensor([1]), tau).item() == pytest.approx(want1, rel=1e-4)


def test_info_nce_uses_cosine_similarity():
    text = t([[1, 1], [1, -1]])
    assert info_nce(t([[5, 5]]), text, torch.tensor([0]), 0.5).item() == pytest.approx(
        info_nce(t([[1, 1]]), 3 * text, torch.tensor([0]), 0.5).item(), rel=1e-6)


# ---- end to end ----------------------------------------------------------------------------------------
def test_runs_end_to_end_with_the_documented_feature_shapes(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache")
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    assert len(rows) == 2 and finite_accuracy(summary)
    record = json.loads((run_dir / "guidance" / "semanticfl.json").read_text())
    n = len(np.unique(np.concatenate(prepare(cfg).data.client_indices)))
    assert record["visual_features"]["shape"] == [n, 64]  # [samples, z's dim]
    assert record["images_reach_server"] is True and record["extraction_site"] == "server"
    # Stage 1: the data's own 28 px (7x7 latents on the VAE's factor 4), not the pipeline's 32
    assert record["image_size"] == {"requested": "paper", "pixels": 28, "latents": 7, "pipeline_pixels": 32}
    from fedguide.guidance.shared import guidance_model
    from fedguide.guidance.timesteps import paper_matched_t

    alphas = guidance_model(cfg.guidance).noise_scheduler.alphas_cumprod
    assert record["t"]["option"] == "paper" and record["t"]["resolved"] == paper_matched_t(alphas, 7 * 7)
    assert (run_dir / "guidance" / "semanticfl.safetensors").is_file()
    # The learned projection [d, text hidden] is server state, checkpointed with the weights.
    assert load_checkpoint(run_dir / "checkpoints").method_state["text_proj"].shape == (64, 32)


def method_for(cfg, run_dir):
    """The run context and the set-up method of ``cfg``, without running rounds."""
    ctx, method = open_run(prepare(cfg), run_dir)
    method.setup()
    return ctx, method


def test_learned_projection_is_sent_trained_and_averaged(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", kd=False, lambda_con=1.0)
    ctx, method = method_for(cfg, tmp_path / "run")
    start = method.proj.clone()
    assert start.shape == (64, 32)  # [z's dim, text hidden size]
    assert torch.equal(method.server_payload(1, 0, ctx.initial_weights)["text_proj"], start)
    results = [run_client(ctx, method, cfg.train, cfg.seed, 1, cid, method.server_payload(1, cid, ctx.initial_weights))
               for cid in (0, 1)]
    trained = [r.upload["text_proj"] for r in results]
    assert not torch.equal(trained[0], start)  # trained locally with the encoder
    n = [r.num_samples for r in results]
    method.aggregate(1, ctx.initial_weights, [{**r.upload, "client_id": r.client_id} for r in results])
    torch.testing.assert_close(method.proj, (n[0] * trained[0] + n[1] * trained[1]) / (n[0] + n[1]))


def test_fixed_projection_is_neither_sent_nor_trained(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", kd=False, text_projection="fixed")
    summary, rows, _ = run_tiny(tmp_path, cfg)
    assert finite_accuracy(summary)
    _, plain, _ = run_tiny(tmp_path, config(tiny_sd, fmnist_root, tmp_path / "cache", kd=False, con=False), name="ce")
    assert rows[0]["bytes_down"] == plain[0]["bytes_down"]  # no projection on the wire


def test_client_extraction_gives_the_server_numbers(tmp_path, tiny_sd, fmnist_root):
    cache = tmp_path / "cache"
    ctx, server = method_for(config(tiny_sd, fmnist_root, cache), tmp_path / "server")
    _, client = method_for(config(tiny_sd, fmnist_root, cache, extraction_site="client"), tmp_path / "client")
    cctx = ClientContext(2, 1, ctx.data.client(2), server.server_payload(1, 2, ctx.initial_weights), {})
    state = client.begin_local(ctx.model, cctx)
    idx = ctx.data.client(2).indices.numpy()
    cctx.batch_indices = torch.as_tensor(idx)
    features = state.visual(cctx)  # the client's rows, in its sample order
    assert features.shape == (len(idx), 64)  # the client's own samples only
    torch.testing.assert_close(features, lookup(server._visual, server._rows(idx)), atol=1e-5, rtol=1e-4)
    summary, metrics, run_dir = run_tiny(tmp_path, config(tiny_sd, fmnist_root, cache, extraction_site="client"))
    assert finite_accuracy(summary) and all("extract_seconds" in r for r in metrics)
    record = json.loads((run_dir / "guidance" / "semanticfl.json").read_text())
    assert "visual_features" not in record and "images_reach_server" not in record


def test_features_are_computed_once(tmp_path, tiny_sd, fmnist_root, unet_calls):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache")
    with unet_calls() as first:
        _, rows_a, _ = run_tiny(tmp_path, cfg, name="a")
    with unet_calls() as second:
        _, rows_b, _ = run_tiny(tmp_path, cfg, name="b")
    assert first.calls > 0 and second.calls == 0
    assert [r["accuracy"] for r in rows_a] == [r["accuracy"] for r in rows_b]


def test_capacity_error_names_the_fix(tmp_path, tiny_sd, fmnist_root):
    # 80 training images cannot fit a PCA to 128 dims.
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", model={"name": "mlp", "feature_dim": 128})
    with pytest.raises(ConfigError, match=r"fitted on 80 images.*model.feature_dim=80"):
        run_tiny(tmp_path, cfg)
    # The tiny UNet's mid block has 64 channels.
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", model={"name": "mlp", "feature_dim": 65}, layers=["mid"])
    with pytest.raises(ConfigError, match=r"give 64 features.*model.feature_dim=64"):
        run_tiny(tmp_path, cfg, name="mid")


def test_resume_restores_the_learned_projection(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache")
    cfg.train.rounds = 3
    _, reference, _ = run_tiny(tmp_path, cfg, name="reference")
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, name="crashed", log=crash_after(1))
    _, resumed, _ = run_tiny(tmp_path, cfg, name="crashed", resume=True)
    assert without_timing(resumed) == without_timing(reference)
