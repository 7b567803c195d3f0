"""FedDISC's released schedule (``schedule: released``) rule by rule on hand-computed numbers, against the
authors' code MingzhaoYang/FedDISC (commit f36ccf0): per-sample noising at level 500 before clustering
(client.py:11-13, sdmodel.py:73-77), Euclidean pseudo-labels (client.py:40-44), the small-class rule
(client.py:53-66), the server's domain feature as the mean of a client's centroids (server.py:110-116),
round-robin pairing (server.py:146-200), the second noising at 200 with the averaged level embedding
(server.py:168, sdmodel.py:192-220) and the unconditional base branch (server.py:170, sdmodel.py:274-285,
318-322); the option checks; runs on the tiny unCLIP pipeline (its smoke run on the embedded models is
test_feddisc.py's, beside the paper schedule's, sharing their embedded images)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedguide.core.seeding import torch_generator
from fedguide.fl.setup import open_run, prepare
from fedguide.guidance.privacy import standardised_noised_mean_privacy
from fedguide.guidance.samplers import SamplerConfig, sample
from fedguide.guidance.shared import guidance_model
from fedguide.guidance.tiny import IMAGE_EMBED
from fedguide.methods import ClientContext
from fedguide.methods.frozen_encoder.centroids._centroids import NOISE_TAG, CentroidParams
from fedguide.methods.frozen_encoder.centroids._released_schedule import (RELEASED_UPLOAD_KEYS, averaged_level_labels,
                                                                domain_from_centroids, euclidean_pseudo_labels,
                                                                noised_client_summary, plan_released,
                                                                released_conditions, round_robin_partners)
from fedguide.registry import ConfigError
from tests.tiny import run_tiny

pytestmark = pytest.mark.usefixtures("cached_digits")
FAST = {"num_centroids": 2, "images_per_centroid": 2, "steps": 2, "head_epochs": 3, "sample_grid": 2}


# ---- client ---------------------------------------------------------------------------------------------
def test_euclidean_pseudo_labels_hand_case():
    """client.py:40-44: argmin ‖f − p‖², where Eq. 3's cosine would pick another class."""
    protos = torch.tensor([[2.0, 0.0], [0.5, 0.5], [0.3, 0.1]])
    present = torch.tensor([True, True, False])
    f = torch.tensor([[0.3, 0.1], [3.0, 1.0]])
    # f0: ‖f0 − p0‖² = 1.7² + 0.1² = 2.90, ‖f0 − p1‖² = 0.2² + 0.4² = 0.20 -> class 1 (cosine: 0.949 vs 0.894 -> 0);
    #     the absent class 2 sits at distance 0 and never wins
    # f1: 1² + 1² = 2.00 against 2.5² + 0.5² = 6.50 -> class 0
    assert euclidean_pseudo_labels(f, protos, present).tolist() == [1, 0]
    from fedguide.methods.frozen_encoder._frozen_encoder import pseudo_labels
    assert pseudo_labels(f, protos, present).tolist() == [0, 0]  # the paper's Eq. 3 differs on f0


def test_small_classes_upload_their_noised_samples_and_large_ones_kmeans_means():
    """client.py:53-66 (``beta`` = 0): n_j > L -> KMeans(L) centroids; 1 ≤ n_j ≤ L -> the samples themselves;
    n_j = 0 -> nothing; nothing noised again."""
    noised = torch.tensor([[0.0, 0.0], [0.2, 0.0], [10.0, 10.0], [10.2, 10.0], [10.0, 10.4],  # class 0: 5 > L = 2
                           [4.0, -1.0], [6.0, 3.0]])  # class 2: 2 ≤ L
    labels = torch.tensor([0, 0, 0, 0, 0, 2, 2])
    up = noised_client_summary(noised, labels, 4, CentroidParams(num_centroids=2), lambda j: 0)
    assert tuple(up) == RELEASED_UPLOAD_KEYS
    assert up["centroid_labels"].tolist() == [0, 0, 2, 2] and up["pseudo_label_counts"].tolist() == [5, 0, 2, 0]
    # class 0's two clusters: mean([0,0],[0.2,0]) = [0.1, 0]; mean of the three near 10: [10.0667, 10.1333]
    got = sorted(up["centroids"][:2].tolist())
    np.testing.assert_allclose(got, [[0.1, 0.0], [10.2 / 3 + 20 / 3, 30.4 / 3]], atol=1e-5)
    assert torch.equal(up["centroids"][2:], noised[5:])  # the samples as they are


def test_client_noises_every_feature_at_level_500_before_pseudo_labels_and_kmeans(digits_config, tmp_path):
    """client.py:11-13 -> sdmodel.py:73-77: each sample's feature is noised at 500 first; here on the UNet
    schedule, z̄_i = √ᾱ_500·f_i + √(1 − ᾱ_500)·ε_i with ε drawn row by row from the client's noise stream."""
    cfg = digits_config({"name": "feddisc", **FAST, "schedule": "released", "noise_process": "unet_schedule"})
    ctx, method = open_run(prepare(cfg), tmp_path / "run")
    method.setup()
    payload = method.server_payload(1, 0, ctx.initial_weights)
    data = ctx.data.client(0)
    upload = method.client_upload(ctx.model, ClientContext(0, 1, data, payload, {}), None)
    assert set(upload) == set(RELEASED_UPLOAD_KEYS)  # no domain features: the server derives them
    feats = method.features.train(data.indices.numpy())
    alpha = float(method.features.model.alpha_bar(500))
    assert alpha != pytest.approx(float(method.features.model.alpha_bar(200)))
    eps = torch.randn(feats.shape, generator=torch_generator(cfg.seed, "client", 1, 0, NOISE_TAG))
    noised = math.sqrt(alpha) * feats + math.sqrt(1 - alpha) * eps
    dist = torch.cdist(noised.double(), payload["prototypes"].double())
    dist[:, ~payload["prototype_present"]] = float("inf")
    labels = dist.argmin(1)
    assert torch.equal(upload["pseudo_label_counts"], torch.bincount(labels, minlength=ctx.num_classes))
    expected = noised_client_summary(noised, labels, ctx.num_classes, method.params,
                                     lambda j: method.kmeans_seed(ClientContext(0, 1, data, payload, {}), j))
    torch.testing.assert_close(upload["centroids"], expected["centroids"])
    assert torch.equal(upload["centroid_labels"], expected["centroid_labels"])


# ---- server ---------------------------------------------------------------------------------------------
def test_domain_feature_is_the_mean_of_a_clients_uploaded_vectors():
    """server.py:110-116: ḡ_j = torch.mean(client_features[k][j], dim=0)."""
    up = {"centroids": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]]), "centroid_labels": torch.tensor([0, 0, 1])}
    g, held = domain_from_centroids(up, 3)
    assert torch.equal(g, torch.tensor([[2.0, 3.0], [5.0, 0.0], [0.0, 0.0]])) and held.tolist() == [True, True, False]


def test_round_robin_pairs_image_idx_with_client_idx_mod_k():
    """server.py:149-200: per class idx restarts at 0, runs client -> vector -> repeat, partner idx % K."""
    assert round_robin_partners([2, 0, 1], 2, 3) == [0, 1, 2, 0, 1, 2]
    assert round_robin_partners([1, 1], 3, 2) == [0, 1, 0, 1, 0, 1]
    # client 1 holds no class-0 vector: its turns (idx 1 and 4) generate without a domain feature (sdmodel.py:251)
    ups = [{"centroids": torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 5.0]]),
            "centroid_labels": torch.tensor([0, 0, 1])},
           {"centroids": torch.tensor([[0.0, 7.0]]), "centroid_labels": torch.tensor([1])},
           {"centroids": torch.tensor([[9.0, 9.0]]), "centroid_labels": torch.tensor([0])}]
    labels, cents, dom, who = plan_released(ups, 2, True, 2)
    assert labels.tolist() == [0] * 6 + [1] * 4
    assert cents[:6, 0].tolist() == [1.0, 1.0, 3.0, 3.0, 9.0, 9.0]  # client 0's two vectors, then client 2's
    assert who[:6].tolist() == [0, -1, 2, 0, -1, 2]
    # client 0's class-0 domain feature: mean([1,0],[3,0]) = [2, 0]; client 2's: [9, 9]; none: zero rows
    assert dom[:6].tolist() == [[2.0, 0.0], [0.0, 0.0], [9.0, 9.0], [2.0, 0.0], [0.0, 0.0], [9.0, 9.0]]
    # class 1 restarts at client 0: client 0's and client 1's vectors x 2, partners 0, 1, 2, 0; client 2 holds
    # no class-1 vector, so its turn generates without one
    assert who[6:].tolist() == [0, 1, -1, 0]
    assert dom[6:].tolist() == [[0.0, 5.0], [0.0, 7.0], [0.0, 0.0], [0.0, 5.0]]


def test_class_one_partners_without_the_class_get_no_domain_feature():
    ups = [{"centroids": torch.tensor([[0.0, 5.0]]), "centroid_labels": torch.tensor([1])},
           {"centroids": torch.tensor([[0.0, 7.0]]), "centroid_labels": torch.tensor([1])},
           {"centroids": torch.tensor([[9.0, 9.0]]), "centroid_labels": torch.tensor([0])}]
    labels, _, dom, who = plan_released(ups, 2, True, 2)
    # class 0: one vector (client 2) x 2 -> partners 0, 1: neither holds class 0
    # class 1: client 0's and client 1's vectors x 2 -> partners 0, 1, 2, 0; client 2 lacks class 1
    assert labels.tolist() == [0, 0, 1, 1, 1, 1] and who.tolist() == [-1, -1, 0, 1, -1, 0]
    assert dom.tolist() == [[0.0, 0.0], [0.0, 0.0], [0.0, 5.0], [0.0, 7.0], [0.0, 0.0], [0.0, 5.0]]
    assert plan_released(ups, 2, False, 2)[2] is None


def test_second_noising_carries_the_mean_of_the_two_level_embeddings():
    """sdmodel.py:192-218: (emb(200) + emb(500)) / 2, emb the flip-sin-to-cos sinusoid: with D = 16, half 8,
    coordinate i < 8 is cos(t·10000^(−i/8)) and coordinate 8 + i is its sin."""
    z = torch.arange(2 * IMAGE_EMBED, dtype=torch.float32).view(2, IMAGE_EMBED)
    labels = averaged_level_labels(z, 200, 500)
    assert labels.shape == (2, 2 * IMAGE_EMBED) and torch.equal(labels[:, :IMAGE_EMBED], z)
    level = labels[0, IMAGE_EMBED:].double()
    for i in (0, 1, 5):
        w = 10000 ** (-i / 8)
        assert float(level[i]) == pytest.approx((math.cos(200 * w) + math.cos(500 * w)) / 2, abs=1e-5)
        assert float(level[8 + i]) == pytest.approx((math.sin(200 * w) + math.sin(500 * w)) / 2, abs=1e-5)
    assert float(level[0]) == pytest.approx((0.4871876750070059 - 0.8838492734314780) / 2, abs=1e-5)  # cos 200, cos 500


def test_base_branch_is_the_empty_prompt_with_an_all_zero_condition(unclip_model):
    """server.py:170 (zeros_like of [embedding, level embedding]) and sdmodel.py:274-285 (negative prompt "")."""
    model = unclip_model
    prompts = ["a photo of a 1", "a photo of a 7"]
    context = model.encode_text(prompts).tokens
    empty = model.encode_text([""]).tokens.expand(2, -1, -1)
    z = torch.randn(2, IMAGE_EMBED, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, IMAGE_EMBED, generator=torch.Generator().manual_seed(2))
    held = torch.tensor([True, False])
    conds, base = released_conditions(model, context, empty, (2.0, z), (2.0, g), held, (200, 500))
    assert torch.equal(base, torch.zeros(2, 2 * IMAGE_EMBED))
    image, domain = conds
    assert torch.equal(image.context, context) and torch.equal(image.class_labels, averaged_level_labels(z, 200, 500))
    # the domain branch keeps the clients' level (500); the row whose partner lacks the class is the base's
    torch.testing.assert_close(domain.class_labels[0], model.image_condition(g[:1], 500, noised=True)[0].float().cpu())
    assert torch.equal(domain.class_labels[1], torch.zeros(2 * IMAGE_EMBED))
    assert torch.equal(domain.context[1], empty[1]) and torch.equal(domain.context[0], context[0])

    cfg = SamplerConfig(steps=2, batch_size=2, guidance_scale=1.0, progress=False)
    # ε̂ = ε(∅, 0) + w(ε(C, z̄) − ε(∅, 0)): zero weights are the unconditional pass alone ...
    zero = [type(c)(0.0, c.class_labels, c.context) for c in conds]
    uncond = sample(model, ["", ""], cfg, zero, base_class_labels=base, decode=False).latents
    plain = sample(model, ["", ""], cfg, base_class_labels=base, decode=False).latents
    assert torch.equal(uncond, plain)
    # ... which is not the paper's text-conditioned base (the class prompt, a zero embedding at level 0)
    paper_base = sample(model, prompts, cfg, decode=False).latents
    assert not torch.allclose(uncond, paper_base, atol=1e-4)
    # a partner without the class adds exactly nothing: row 1 as if there were no domain branch at all
    with_domain = sample(model, ["", ""], cfg, conds, base_class_labels=base, decode=False).latents
    conds_no_dom, _ = released_conditions(model, context, empty, (2.0, z), None, held, (200, 500))
    without = sample(model, ["", ""], cfg, conds_no_dom, base_class_labels=base, decode=False).latents
    torch.testing.assert_close(with_domain[1], without[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(with_domain[0], without[0], atol=1e-4)


# ---- options ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, match", [
    ({"schedule": "released", "cfg_scale": 2.0}, "already unconditional"),
    ({"client_noise_level": 400}, "set schedule: released"),
    ({"schedule": "released", "min_cluster_size": 3}, "belongs to the paper schedule"),
    ({"head": "model", "head_train_set": "generated_and_centroids"}, "head_train_set: generated"),
    ({"model_epochs": 3}, "set head: model"),
])
def test_options_that_do_not_go_together_are_refused(digits_config, method, match):
    with pytest.raises(ConfigError, match=match):
        prepare(digits_config({"name": "feddisc", **method}))


# ---- runs ---------------------------------------------------------------------------------------------------
class UNetInputs:
    """Every (class-label row, whether the pass's context is the empty prompt's) the UNet sees, until exit."""

    def __init__(self, model):
        self.empty = model.encode_text([""]).tokens[0]
        self.rows: list[tuple[torch.Tensor, bool]] = []
        self.handle = model.unet.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        for labels, ctx in zip(kwargs["class_labels"], kwargs["encoder_hidden_states"]):
            self.rows.append((labels.detach().float().cpu(), bool(torch.equal(ctx, self.empty.to(ctx.dtype)))))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_released_run_on_unclip(digits_config, tmp_path):
    cfg = digits_config({"name": "feddisc", **FAST, "schedule": "released"})
    model = guidance_model(cfg.guidance)
    with UNetInputs(model) as unet:
        _, (row,), run_dir = run_tiny(tmp_path, cfg)
    assert 0.0 <= row["accuracy"] <= 1.0 and row["generated_images"] > 0
    assert 0 <= row["domain_paired_images"] <= row["generated_images"]
    mean_level = averaged_level_labels(torch.zeros(1, IMAGE_EMBED), 200, 500)[0, IMAGE_EMBED:]
    levels = [lab[IMAGE_EMBED:] for lab, _ in unet.rows]
    assert any(torch.allclose(lv, mean_level, atol=1e-3) for lv in levels)  # the averaged level embedding
    # the base passes: empty prompt, all-zero condition; no pass carries the paper's level-0 embedding
    assert any(empty and not lab.any() for lab, empty in unet.rows)
    level_0 = averaged_level_labels(torch.zeros(1, IMAGE_EMBED), 0, 0)[0, IMAGE_EMBED:]
    assert not any(torch.allclose(lv, level_0, atol=1e-3) for lv in levels)
    # privacy: one noised vector per sample at level 500 of the image-noising scheduler (m = 1)
    report = json.loads((run_dir / "privacy.json").read_text())
    alpha = float(model.image_noising_scheduler.alphas_cumprod[500])
    assert report["schedule"] == "released" and report["noise_level"] == 500
    assert report["min_samples_per_vector"] == 1 and report["epsilon_upload"] == pytest.approx(report["epsilon"])
    expected = standardised_noised_mean_privacy(alpha, 4.0, report["condition_scale"], report["normalizer_std_min"],
                                                1, 1e-5)
    assert row["privacy"]["epsilon"] == pytest.approx(expected.epsilon)
