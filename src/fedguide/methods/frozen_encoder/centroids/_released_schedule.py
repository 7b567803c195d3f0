"""FedDISC's released schedule (``method.schedule: released``), the pieces that differ from the paper's
Eq. 3-7, as the authors' code MingzhaoYang/FedDISC (commit f36ccf0) runs them with crosssilo.py's defaults.

Client (client.py, with sdmodel.py's ``ClientImageEncoder``):
- Every sample's embedding is noised on its own before anything else: ``Client(..., noise_level=500)``
  (client.py:11) builds ``ClientTune(classes, 500)`` (client.py:13), whose encoder noises each image
  embedding at level 500 (sdmodel.py:73-77 -> ``noise_image_embeddings`` sdmodel.py:81-123: normaliser
  ``scale``, ``image_noising_scheduler.add_noise``, ``unscale``, then the level's sinusoidal embedding
  appended). Here: the run's noise process (_feature_noise.py) at ``client_noise_level`` (500) on every
  feature, one ε row per sample, in the client's sample order.
- Pseudo-labels by Euclidean distance of the noised features to the prototypes (client.py:40-44,
  ``argmin`` of ‖f‖² − 2 f·p + ‖p‖²), not Eq. 3's cosine. The appended level embeddings differ between the
  clients' features (level 500) and the server's prototypes (level 0, sdmodel.py:264 via server.py:256) by
  the same vector for every pair, which adds one constant to every distance: the argmin is that of the
  embeddings alone, the distance used here.
- Per pseudo-class j with n_j samples (client.py:49-66): n_j > L: ``KMeans(n_clusters=L)`` on the noised
  features (client.py:58), the centroids uploaded as they are (``beta`` = 0 in crosssilo.py:34, 95: no
  further noise); 1 ≤ n_j ≤ L: the n_j noised features themselves (client.py:65-66); n_j = 0: nothing.
  So every vector is one sample's noised feature or a mean of noised features, whatever size its
  cluster has: ``min_cluster_size`` is the paper schedule's and is refused beside ``schedule: released``.
- No domain feature is computed by the client: the released upload is the per-class dictionary of
  centroids (client.py:48-85). Here the upload holds ``centroids``, ``centroid_labels`` and
  ``pseudo_label_counts`` (the counts, as the paper schedule uploads them; the released dictionary shows
  only which classes are present).

Server (server.py, sdmodel.py's ``ImageGenerator``):
- The domain feature of client k and class j is the plain mean of the vectors client k uploaded for j
  (``__aggregation_fea__``, server.py:110-116), not a mean over the client's samples.
- Pairing, round robin (server.py:146-200): per class j a counter ``idx`` starts at 0 (server.py:149)
  and runs over every image of the class in the order client -> its vectors of j -> the R repeats
  (server.py:150-158); image ``idx`` takes the domain feature of client ``idx mod K`` (server.py:162),
  K the number of clients, and ``idx`` grows by one per image (server.py:200). Where that client uploaded
  nothing for j (its ``global_features`` entry is ``None``) the image is generated without a domain
  feature (sdmodel.py:251, 310, 320-326: two branches instead of three), which is what is done here: the
  released code does not skip to a client that holds the class, as the paper's Eq. 6 draw would.
- The centroid is noised a second time, per image (inside the repeat loop, server.py:158-168), at level
  200 (``noise_image_embeddings(imgfea, noise_level=200)``, server.py:168), and its level embedding is
  the mean of level 200's and the one it carried from the client, level 500's
  (``(noise_level + timefea) / 2``, sdmodel.py:192-194, 210-218). The domain feature is not noised again
  and keeps level 500's embedding (the mean of vectors that all carry it). Here the second level is
  ``noise_level`` (200, the paper's n), on the run's noise process; the level embeddings are unCLIP
  inputs, so a token-conditioned model (the embedded one) or ``noise_process: unet_schedule`` gets the
  twice-noised embedding and no level.
- The base branch is unconditional: the empty prompt (``_encode_prompt`` with classifier-free guidance
  on, its negative prompt "" first, sdmodel.py:274-282) with an all-zero class-label row, embedding and
  level embedding alike (``torch.zeros_like(input_fea)``, server.py:170); the image branch is the class
  prompt with the twice-noised centroid, the domain branch the class prompt with the domain feature
  (``prompt_embeds[1]``, sdmodel.py:284-285). ε̂ = ε(∅, 0) + w(ε(C, z̄) − ε(∅, 0)) + w(ε(C, ḡ) − ε(∅, 0)),
  w = ``guidance_scale`` = 2 (sdmodel.py:234, 318-322): FedDISC's w_f = w_g = 2 on an unconditional base,
  where the paper's Eq. 7 writes the text-conditioned ε(C).

Where this module leaves the released code, and why:
- The server's prototypes are class means of clean features; the released server noises its labeled
  images' embeddings at level 0 (server.py:32, 256-264), which on SD-2.1-unCLIP's squaredcos schedule is
  noise of standard deviation √(1 − ᾱ_0) ≈ 0.006 on the standardised embedding, then averaged away.
- k-means keeps this module's seeding and ``kmeans_n_init`` (scikit-learn's ``max_iter`` 300); the released
  ``KMeans(n_clusters=5, max_iter=100)`` is unseeded.
- Images are not dropped by a safety checker (the released code skips NSFW-flagged images,
  server.py:185, while still counting them in ``idx``); prompts follow ``method.prompt`` (the released
  code prompts with the bare class name: ``prompt: "{}"``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fedguide.methods.frozen_encoder.centroids._centroids import CentroidParams, cluster_centroids, random_members
from fedguide.registry import ConfigError

RELEASED_UPLOAD_KEYS = ("centroids", "centroid_labels", "pseudo_label_counts")
CLIENT_NOISE_LEVEL = 500  # client.py:11


def euclidean_pseudo_labels(features: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """client.py:40-44: argmin_j ‖f − p_j‖² over the classes that have a prototype (ties: the lowest j)."""
    f, p = features.double(), prototypes.double()
    dist = (f * f).sum(1, keepdim=True) - 2 * f @ p.T + (p * p).sum(1)[None]
    return dist.masked_fill(~present.bool()[None], float("inf")).argmin(1)


def noised_client_summary(noised: torch.Tensor, labels: torch.Tensor, num_classes: int, params: CentroidParams,
                          class_seed) -> dict[str, torch.Tensor]:
    """client.py:49-66 on features already noised one by one: per class, k = min(L, n_j) vectors, each the
    mean of its k-means cluster (n_j > L) or a sample itself (n_j ≤ L); nothing is noised here."""
    feats = noised.detach().float().numpy()
    labels = labels.long()
    counts = torch.bincount(labels, minlength=num_classes)
    rows, row_labels = [], []
    for j in range(num_classes):
        members = feats[(labels == j).numpy()]
        if len(members) == 0:
            continue
        if params.random_centroids:
            vectors = random_members(members, params.num_centroids, class_seed(j))
        elif len(members) <= params.num_centroids:  # client.py:65-66: the samples, in their order
            vectors = members
        else:  # client.py:58: KMeans(n_clusters=L)
            vectors, _ = cluster_centroids(members, params.num_centroids, 1, class_seed(j), params.kmeans_n_init)
        rows.append(torch.from_numpy(vectors))
        row_labels.append(torch.full((len(vectors),), j, dtype=torch.int64))
    dim = noised.shape[1]
    return {"centroids": torch.cat(rows) if rows else torch.empty(0, dim),
            "centroid_labels": torch.cat(row_labels) if row_labels else torch.empty(0, dtype=torch.int64),
            "pseudo_label_counts": counts}


def domain_from_centroids(upload: dict, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """server.py:110-116: (ḡ [C, D], held [C]): ḡ_j the mean of the vectors the client uploaded for class j
    (a zero row, not held, where it uploaded none)."""
    z, lab = upload["centroids"].float(), upload["centroid_labels"].long()
    sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64).index_add_(0, lab, z.double())
    counts = torch.bincount(lab, minlength=num_classes)
    return (sums / counts.clamp(min=1)[:, None]).float(), counts > 0


def round_robin_partners(per_client_rows: Sequence[int], repeats: int, num_clients: int) -> list[int]:
    """server.py:149-200 for one class: client k holds ``per_client_rows[k]`` vectors of it; image ``idx``
    (client -> vector -> repeat order, from 0) takes client ``idx mod num_clients``'s domain feature."""
    total = sum(per_client_rows) * repeats
    return [idx % num_clients for idx in range(total)]


def plan_released(uploads: Sequence[dict], repeats: int, use_domain: bool, num_classes: int
                  ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The released generation list, class by class (server.py:148-200): labels [N], centroids [N, D] (as
    uploaded; the second noising is the caller's), paired domain features [N, D] (zero rows where the
    partner has none; None without domain features) and the partner's upload position [N] (-1: no domain
    feature for that image)."""
    domains = [domain_from_centroids(u, num_classes) for u in uploads]
    labels, cents, doms, who = [], [], [], []
    for j in range(num_classes):
        per_client = [u["centroids"][u["centroid_labels"] == j] for u in uploads]
        partners = round_robin_partners([len(v) for v in per_client], repeats, len(uploads))
        images = [z for vectors in per_client for z in vectors for _ in range(repeats)]
        for z, k in zip(images, partners):
            labels.append(j)
            cents.append(z)
            held = use_domain and bool(domains[k][1][j])
            doms.append(domains[k][0][j] if held else torch.zeros_like(z))
            who.append(k if held else -1)
    if not labels:
        raise ConfigError("no centroid was uploaded, so there is nothing to generate")
    return (torch.tensor(labels, dtype=torch.long), torch.stack(cents).float(),
            torch.stack(doms).float() if use_domain else None, torch.tensor(who, dtype=torch.long))


def level_embedding(levels: torch.Tensor, dim: int) -> torch.Tensor:
    """unCLIP's sinusoidal noise-level embedding (sdmodel.py:114-116, 210-212)."""
    from diffusers.models.embeddings import get_timestep_embedding

    return get_timestep_embedding(levels, dim, flip_sin_to_cos=True, downscale_freq_shift=0)


def averaged_level_labels(embeds: torch.Tensor, level: int, carried_level: int) -> torch.Tensor:
    """sdmodel.py:192-220: class labels [embedding, (emb(level) + emb(carried_level)) / 2] of embeddings
    already noised to ``level`` that carried ``carried_level``'s embedding from the client."""
    n, dim = embeds.shape
    fresh = level_embedding(torch.full((n,), level), dim)
    carried = level_embedding(torch.full((n,), carried_level), dim)
    return torch.cat([embeds.float().cpu(), (fresh + carried) / 2], dim=1)


def unconditional_labels(n: int, dim: int) -> torch.Tensor:
    """server.py:170: the base branch's class labels, ``zeros_like`` of [embedding, level embedding]."""
    return torch.zeros(n, 2 * dim)


def released_conditions(model, class_context: torch.Tensor, empty_context: torch.Tensor,
                        centroid: tuple[float, torch.Tensor], domain: Optional[tuple[float, torch.Tensor]],
                        held: torch.Tensor, levels: Optional[tuple[int, int]]) -> tuple[list, Optional[torch.Tensor]]:
    """(the sampler's conditions, its base class labels) for prompts of "" (the base branch): the image
    branch (class prompt, twice-noised centroid) and the domain branch (class prompt, domain feature; rows
    where ``held`` is false get the base branch's own inputs, so their term is exactly zero).
    ``levels`` = (the server's level, the clients' level) on the unclip process, None otherwise (the UNet
    then reads the embeddings at level 0, or as a token)."""
    from fedguide.guidance.samplers import Condition

    n = len(class_context)
    if model.image_conditioning != "unclip":  # token-conditioned: the embedding is a context token, no level
        out = [Condition(float(centroid[0]), context=model.condition_inputs(class_context, centroid[1])[0])]
        if domain is not None:
            ctx, _ = model.condition_inputs(class_context, domain[1])
            ctx = torch.where(held.to(ctx.device)[:, None, None], ctx, empty_context.to(ctx.device, ctx.dtype))
            out.append(Condition(float(domain[0]), context=ctx))
        return out, None
    dim = int(model.image_normalizer.mean.shape[-1])
    base = unconditional_labels(n, dim)

    def labels(embeds: torch.Tensor, level: int, carried: Optional[int]) -> torch.Tensor:
        if levels is None:  # unet_schedule on an unCLIP UNet: the embedding read as clean
            return model.image_condition(embeds, 0).float().cpu()
        if carried is None:
            return model.image_condition(embeds, level, noised=True).float().cpu()
        return averaged_level_labels(embeds, level, carried)

    server_level, client_level = levels if levels is not None else (0, 0)
    out = [Condition(float(centroid[0]), class_labels=labels(centroid[1], server_level, client_level),
                     context=class_context)]
    if domain is not None:
        rows = labels(domain[1], client_level, None)
        keep = held.cpu()[:, None]
        ctx = torch.where(held.to(class_context.device)[:, None, None], class_context,
                          empty_context.to(class_context.device, class_context.dtype))
        out.append(Condition(float(domain[0]), class_labels=torch.where(keep, rows, base), context=ctx))
    return out, base
