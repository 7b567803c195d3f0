"""FedDifRC's losses on hand-computed tensors, its feature recipes, the once-per-round condition refresh,
features computed once, and end-to-end runs (with the Table 8 alignment baseline) on a tiny pipeline."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedguide.config import GuidanceConfig, to_yaml
from fedguide.fl.setup import open_run, prepare
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec
from fedguide.guidance.shared import guidance_model
from fedguide.guidance.fused import FusedFeatures
from fedguide.methods.diffusion_guided._diffusion_features import RowLookup, prompt_maps, prompt_vectors
from fedguide.methods.diffusion_guided.align_features import alignment_loss
from fedguide.methods.diffusion_guided.feddifrc import (linear_probe, max_halving_dim, ndcr_loss, orthonormal_lift, tdcl_loss,
                                       tdcl_similarity)
from fedguide.registry import ConfigError
from tests.tiny import Crash, crash_after, run_tiny, tiny_config, without_timing

CLASSES = 10
# tiny_sd, sd_model, unet_calls and fmnist_root (60 training images, horizontal bands): conftest.py


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def config(tiny_sd, fmnist_root, cache, method="feddifrc", model=None, **params):
    if method == "feddifrc":  # the pipeline's 32 px: the paper's 224 px is 49 times the UNet work on a CPU
        params.setdefault("image_size", "pipeline")
    return tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)}, "model": model or {"name": "mlp"},
                        "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)}, "train": {"rounds": 2}},
                       method={"name": method, **params})


# ---- TDCL (Eq. 10-11) ------------------------------------------------------------------------------
def test_tdcl_hand_computed():
    z = t([[1, 0], [0, 2]])
    targets = t([[[1, 1], [0, 1]],        # sample 0: positive (1, 1), negative (0, 1)
                 [[1, 0], [0, 3]]])       # sample 1: negative (1, 0), positive (0, 3)
    positive = torch.tensor([0, 1])
    tau = 0.5

    def spread(f):  # U = mean over the batch's z_m of ‖z_m − F‖
        return (math.dist((1, 0), f) + math.dist((0, 2), f)) / 2

    def s(zi, f):
        cos = (zi[0] * f[0] + zi[1] * f[1]) / (math.hypot(*zi) * math.hypot(*f))
        return cos / spread(f)

    loss0 = math.log(1 + math.exp(s((1, 0), (0, 1)) / tau) / math.exp(s((1, 0), (1, 1)) / tau))
    loss1 = math.log(1 + math.exp(s((0, 2), (1, 0)) / tau) / math.exp(s((0, 2), (0, 3)) / tau))
    assert tdcl_loss(z, targets, positive, tau).item() == pytest.approx((loss0 + loss1) / 2, rel=1e-5)
    # U of sample 0's positive (1, 1): (‖(0,-1)‖ + ‖(-1,1)‖) / 2 = (1 + √2) / 2, so s = cos 45° / U.
    want = math.sqrt(0.5) / ((1 + math.sqrt(2)) / 2)
    assert tdcl_similarity(z, targets)[0, 0].item() == pytest.approx(want, rel=1e-5)


def test_tdcl_normalized_spread_hand_computed_and_scale_free():
    z = t([[1, 0], [0, 2]])
    targets = t([[[1, 1], [0, 1]], [[1, 0], [0, 3]]])
    # Unit vectors: z -> (1, 0), (0, 1); sample 0's positive (1, 1) -> (√½, √½).
    # U = (‖(1 − √½, −√½)‖ + ‖(−√½, 1 − √½)‖) / 2 = √(2 − √2); s = cos 45° / U.
    want = math.sqrt(0.5) / math.sqrt(2 - math.sqrt(2))
    assert tdcl_similarity(z, targets, "normalized")[0, 0].item() == pytest.approx(want, rel=1e-5)
    positive = torch.tensor([0, 1])
    scaled = tdcl_loss(10 * z, 0.1 * targets, positive, 0.5, "normalized")
    assert scaled.item() == pytest.approx(tdcl_loss(z, targets, positive, 0.5, "normalized").item(), rel=1e-5)
    assert tdcl_loss(10 * z, targets, positive, 0.5).item() != pytest.approx(
        tdcl_loss(z, targets, positive, 0.5).item(), rel=1e-3)  # the literal U depends on the scales


def test_tdcl_spread_is_detached():
    torch.manual_seed(0)
    z = torch.randn(6, 5, requires_grad=True)
    targets, positive = torch.randn(6, 4, 5), torch.randint(0, 4, (6,))
    tdcl_loss(z, targets, positive, 0.06).backward()
    spread = torch.cdist(targets.reshape(24, 5), z.detach()).mean(1).reshape(6, 4)  # a constant
    z2 = z.detach().clone().requires_grad_(True)
    logits = F.cosine_similarity(z2.unsqueeze(1), targets, dim=-1) / spread / 0.06
    F.cross_entropy(logits, positive).backward()
    torch.testing.assert_close(z.grad, z2.grad)


def test_tdcl_pulls_to_positive_and_pushes_from_negatives():
    torch.manual_seed(1)
    z = torch.randn(8, 6, requires_grad=True)
    targets = torch.randn(8, 3, 6)
    positive = torch.zeros(8, dtype=torch.long)
    tdcl_loss(z, targets, positive, 0.06).backward()
    with torch.no_grad():
        stepped = z - 0.01 * z.grad
        before = F.cosine_similarity(z.unsqueeze(1), targets, dim=-1)
        after = F.cosine_similarity(stepped.unsqueeze(1), targets, dim=-1)
    assert (after[:, 0] > before[:, 0]).all()
    assert (after[:, 1:].sum(1) < before[:, 1:].sum(1)).all()


# ---- NDCR (Eq. 12) ---------------------------------------------------------------------------------
def test_ndcr_three_forms_hand_computed():
    z, h = t([[3, 4]]), t([[4, 3]])
    assert ndcr_loss(z, h, "mse_raw").item() == pytest.approx(2.0)               # (3-4)² + (4-3)²
    assert ndcr_loss(z, h, "mse_normalized").item() == pytest.approx(0.08)      # (.6-.8)² + (.8-.6)²
    p = [math.exp(0.8) / (math.exp(0.8) + math.exp(0.6)), math.exp(0.6) / (math.exp(0.8) + math.exp(0.6))]
    q = p[::-1]  # softmax of ẑ = (.6, .8)
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))  # KL(softmax(Ĥ) ‖ softmax(ẑ))
    assert ndcr_loss(z, h, "kl").item() == pytest.approx(kl, rel=1e-5)


def test_ndcr_is_a_batch_mean_of_per_sample_sums():
    z, h = t([[1, 0], [0, 0]]), t([[0, 0], [2, 2]])
    assert ndcr_loss(z, h, "mse_raw").item() == pytest.approx((1 + 8) / 2)
    with pytest.raises(ConfigError):
        ndcr_loss(z, h, "l1")


def test_lift_keeps_norms_and_cosines():
    lift = orthonormal_lift(4, 9, seed=3)
    x = torch.randn(5, 4)
    y = x @ lift.T
    assert y.shape == (5, 9)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1))
    torch.testing.assert_close(F.cosine_similarity(y[0:1], y[1:]), F.cosine_similarity(x[0:1], x[1:]))
    assert torch.equal(lift, orthonormal_lift(4, 9, seed=3))


@pytest.mark.parametrize("spread", ["raw", "normalized"])
def test_tdcl_with_a_lift_equals_tdcl_on_lifted_targets(spread):
    # TDCL takes the lift instead of lifted targets (cheaper per batch); values and gradients must be
    # those of the explicit lift.
    gen = torch.Generator().manual_seed(0)
    lift = orthonormal_lift(6, 16, seed=1).double()
    targets = torch.randn(5, 3, 6, generator=gen, dtype=torch.float64)
    positive = torch.tensor([0, 2, 1, 1, 0])
    z = torch.randn(5, 16, generator=gen, dtype=torch.float64).requires_grad_()
    torch.testing.assert_close(tdcl_similarity(z, targets, spread, lift), tdcl_similarity(z, targets @ lift.T, spread))
    implicit = tdcl_loss(z, targets, positive, 0.1, spread, lift)
    explicit = tdcl_loss(z, targets @ lift.T, positive, 0.1, spread)
    torch.testing.assert_close(implicit, explicit)
    torch.testing.assert_close(torch.autograd.grad(implicit, z)[0], torch.autograd.grad(explicit, z)[0])


def test_max_halving_dim():
    assert max_halving_dim([64, 32, 32], 512) == 128   # tiny decoder layers 2-4: 64/32/32
    assert max_halving_dim([128, 128, 64], 512) == 256  # the embedded UNet's
    assert max_halving_dim([64], 48) == 48


def test_row_lookup():
    rows = RowLookup(np.array([7, 2, 9]))
    assert rows(torch.tensor([9, 7, 7, 2])).tolist() == [2, 0, 0, 1]
    with pytest.raises(RuntimeError, match="no precomputed features"):
        rows(torch.tensor([3]))


def test_linear_probe_separates_separable_features():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-3, 1, (30, 4)), rng.normal(3, 1, (30, 4))])
    y = np.repeat([0, 1], 30)
    assert linear_probe(x, y, x, y) == 1.0


# ---- feature recipes ---------------------------------------------------------------------------------
LAYERS = ("up.1", "up.2", "up.3")  # decoder layers L = 2, 3, 4


def test_prompt_vectors_shapes_and_agreement(sd_model):
    images = torch.rand(12, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    prompts = [f"a photo of a {c}" for c in ("cat", "dog", "bird")]
    recipe = FusedFeatures(LAYERS, d=64, samples_per_image=8)
    feats = DiffusionFeatures(sd_model, FeatureSpec(LAYERS, t=150), recipe)
    feats.fit(images, [prompts[i % 3] for i in range(12)], np.arange(12))
    assert recipe.dims == [32, 16, 16]  # d/2, d/4, d/4
    tokens = sd_model.encode_text(tuple(prompts)).tokens
    every = prompt_vectors(feats, images[:4], np.arange(4), tokens, torch.arange(3).expand(4, -1))
    assert every.shape == (4, 3, 64)  # one fused vector per image and prompt
    # Each pair agrees with the guidance layer's one-prompt-per-image path (same noise per sample index).
    alone = feats(images[:4], [prompts[1]] * 4, np.arange(4))
    torch.testing.assert_close(every[:, 1], alone, atol=1e-4, rtol=1e-4)


# ---- end to end ----------------------------------------------------------------------------------------
def finite_accuracy(summary):
    return all(math.isfinite(a) and 0 <= a <= 1 for a in summary["accuracy_curve"])


def test_runs_end_to_end_and_records_its_setup(tmp_path, tiny_sd, fmnist_root):
    summary, rows, run_dir = run_tiny(tmp_path, config(tiny_sd, fmnist_root, tmp_path / "cache"))
    assert len(rows) == 2 and finite_accuracy(summary)
    record = json.loads((run_dir / "guidance" / "feddifrc.json").read_text())
    n = len(np.unique(np.concatenate(prepare(config(tiny_sd, fmnist_root, tmp_path / "c")).data.client_indices)))
    assert record["tdcl_features"]["shape"] == [n, CLASSES, 64]  # every sample x every class prompt x d
    assert record["ndcr_features"]["shape"] == [n, 64]
    assert "seeded sample of the clients' training images" in record["basis_fit"]
    assert record["image_size"] == {"requested": "pipeline", "pixels": 32, "latents": 8, "pipeline_pixels": 32}
    # t: paper matched to 8 x 8 latents (guidance/timesteps.py), recorded with its rule
    from fedguide.guidance.timesteps import RULE, paper_matched_t
    from fedguide.guidance.shared import guidance_model

    alphas = guidance_model(config(tiny_sd, fmnist_root, tmp_path / "c").guidance).noise_scheduler.alphas_cumprod
    assert record["ndcr_t"] == {"option": "paper", "resolved": paper_matched_t(alphas, 64), "rule": RULE}
    assert (run_dir / "guidance" / "feddifrc_tdcl.safetensors").is_file()
    assert (run_dir / "guidance" / "feddifrc_ndcr.safetensors").is_file()


def test_input_size_defaults_to_the_papers_and_a_size_the_vae_cannot_take_is_refused_by_dry_run(
        tmp_path, tiny_sd, fmnist_root, capsys):
    from fedguide.cli import main

    _, method = open_run(prepare(config(tiny_sd, fmnist_root, tmp_path / "c", image_size="paper")), tmp_path / "a")
    assert method.image_size == 224  # Sec. 4.1, on a pipeline that is not one of fedguide's 32-px models
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(config(tiny_sd, fmnist_root, tmp_path / "c", image_size=30)))
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "method.image_size=30: the pipeline's VAE downsamples by 4" in err and "use 28 or 32" in err


def test_embedded_models_give_the_features_they_gave_before_the_size_option(tmp_path, fmnist_root):
    # The methods' default on the embedded models (28-px Fashion-MNIST) resolves to their own 32 px, and the
    # features made at the resolved size are bit for bit those of the path without a size (the code before).
    embedded = {"guidance": {"model": "embedded", "feature_cache": str(tmp_path / "c")}}
    for method in ({"name": "feddifrc", "fused_dim": 32}, {"name": "semanticfl"}):
        cfg = tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)}, **embedded,
                           "model": {"name": "mlp", "feature_dim": 32}}, method=method)
        _, built = open_run(prepare(cfg), tmp_path / method["name"])
        assert built.image_size == 32
    model = guidance_model(GuidanceConfig(model="embedded"))
    images = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1
    tokens = model.encode_text(("a photo of a 1", "a photo of a 2")).tokens
    for t_ in (0, 150):
        before, after = (prompt_maps(DiffusionFeatures(model, FeatureSpec(LAYERS, t=t_, image_size=size)), images,
                                     np.arange(3), tokens, torch.tensor([[0, 1]] * 3)) for size in (None, 32))
        assert all(torch.equal(before[k], after[k]) for k in LAYERS)


def test_features_are_computed_once(tmp_path, tiny_sd, fmnist_root, unet_calls):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache")
    with unet_calls() as first:
        _, rows_a, _ = run_tiny(tmp_path, cfg, name="a")
    with unet_calls() as second:
        _, rows_b, _ = run_tiny(tmp_path, cfg, name="b")
    assert first.calls > 0 and second.calls == 0  # bases and features came from the cache
    assert [r["accuracy"] for r in rows_a] == [r["accuracy"] for r in rows_b]


def test_public_pool_fits_the_bases(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", ndcr=False)
    cfg.data.public_fraction = 0.2
    _, _, run_dir = run_tiny(tmp_path, cfg)
    assert "public pool" in json.loads((run_dir / "guidance" / "feddifrc.json").read_text())["basis_fit"]


def test_condition_refresh_round_runs_once_per_round_per_client(tmp_path, tiny_sd, fmnist_root, unet_calls):
    params = {"condition_refresh": "round", "condition_mode": "append", "extract_batch": 8, "ndcr": False}
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", **params)
    cfg.train.epochs = 2  # several epochs, still one refresh per round
    run_tiny(tmp_path, cfg, name="warm")  # the basis into the cache
    with unet_calls() as counted:
        summary, rows, _ = run_tiny(tmp_path, cfg, name="counted")
    sizes = [len(idx) for idx in prepare(cfg).data.client_indices]
    expected_images = sum(sizes[c] * CLASSES for r in rows for c in r["clients"])
    expected_calls = sum(math.ceil(sizes[c] / 8) for r in rows for c in r["clients"])
    assert counted.images == expected_images and counted.calls == expected_calls
    assert [r["condition_unet_images"] for r in rows] == [sum(sizes[c] * CLASSES for c in r["clients"]) for r in rows]
    assert all(r["condition_seconds"] > 0 for r in rows) and finite_accuracy(summary)


def test_condition_refresh_every_k_reuses_a_clients_refresh(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", condition_refresh="every_k", refresh_every=2, ndcr=False)
    cfg.train.rounds = 3
    cfg.clients.per_round = 4
    _, rows, _ = run_tiny(tmp_path, cfg)
    sizes = [len(idx) for idx in prepare(cfg).data.client_indices]
    refreshed = [r["condition_unet_images"] for r in rows]
    assert refreshed == [sum(sizes) * CLASSES, 0, sum(sizes) * CLASSES]  # rounds 1 and 3 (age 2), not 2


def test_capacity_error_names_the_fix(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", model={"name": "mlp", "feature_dim": 256}, fused_dim=None)
    with pytest.raises(ConfigError, match=r"method.fused_dim=128"):
        run_tiny(tmp_path, cfg)


def test_auto_fused_dim_lifts_a_single_layer(tmp_path, tiny_sd, fmnist_root):
    # Table 2's single layer L = 3 (up.2, 32 channels) for a z of 96 dims: 32 fused dims, lifted.
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", model={"name": "mlp", "feature_dim": 96},
                 fused_dim="auto", layers=[3])
    summary, _, run_dir = run_tiny(tmp_path, cfg)
    assert finite_accuracy(summary)
    record = json.loads((run_dir / "guidance" / "feddifrc.json").read_text())
    assert record["fused_dim"] == 32 and record["ndcr_features"]["shape"][1] == 32


def test_self_supervised_variant_reports_a_probe(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", self_supervised=True, negatives=3)
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    assert finite_accuracy(summary)
    assert all(r["probe_accuracy"] == r["accuracy"] for r in rows)
    record = json.loads((run_dir / "guidance" / "feddifrc.json").read_text())
    assert record["tdcl_features"]["shape"][1] == 4  # "a similar object" + 3 vocabulary names


def test_align_features_baseline(tmp_path, tiny_sd, fmnist_root):
    assert alignment_loss(t([[3, 4]]), t([[0, 0]])).item() == pytest.approx(25.0)
    assert alignment_loss(t([[3, 4]]), t([[4, -3]]), normalize=True).item() == pytest.approx(2.0)
    summary, _, run_dir = run_tiny(tmp_path, config(tiny_sd, fmnist_root, tmp_path / "cache", method="align_features"))
    assert finite_accuracy(summary)
    assert json.loads((run_dir / "guidance" / "align_features.json").read_text())["image_features"]["shape"][1] == 16


def test_resume_keeps_each_clients_refresh(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", condition_refresh="every_k", refresh_every=2, ndcr=False)
    cfg.train.rounds = 3
    _, reference, _ = run_tiny(tmp_path, cfg, name="reference")
    with pytest.raises(Crash):
        run_tiny(tmp_path, cfg, name="crashed", log=crash_after(1))
    _, resumed, _ = run_tiny(tmp_path, cfg, name="crashed", resume=True)
    strip = [{k: v for k, v in r.items() if k != "condition_seconds"} for r in without_timing(resumed)]
    assert strip == [{k: v for k, v in r.items() if k != "condition_seconds"} for r in without_timing(reference)]
