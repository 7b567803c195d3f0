"""FedDISC ("Exploring One-shot Semi-supervised Federated Learning with A Pre-trained Diffusion Model"):
one-shot semi-supervised FL with prototypes, client centroids and composed
diffusion guidance.

Steps 1-3 (prototypes, pseudo-labels, k-means centroids and domain features, noising) are the client
protocol of ``_centroids.py``. Step 4, on the server, after the one upload:
- Eq. 6: every centroid z̄_{j,l}^k yields R = ``images_per_centroid`` images; image r pairs it with the
  domain feature ḡ_j^{k_r} of a client k_r drawn uniformly among the clients that uploaded a domain
  feature for class j (the paper draws k uniformly over all clients; a client without class j has no ḡ_j).
- Eq. 7: composed guidance ε̂ = ε(C_j) + w_f(ε(z̄, C_j) − ε(C_j)) + w_g(ε(ḡ, C_j) − ε(C_j)), w_f = w_g = 2,
  DDIM with ``steps`` = 20, through ``fedguide.guidance.samplers.sample`` with one ``Condition`` per image
  feature, built by ``model.condition_inputs`` (unCLIP class labels, or the embedded model's image token).
  The base branch ε(C_j) is the paper's: text-conditioned, the class prompt with no image feature (on an
  unCLIP model a zero embedding at level 0). The prompt C_j is the class name only ("a photo of a
  {name}", the embedded models' training prompt; no style or domain words, as in the paper).
  ``cfg_scale`` = 1 is Eq. 7 literally (no unconditional pass); another value adds text classifier-free
  guidance on top.
- The server's classifier (``head``):
  ``encoder`` (default, FedDISC's protocol, Sec. 4.1): a linear head on the frozen image encoder trained on
  the generated images with their classes (SGD, lr 0.01, batch 256); the run's accuracy is encoder + head
  on the test set. ``head_epochs`` (100) is chosen here: the paper states none; the released crosssilo.py
  trains 10 epochs (crosssilo.py:39, server.py:209-222).
  ``model``: the run's own model (``model:`` of the config, e.g. ResNet-10) is trained from its initial
  weights on the generated images, brought to the dataset's size and channels (8-bit, standardised as the
  real images are), with cross-entropy for ``model_epochs`` (10, the released server's epochs) and the
  ``train`` section's optimizer, lr, momentum, weight decay and batch size, no augmentation; the run's
  accuracy is that model's, scored by the engine's evaluator. This is the row of FedDifRC's Table 6
  (CIFAR-10 / CIFAR-10-LT, ResNet-10 for every row, FedDifRC Sec. 5.1; hwang52/FedDifRC
  model/resnet_cnn.py:118): its 75-87 % are the level of a ResNet-10, which a linear head on frozen
  CLIP-ViT-H is not. FedDifRC does not say how it trained FedDISC's row; here the synthetic set alone
  trains the model on the server, FedDISC's one-shot protocol with the classifier swapped. The prototypes,
  pseudo-labels and k-means still use the frozen image encoder.
- ``schedule`` (_released_schedule.py, with file and line of the authors' code for each rule): ``paper``
  (default) is Eq. 3-7 as above; ``released`` is MingzhaoYang/FedDISC as crosssilo.py runs it: every
  client feature noised at ``client_noise_level`` (500) before Euclidean pseudo-labels and k-means (a
  class's noised features themselves when it has at most L), no client-side noise after that; the
  server's domain feature of a client the mean of its uploaded vectors of the class; each image's
  centroid noised again at ``noise_level`` (200) with the mean of the two levels' embeddings (unCLIP);
  domain features paired round robin (image ``idx`` of a class with client ``idx mod K``, none where that
  client lacks the class); and the unconditional base branch: ε̂ = ε(∅, 0) + w_f(ε(z̄, C_j) − ε(∅, 0)) +
  w_g(ε(ḡ, C_j) − ε(∅, 0)), ∅ the empty prompt and 0 an all-zero image condition. Its privacy figure is
  the per-sample mechanism at level 500 (m = 1; the rest is post-processing).

Decisions where the paper is silent:
- Scale of the image conditions: the uploaded features live at norm ≤ B (see _frozen_encoder); before
  conditioning they are rescaled by c = r/B, r the mean raw embedding norm of the server's labeled images,
  so an unCLIP model sees them at its encoder's own scale (its normaliser standardises raw embeddings).
  Token-conditioned models normalise the embedding anyway.
- Eq. 5's noise (``noise_process``, _feature_noise.py): ``unclip`` (default on unCLIP pipelines, the
  released code) has the clients noise c·z with the pipeline's image-noising scheduler on the normaliser-
  standardised embedding at ``noise_level``, and the UNet is given that level with every image condition;
  ``unet_schedule`` (the only one token-conditioned models such as the embedded ones have) noises z on
  the UNet's schedule and gives an unCLIP UNet level 0. The privacy report names the process that ran.
- Images of class j are sampled in batches of ``gen_batch_size``; the noise of image i of batch b depends
  on (run seed, j, b, i) alone (the sampler's per-image generators); the pairing of Eq. 6 on the run seed.
- Generation resumes: each finished sampler batch's features (and its images shown in the grid) are kept
  in ``feddisc_generation/`` of the run directory under a key of everything they depend on
  (_generation_cache.py), so ``fedguide resume`` of a run stopped mid-generation continues after the last
  finished batch with the same result; the folder goes once the results are written.
- Generated images are encoded class by class and dropped; only ``sample_grid`` images per class are kept
  and written to ``feddisc_samples.png`` in the run directory (one row per class), and as 8-bit pixels with
  their classes and the client whose domain feature guided each to ``feddisc_samples.safetensors``
  (``fedguide analyze --samples`` sets them beside the clients' own images).
- Ablations (Table 4): ``use_domain_features: false`` drops the w_g term; ``random_centroids: true``
  uploads random member features instead of centroids. Tables 2-3: ``num_centroids`` (L) and
  ``images_per_centroid`` (R).
- ``client_labels: own``: supervised FedDISC, the row of FedDifRC's Table 6 ("FedDISC on labeled
  clients", CIFAR-10 and CIFAR-10-LT): every client is labeled, so its samples are grouped by their own
  labels instead of Eq. 3's pseudo-labels; the rest (k-means per class, domain features, noise, composed
  generation, the server's head) is unchanged. The server's prototypes still give the embedding scale c.
  A partition whose clients are unlabeled refuses it.
- Not in the paper, off by default: ``head_train_set: generated_and_centroids`` trains the head on the
  generated images' features and the uploaded noisy centroids (as centroid_finetune takes them)
  together, which tells whether generation adds anything the centroids do not already carry.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

import numpy as np
import torch
from pydantic import Field, model_validator

from fedguide.core.seeding import derive_seed, torch_generator
from fedguide.methods.frozen_encoder.centroids._centroids import (CentroidOneShot, CentroidParams, privacy_report,
                                                        uploaded_centroids)
from fedguide.methods.frozen_encoder._frozen_encoder import score
from fedguide.methods.frozen_encoder.centroids._generation_cache import GenerationCache, batch_key
from fedguide.methods.frozen_encoder.centroids._released_schedule import (CLIENT_NOISE_LEVEL, euclidean_pseudo_labels,
                                                                noised_client_summary, plan_released,
                                                                released_conditions)
from fedguide.methods._synthetic import check_image_data, from_uint8, stored_to_model_input, to_stored, to_uint8
from fedguide.guidance.progress import progress
from fedguide.methods.base import METHODS
from fedguide.registry import ConfigError

PAIRING_TAG, GENERATION_TAG, SECOND_NOISE_TAG, MODEL_TAG = 21, 22, 23, 24
RELEASED_ASSUMPTION = ("per sample: every feature is noised on its own before pseudo-labelling and clustering, so "
                       "the upload (centroids, counts) and everything the server derives are post-processing of "
                       "one noised vector per sample; with client_labels: own the counts are the true labels' and "
                       "fall outside it")
PROGRESS_FROM = 256  # a generation of at least this many images shows a progress bar (stderr)
SAMPLES_FILE = "feddisc_samples.safetensors"
GENERATION_DIR = "feddisc_generation"  # finished sampler batches, so a stopped run resumes after the last


class FedDISCParams(CentroidParams):
    images_per_centroid: int = Field(10, ge=1, description="R, images generated per centroid (Eq. 6)")
    w_f: float = Field(2.0, description="weight of the centroid condition in Eq. 7")
    w_g: float = Field(2.0, description="weight of the domain-feature condition in Eq. 7")
    use_domain_features: bool = Field(True, description="Table 4 ablation: false drops the domain features (w_g term)")
    steps: int = Field(20, ge=1, description="denoising steps (paper: DDIM, 20)")
    scheduler: Literal["ddim", "ddpm"] = Field("ddim", description="sampler (paper: ddim)")
    eta: float = Field(0.0, ge=0.0, description="DDIM eta")
    cfg_scale: float = Field(1.0, description="text classifier-free guidance scale under Eq. 7 (1 = Eq. 7 as printed)")
    prompt: str = Field("a photo of a {}", description="class prompt template, filled with the lower-cased class name")
    gen_batch_size: int = Field(64, ge=1, description="images per sampler batch")
    sample_grid: int = Field(8, ge=0, description="generated images per class written to feddisc_samples.png (0: none)")
    head_train_set: Literal["generated", "generated_and_centroids"] = Field(
        "generated", description="what the server's head trains on: the generated images (the paper) or those plus "
                                 "the uploaded noisy centroids (a diagnostic: do the images add to the centroids?)")
    client_labels: Literal["pseudo", "own"] = Field(
        "pseudo", description="what groups a client's samples: Eq. 3's pseudo-labels, or its own labels (labeled "
                              "clients: FedDISC as FedDifRC's Table 6 runs it)")
    schedule: Literal["paper", "released"] = Field(
        "paper", description="paper: Eq. 3-7 (clients noise centroids and domain features once at noise_level, "
                             "text-conditioned base branch); released: the authors' code (every feature noised at "
                             "client_noise_level before Euclidean pseudo-labels and k-means, domain features the "
                             "means of a client's centroids, centroids noised again at noise_level, round-robin "
                             "pairing, unconditional base branch)")
    client_noise_level: int = Field(
        CLIENT_NOISE_LEVEL, ge=0, description="schedule released: the level every client feature is noised at "
                                              "before clustering (released client.py: 500)")
    head: Literal["encoder", "model"] = Field(
        "encoder", description="the server's classifier: encoder = a linear head on the frozen image encoder "
                               "(FedDISC's protocol); model = the run's own model (model:) trained on the "
                               "generated images (FedDifRC's Table 6 row, ResNet-10)")
    model_epochs: int = Field(
        10, ge=1, description="head model: epochs of the run's model on the generated images (the released "
                              "server's 10), with the train section's optimizer, lr, momentum, weight decay and "
                              "batch size")

    @model_validator(mode="after")
    def _one_reading(self) -> "FedDISCParams":
        # By value, not by which keys were written: a run folder's config.yaml writes every option out, and it
        # must resolve again (resume, report).
        defaults = type(self).model_fields
        if self.schedule == "paper" and self.client_noise_level != defaults["client_noise_level"].default:
            raise ValueError("client_noise_level is the released schedule's client noising; set schedule: released "
                             "or drop it (the paper schedule noises once, at noise_level)")
        if self.schedule == "released" and self.min_cluster_size != defaults["min_cluster_size"].default:
            raise ValueError("min_cluster_size belongs to the paper schedule; the released schedule uploads a "
                             "class's noised features themselves when it has at most num_centroids of them")
        if self.schedule == "released" and self.cfg_scale != 1:
            raise ValueError("the released schedule's base branch is already unconditional (empty prompt, zero "
                             "embedding); cfg_scale adds text guidance to the paper's Eq. 7 only: set cfg_scale: 1")
        if self.head == "model" and self.head_train_set != "generated":
            raise ValueError("head: model trains the run's model on images; the uploaded centroids are features: "
                             "use head_train_set: generated or head: encoder")
        if self.head == "encoder" and self.model_epochs != defaults["model_epochs"].default:
            raise ValueError("model_epochs trains the run's model, which head: encoder does not use; set head: model "
                             "or drop it")
        return self


# ---- Eq. 6: what to generate -----------------------------------------------------------------------------
@dataclass
class GenerationPlan:
    labels: torch.Tensor  # [N] class of each image
    centroids: torch.Tensor  # [N, D] the noised centroid z̄ of each image
    domain: Optional[torch.Tensor]  # [N, D] its paired domain feature ḡ, None without domain features
    domain_client: torch.Tensor  # [N] the client whose ḡ was drawn (-1 without)


def domain_available(uploads: Sequence[dict], min_count: int) -> torch.Tensor:
    """[K, C] whether client k uploaded a domain feature for class c (``pseudo_label_counts`` ≥ m)."""
    return torch.stack([u["pseudo_label_counts"] >= min_count for u in uploads])


def plan_generation(uploads: Sequence[dict], images_per_centroid: int, use_domain: bool, min_count: int,
                    rng: np.random.Generator) -> GenerationPlan:
    """R images per uploaded centroid, each paired (Eq. 6) with the domain feature of a uniformly drawn
    client among those holding one for the centroid's class."""
    have = domain_available(uploads, min_count)
    labels, cents, doms, who = [], [], [], []
    for u in uploads:
        for z, j in zip(u["centroids"], u["centroid_labels"].tolist()):
            holders = torch.nonzero(have[:, j]).flatten().numpy()
            for _ in range(images_per_centroid):
                labels.append(j)
                cents.append(z)
                if use_domain:
                    k = int(rng.choice(holders))
                    doms.append(uploads[k]["domain_features"][j])
                    who.append(k)
                else:
                    who.append(-1)
    if not labels:
        raise ConfigError("no centroid was uploaded, so there is nothing to generate")
    return GenerationPlan(torch.tensor(labels, dtype=torch.long), torch.stack(cents).float(),
                          torch.stack(doms).float() if use_domain else None, torch.tensor(who, dtype=torch.long))


# ---- Eq. 7: the conditions -------------------------------------------------------------------------------
def composed_conditions(model, context: torch.Tensor, features: Sequence[tuple[float, torch.Tensor]],
                        noise_level: int = 0, noised: bool = False) -> list:
    """One sampler ``Condition`` per (weight, image embeddings [N, D]), built by ``model.condition_inputs``:
    unCLIP class labels, or a context carrying the image token (token-conditioned models). ``noised``:
    the embeddings were noised to ``noise_level`` by the unCLIP process (Eq. 5), and the UNet is told so."""
    from fedguide.guidance.samplers import Condition

    out = []
    for weight, embeds in features:
        ctx, labels = model.condition_inputs(context, embeds, noise_level=noise_level, noised=noised)
        out.append(Condition(float(weight), class_labels=labels, context=ctx if labels is None else None))
    return out


def check_conditioning(model, dim: int) -> None:
    """The guidance model must take image embeddings of the encoder's size."""
    kind = model.image_conditioning
    if kind is None:
        raise ConfigError("FedDISC conditions generation on image features and this guidance model takes none: use "
                          "an unCLIP pipeline (e.g. stabilityai/stable-diffusion-2-1-unclip) or the embedded default")
    width = int(model.image_normalizer.mean.shape[-1]) if kind == "unclip" else model.context_dim
    if width != dim:
        raise ConfigError(f"the image encoder's embeddings have {dim} dims but the guidance model's image "
                          f"conditioning takes {width}; use the pipeline's own image encoder "
                          "(guidance.image_encoder: null)")


def save_grid(images: Sequence[torch.Tensor], path: Path) -> None:
    """One row per class of images in [-1, 1] ([n_c, 3, H, W] each), padded with black."""
    from PIL import Image

    rows = [r for r in images if len(r)]
    if not rows:
        return
    width = max(len(r) for r in rows)
    size = rows[0].shape[-2:]
    pad = torch.full((3, *size), -1.0)
    sheet = torch.cat([torch.cat([r[i].expand(3, -1, -1) if i < len(r) else pad for i in range(width)], dim=2)
                       for r in rows], dim=1)
    pixels = ((sheet.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    Image.fromarray(pixels).save(path)


def guiding_clients(positions: torch.Tensor, uploads: Sequence[dict]) -> torch.Tensor:
    """Client ids of upload positions (-1 stays -1: no domain feature)."""
    ids = torch.tensor([int(u.get("client_id", i)) for i, u in enumerate(uploads)], dtype=torch.long)
    return torch.where(positions >= 0, ids[positions.clamp(min=0)], positions)


def save_samples(images: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], clients: Sequence[torch.Tensor],
                 path: Path) -> None:
    """The grid's images (uint8), their classes and the client whose domain feature guided each (-1: none)."""
    from safetensors.torch import save_file

    from fedguide.core.atomic import write_atomic
    from fedguide.methods._synthetic import to_uint8

    tensors = {"images": to_uint8(torch.cat(list(images))).contiguous(), "labels": torch.cat(list(labels)).long(),
               "clients": torch.cat(list(clients)).long()}
    write_atomic(path, lambda tmp: save_file(tensors, tmp))


@METHODS.register("feddisc", params=FedDISCParams)
class FedDISC(CentroidOneShot):
    """FedDISC: one-shot; noisy client centroids + domain features guide diffusion generation; a linear head on
    the frozen image encoder (or the run's model) trained on the images."""

    paper = "https://arxiv.org/abs/2305.04063"

    def __init__(self, params, run):
        from fedguide.guidance.shared import require_generation

        super().__init__(params, run)
        # The server generates: refused when the method is built (a dry run too), before any client works.
        require_generation(run.guidance, "feddisc")

    def setup(self):
        if self.params.client_labels == "own" and not self.run.data.clients_labeled:
            raise ConfigError("method.client_labels=own groups each client's samples by its own labels, but the "
                              "clients of this partition are unlabeled; use client_labels: pseudo or a labeled "
                              "partition (dirichlet, nid2, ...)")
        if self.params.head == "model":  # the generated images must reach the run's model in its input format
            check_image_data(self.run.data.splits, "feddisc with head: model")
        super().setup()
        self.model_trained = False
        self.model_weights: Optional[torch.Tensor] = None

    @property
    def released(self) -> bool:
        return self.params.schedule == "released"

    # ---- client ----
    def client_labels(self, feats, ctx):
        if self.params.client_labels == "own":  # labeled clients: their labels replace Eq. 3
            return ctx.data.labels().to(feats.device)
        if self.released:  # released client.py:40-44, on the noised features
            return euclidean_pseudo_labels(feats, ctx.payload["prototypes"], ctx.payload["prototype_present"])
        return super().client_labels(feats, ctx)

    def client_upload(self, model, ctx, state):
        if not self.released or "prototypes" not in ctx.payload:
            return super().client_upload(model, ctx, state)
        feats = self.features.train(ctx.data.indices.numpy())
        # released client.py:11-13 / sdmodel.py:73-77: every sample's feature noised before anything else
        noised = self.client_noise(ctx, self.params.client_noise_level).apply(feats, self.noise_generator(ctx))
        return noised_client_summary(noised, self.client_labels(noised, ctx), self.run.num_classes, self.params,
                                     lambda j: self.kmeans_seed(ctx, j))

    def privacy(self):
        if not self.released:
            return super().privacy()
        # One noised vector per sample; what follows it is post-processing (RELEASED_ASSUMPTION).
        report = privacy_report(self.feature_noise(level=self.params.client_noise_level), self.features.norm, 1,
                                self.params.privacy_delta, vectors_per_sample=1, assumption=RELEASED_ASSUMPTION)
        return {**report, "schedule": "released"}

    # ---- server ----
    def plan(self, uploads) -> GenerationPlan:
        """What to generate: Eq. 6's draw (paper), or the released round robin with the centroids noised a
        second time at ``noise_level``, one ε row per image (released server.py:158-168)."""
        p = self.params
        if not self.released:
            rng = np.random.default_rng(derive_seed(self.run.seed, "model", PAIRING_TAG))
            return plan_generation(uploads, p.images_per_centroid, p.use_domain_features, p.min_cluster_size, rng)
        labels, centroids, domain, who = plan_released(uploads, p.images_per_centroid, p.use_domain_features,
                                                       self.run.num_classes)
        again = self.feature_noise().apply(centroids, torch_generator(self.run.seed, "model", SECOND_NOISE_TAG))
        return GenerationPlan(labels, again, domain, who)

    def fit_head(self, uploads):
        from fedguide.guidance.samplers import SamplerConfig, sample
        from fedguide.guidance.shared import class_prompts

        p = self.params
        model, feats = self.features.model, self.features
        check_conditioning(model, feats.dim)
        t0 = time.perf_counter()
        plan = self.plan(uploads)
        self.ensure_prototypes()
        cond_scale = self.condition_scale
        unclip = self.noise_process() == "unclip"
        # unclip: the uploads were noised to noise_level by the pipeline's own process; tell the UNet that level
        level = {"noise_level": p.noise_level, "noised": True} if unclip else {}
        # released, unclip: the server's level and the clients' (their level embeddings are averaged)
        levels = (p.noise_level, p.client_noise_level) if unclip else None
        prompts = class_prompts(self.run.data.splits.class_names, p.prompt)
        cache = GenerationCache(self.run.run_dir / GENERATION_DIR)
        guidance = self.run.guidance.model_dump(mode="json")
        to_model = p.head == "model"
        splits = self.run.data.splits
        gen_feats, gen_labels, grid, grid_labels, grid_clients = [], [], [], [], []
        reused = 0  # images of batches a stopped run had finished (not counted in generation_seconds)
        with progress(len(plan.labels), "generating", enabled=len(plan.labels) >= PROGRESS_FROM) as advance:
            for j in sorted(set(plan.labels.tolist())):
                rows = torch.nonzero(plan.labels == j).flatten()
                kept, kept_clients = [], []
                # One sampler call per batch, so only one batch of (possibly large) images is held at a time.
                for chunk, start in enumerate(range(0, len(rows), p.gen_batch_size)):
                    part = rows[start: start + p.gen_batch_size]
                    context = model.encode_text([prompts[j]]).tokens.expand(len(part), -1, -1)
                    pairs = [(p.w_f, plan.centroids[part] * cond_scale)]
                    if plan.domain is not None:
                        pairs.append((p.w_g, plan.domain[part] * cond_scale))
                    seed = derive_seed(self.run.seed, "model", GENERATION_TAG, j, chunk) % 2 ** 31
                    config = SamplerConfig(scheduler=p.scheduler, steps=p.steps, guidance_scale=p.cfg_scale,
                                           eta=p.eta, batch_size=p.gen_batch_size, progress=False, seed=seed)
                    shown = max(p.sample_grid - sum(len(k) for k in kept), 0)
                    recipe = {"prompt": prompts[j], "sampler": config, "weights": [w for w, _ in pairs],
                              "level": level, "shown": shown, "guidance": guidance}
                    tensors = {f"condition{i}": c for i, (_, c) in enumerate(pairs)}
                    held = plan.domain_client[part] >= 0
                    if self.released:
                        recipe.update(schedule="released", levels=levels)
                        tensors["held"] = held
                    if to_model:
                        recipe["stored"] = "model_input"
                    key = batch_key(recipe, tensors)
                    done = cache.load((j, chunk), key)
                    reused += 0 if done is None else len(part)
                    if done is None:
                        if self.released:
                            empty = model.encode_text([""]).tokens.expand(len(part), -1, -1)
                            conditions, base = released_conditions(model, context, empty, pairs[0],
                                                                   pairs[1] if len(pairs) > 1 else None, held,
                                                                   levels)
                            images = sample(model, [""] * len(part), config, conditions,
                                            base_class_labels=base).images
                        else:
                            images = sample(model, [prompts[j]] * len(part), config,
                                            composed_conditions(model, context, pairs, **level)).images
                        done = {"shown": to_uint8(images[:shown])}
                        if to_model:  # at the model's input size and channels, 8-bit (as _synthetic stores it)
                            done["inputs"] = to_stored(splits, images)
                        else:
                            done["features"] = feats.of_images(images)
                        cache.save((j, chunk), key, done)
                    gen_feats.append(done["inputs" if to_model else "features"])  # on the CPU
                    gen_labels.append(torch.full((len(part),), j, dtype=torch.long))
                    kept.append(from_uint8(done["shown"]))  # 8-bit either way, so a resumed run draws the same grid
                    kept_clients.append(guiding_clients(plan.domain_client[part[:shown]], uploads))
                    advance(len(part))
                grid.append(torch.cat(kept))
                grid_labels.append(torch.full((len(grid[-1]),), j, dtype=torch.long))
                grid_clients.append(torch.cat(kept_clients))
        generation_seconds = time.perf_counter() - t0
        x, y = torch.cat(gen_feats), torch.cat(gen_labels)
        extra = {}
        if self.released:
            extra["domain_paired_images"] = int((plan.domain_client >= 0).sum())
        if to_model:
            self.model_weights, loss = self.train_model(x, y)
            self.model_trained = True
            head, extra = None, {**extra, "model_train_samples": int(len(y)), "model_train_loss": loss}
        else:
            if p.head_train_set == "generated_and_centroids":
                centroids, centroid_labels = uploaded_centroids(uploads)
                x, y = torch.cat([x, centroids]), torch.cat([y, centroid_labels])
                extra["train_centroids"] = int(len(centroids))
            head, loss = self.train_server_head(x, y)
            extra.update(head_train_samples=int(len(y)), head_train_loss=loss)
        if p.sample_grid:
            save_grid(grid, self.run.run_dir / "feddisc_samples.png")
            save_samples(grid, grid_labels, grid_clients, self.run.run_dir / SAMPLES_FILE)
        cache.remove()
        return head, {"generated_images": int(len(plan.labels)), "reused_images": reused, **extra,
                      "generation_seconds": generation_seconds}

    def train_model(self, stored: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """head: model: the run's model from its initial weights, trained on the generated images (8-bit at its
        input size, standardised per batch) with cross-entropy for ``model_epochs`` epochs; the optimiser and
        batch size are the train section's. Returns (its flat weights, the mean training loss)."""
        from fedguide.core.training import make_optimizer
        from fedguide.methods.one_shot._distill import train_on_labeled

        run, splits = self.run, self.run.data.splits
        with torch.random.fork_rng(devices=[]):
            net = run.make_model()
        run.layout.load(net, run.initial_weights)
        loss = train_on_labeled(net, lambda idx: stored_to_model_input(splits, stored[idx]), labels, None,
                                self.params.model_epochs, run.train.batch_size, make_optimizer(net, run.train),
                                torch_generator(run.seed, "model", MODEL_TAG))
        return run.layout.flatten(net), loss

    def classifier_ready(self) -> bool:
        return self.model_trained if self.params.head == "model" else super().classifier_ready()

    def fitted_weights(self, global_weights):
        return self.model_weights if self.model_weights is not None else global_weights

    def evaluate(self, round_, global_weights):
        if self.params.head == "encoder":
            return super().evaluate(round_, global_weights)
        if not self.model_trained:
            raise ConfigError("FedDISC has no classifier yet: round 1 had no uploads")
        _, logits, _ = self.run.evaluator.features(global_weights)
        return self.with_report(score(self.run, logits.argmax(1).cpu(), logits))

    # ---- checkpoints ----
    def server_state(self):
        if self.params.head == "encoder":
            return super().server_state()
        # the trained model is the engine's global model; the server only remembers that it exists
        return {"model_trained": torch.ones(1)} if self.model_trained else {}

    def load_server_state(self, state):
        if self.params.head == "encoder":
            return super().load_server_state(state)
        if state and set(state) != {"model_trained"}:
            raise ValueError(f"FedDISC (head: model) checkpoint state should hold model_trained, got {sorted(state)}")
        self.model_trained = bool(state)
