"""FedDISC's one-shot client protocol (the FedDISC paper Sec. 3.2, steps 1-3), shared by ``feddisc`` and
``centroid_finetune``; the two differ only in what the server does with the uploads.

1. Server: prototypes p_j = class means of f over its labeled set (Eq. 2), sent to every client.
2. Client, inference only: pseudo-label ŷ = argmax_j cos(f(x), p_j) (Eq. 3).
3. Client: per pseudo-class j, k-means with L centroids z_{j,l} (Eq. 4, scikit-learn ``KMeans``, seeded by
   (run seed, round, client, class)) and the domain-specific feature g_j = class mean; each is noised as
   z̄ = √ᾱ_n·z + √(1−ᾱ_n)·ε with n = ``noise_level`` (Eq. 5) by ``noise_process`` (_feature_noise.py): on
   an unCLIP pipeline its image-noising scheduler on normaliser-standardised embeddings (the released
   code), else the guidance model's training schedule on the features.
   The upload holds exactly: ``centroids`` [M, D] (M ≤ C·L), ``centroid_labels`` [M], ``domain_features``
   [C, D] and ``pseudo_label_counts`` [C] — no image and no per-sample feature.

Decisions where the paper is silent:
- Features are f = B·E(x)/‖E(x)‖ (see _frozen_encoder), so every feature's norm is exactly B: the clipping
  the privacy figure needs. Centroids and means of such features have norm ≤ B.
- Small classes (``min_cluster_size`` m, default 2): a pseudo-class with n_j samples gets
  k = min(L, ⌊n_j/m⌋) clusters; after k-means, a cluster with fewer than m members is dissolved (the
  smallest first, its members moved to the nearest remaining centroid) until every cluster holds at least
  m samples; each released centroid is then recomputed as the exact mean of its members. A class with
  n_j < m uploads no centroid and no domain feature (its row of ``domain_features`` is zero and the server
  knows it is absent from ``pseudo_label_counts`` < m). So every released vector is a mean over at least
  m samples, and with m ≥ 2 no single sample's feature ever leaves a client. m = 1 with n_j < L would
  upload each sample of the class as its own (noised) centroid.
- ``random_centroids`` (Table 4's ablation "random features instead of centroids"): k = min(L, n_j)
  randomly chosen member features are uploaded instead of centroids: per-sample features, noised; the
  privacy figure is then the one of a single sample (m = 1).
- The noise of each client is drawn from a generator seeded by (run seed, round, client).
- ``noise_process: unclip`` noises at the image encoder's embedding scale: the server sends, with its
  prototypes, c = (mean raw embedding norm of its labeled images) / B (``condition_scale``, public: the
  server's own data), the factor it also conditions generation with.
- Privacy (``privacy`` in the metrics and privacy.json in the run directory): each released vector is a
  Gaussian mechanism on a mean of at least m features of norm ≤ B: Δ = 2B√ᾱ/m, σ = √(1−ᾱ) (unclip: on the
  standardised embedding, Δ = 2Bc√ᾱ/(m·min σ_normaliser); ᾱ of the scheduler that noised), assuming the
  grouping into pseudo-classes and clusters is fixed (replacing one sample moves one mean by at most 2B/m;
  k-means' assignment is itself data-dependent and not covered). ``epsilon`` is the per-query (per vector)
  value of the analytic Gaussian mechanism, as the paper states its guarantee ("on each query");
  ``epsilon_upload`` composes the two vectors one sample enters (its cluster's centroid and its class's
  domain feature, both over ≥ m samples) into the per-sample guarantee of a client's whole upload.
- One-shot: every client takes part in round 1 (``clients.per_round`` must equal ``clients.num``); later
  rounds send and upload nothing and keep the head, so ``train.rounds`` beyond 1 only repeats the
  evaluation. The engine's local training loop is skipped (zero steps): clients only run inference.
- ``pseudo_label_accuracy`` in the metrics is computed by the simulation from labels the clients do not
  have (a diagnostic, never part of the protocol).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.atomic import write_json
from fedguide.core.seeding import derive_seed, torch_generator
from fedguide.guidance.pipeline_facts import pipeline_facts
from fedguide.methods.frozen_encoder.centroids._feature_noise import FeatureNoise, NoiseProcess, noise_features, resolve_process
from fedguide.methods.frozen_encoder._frozen_encoder import (FrozenFeatures, class_prototypes, head_from_state, head_metrics,
                                             head_state, labeled_set, new_head, pseudo_labels, train_head)
from fedguide.methods.base import Method
from fedguide.registry import ConfigError

UPLOAD_KEYS = ("centroids", "centroid_labels", "domain_features", "pseudo_label_counts")
KMEANS_TAG, NOISE_TAG, HEAD_TAG = 11, 12, 13  # extra seed keys under the engine's per-(round, client) streams
CLUSTER_SIZES_REPORTED = (1, 2, 5, 10, 20, 50, 100)


class CentroidParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_centroids: int = Field(5, ge=1, description="L, k-means centroids per pseudo-class per client (Eq. 4)")
    noise_level: int = Field(200, ge=0, description="n, the timestep whose ᾱ_n noises every uploaded feature (Eq. 5)")
    noise_process: NoiseProcess = Field(
        "auto", description="Eq. 5's noising: unclip = the pipeline's image-noising scheduler on standardised "
                            "embeddings, the level passed to the UNet (released code); unet_schedule = the UNet's "
                            "training schedule, the UNet told the embedding is clean; auto = unclip on unCLIP "
                            "pipelines")
    min_cluster_size: int = Field(
        2, ge=1, description="every released vector is a mean over at least this many samples (smaller clusters "
                             "are merged; classes with fewer samples upload nothing)")
    random_centroids: bool = Field(
        False, description="Table 4 ablation: upload L random member features instead of centroids")
    feature_norm: Optional[float] = Field(
        None, gt=0.0, description="B: features are L2-normalised and scaled to this norm (the clipping bound of the "
                                  "privacy figure); null = √D, per-coordinate RMS 1")
    privacy_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="δ of the reported (ε, δ)")
    kmeans_n_init: int = Field(10, ge=1, description="k-means restarts (scikit-learn n_init)")
    head_epochs: int = Field(100, ge=1, description="epochs of the linear head's training on the server")
    head_lr: float = Field(0.01, gt=0.0, description="SGD learning rate of the linear head (paper: 0.01)")
    head_batch_size: int = Field(256, ge=1, description="batch size of the linear head (paper: 256)")
    head_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum of the head (paper: not stated)")
    head_weight_decay: float = Field(0.0, ge=0.0, description="weight decay of the head")
    unheld_per_class: int = Field(
        100, ge=1, description="labeled images per class the server takes from the unheld training images when the "
                               "run has neither a semi_supervised server set nor a public pool")


# ---- pure pieces ---------------------------------------------------------------------------------------
def merge_small_clusters(features: np.ndarray, assign: np.ndarray, min_size: int) -> np.ndarray:
    """Dissolve clusters with fewer than ``min_size`` members, smallest first (ties: lowest id), moving their
    members to the nearest remaining cluster mean, until every cluster is large enough or one is left."""
    assign = assign.copy()
    while True:
        ids, sizes = np.unique(assign, return_counts=True)
        if len(ids) <= 1 or sizes.min() >= min_size:
            return assign
        drop = ids[np.argmin(sizes)]
        keep = ids[ids != drop]
        centers = np.stack([features[assign == c].mean(0) for c in keep])
        members = np.flatnonzero(assign == drop)
        dist = ((features[members, None, :] - centers[None]) ** 2).sum(-1)
        assign[members] = keep[dist.argmin(1)]


def cluster_centroids(features: np.ndarray, num_centroids: int, min_size: int, seed: int,
                      n_init: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 4 for one pseudo-class: (centroids [k, D], member counts [k]), each centroid the exact mean of
    ≥ ``min_size`` members; k = min(L, ⌊n/min_size⌋) before merging (0 rows if n < min_size)."""
    features = np.asarray(features, dtype=np.float64)
    n = len(features)
    k = min(num_centroids, n // min_size)
    if k == 0:
        return np.empty((0, features.shape[1]), np.float32), np.empty(0, np.int64)
    if k == 1:
        assign = np.zeros(n, np.int64)
    else:
        from sklearn.cluster import KMeans

        with warnings.catch_warnings():  # duplicate features give fewer distinct clusters; merged below
            warnings.simplefilter("ignore")
            assign = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(features).labels_.astype(np.int64)
        assign = merge_small_clusters(features, assign, min_size)
    ids, sizes = np.unique(assign, return_counts=True)
    centroids = np.stack([features[assign == c].mean(0) for c in ids])
    return centroids.astype(np.float32), sizes.astype(np.int64)


def random_members(features: np.ndarray, num_centroids: int, seed: int) -> np.ndarray:
    """Table 4's ablation: min(L, n) member features drawn without replacement."""
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(features), size=min(num_centroids, len(features)), replace=False))
    return np.asarray(features, dtype=np.float32)[chosen]


def client_summary(features: torch.Tensor, pseudo: torch.Tensor, num_classes: int, params: CentroidParams,
                   noise: float | FeatureNoise, class_seed, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Steps 2-3 on one client: the upload record (``UPLOAD_KEYS``) from its features and pseudo-labels.
    ``noise``: the noise process, or ᾱ of Eq. 5 on the features; ``class_seed(j)`` seeds class j's k-means
    (or random draw)."""
    if not isinstance(noise, FeatureNoise):
        noise = FeatureNoise("unet_schedule", -1, float(noise))
    feats = features.detach().float().numpy()
    pseudo = pseudo.long()
    counts = torch.bincount(pseudo, minlength=num_classes)
    dim = feats.shape[1]
    centroids, labels = [], []
    domain = torch.zeros(num_classes, dim)
    for j in range(num_classes):
        members = feats[(pseudo == j).numpy()]
        if len(members) < params.min_cluster_size:
            continue
        if params.random_centroids:
            rows = random_members(members, params.num_centroids, class_seed(j))
        else:
            rows, _ = cluster_centroids(members, params.num_centroids, params.min_cluster_size, class_seed(j),
                                        params.kmeans_n_init)
        centroids.append(torch.from_numpy(rows))
        labels.append(torch.full((len(rows),), j, dtype=torch.int64))
        domain[j] = torch.from_numpy(members.astype(np.float64).mean(0)).float()
    z = torch.cat(centroids) if centroids else torch.empty(0, dim)
    has_domain = counts >= params.min_cluster_size
    # Noise is drawn for centroids first, then for every domain row; absent rows stay exactly zero.
    noisy_z = noise.apply(z, generator)
    noisy_g = torch.where(has_domain[:, None], noise.apply(domain, generator), torch.zeros_like(domain))
    return {"centroids": noisy_z, "centroid_labels": torch.cat(labels) if labels else torch.empty(0, dtype=torch.int64),
            "domain_features": noisy_g, "pseudo_label_counts": counts}


MEAN_ASSUMPTION = ("per released vector: a mean over >= min_samples_per_vector features of norm <= norm_bound, "
                   "one sample replaced, grouping into pseudo-classes and clusters held fixed")


def privacy_report(noise: FeatureNoise, norm_bound: float, min_count: int, delta: float, vectors_per_sample: int = 2,
                   assumption: str = MEAN_ASSUMPTION) -> dict[str, Any]:
    """The (ε, δ) figures of the module docstring for the process that noised, plus ε for a range of
    cluster sizes; ``vectors_per_sample``: how many noised vectors one sample enters (composed into
    ``epsilon_upload``)."""
    from fedguide.guidance.privacy import analytic_epsilon, compose_mu

    query = noise.privacy(norm_bound, min_count, delta)
    upload = compose_mu([query.mu] * vectors_per_sample)
    return {
        **noise.describe(norm_bound),
        "noise_level": noise.level, "alpha_bar": noise.alpha_bar, "sigma": query.sigma, "norm_bound": norm_bound,
        "min_samples_per_vector": min_count, "sensitivity": query.sensitivity, "delta": delta, "mu": query.mu,
        "epsilon": query.epsilon, "epsilon_classic": query.epsilon_classic, "classic_valid": query.classic_valid,
        "mu_upload": upload, "epsilon_upload": analytic_epsilon(upload, delta),
        "epsilon_by_samples_per_vector": {str(m): noise.privacy(norm_bound, m, delta).epsilon
                                          for m in CLUSTER_SIZES_REPORTED},
        "assumption": assumption,
    }


def _seed32(seed: int, *keys: int) -> int:
    """A seed for scikit-learn / numpy (below 2**32) from the run seed and per-(round, client, ...) keys."""
    return derive_seed(seed, "client", *keys) % (2 ** 32 - 1)


def uploaded_centroids(uploads: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's noised centroids [M, D] float32 and their pseudo-labels [M], as uploaded."""
    return (torch.cat([u["centroids"] for u in uploads]).float(),
            torch.cat([u["centroid_labels"] for u in uploads]).long())


# ---- the shared one-shot method ------------------------------------------------------------------------
class CentroidOneShot(Method):
    """Steps 1-3 of FedDISC; subclasses fit the linear head from the uploads (``fit_head``)."""

    on_device = False  # small models on cached features or its own loops: the host computes
    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)
    personal_evaluation = False  # the classifier is a head on the frozen encoder, not the run's model
    Params = CentroidParams
    needs_client_labels = False

    def __init__(self, params: CentroidParams, run):
        super().__init__(params, run)
        facts = pipeline_facts(run.guidance)
        # Settled when the method is built (a process the pipeline lacks is refused by --dry-run); without
        # readable configs, once the model is loaded.
        self.process: Optional[str] = None if facts is None else resolve_process(params.noise_process, facts.unclip)
        self.condition_scale: Optional[float] = None

    def setup(self) -> None:
        if self.run.clients.per_round != self.run.clients.num:
            raise ConfigError(f"{type(self).__name__} is one-shot: every client uploads in round 1; set "
                              f"clients.per_round to clients.num ({self.run.clients.num})")
        self.features = FrozenFeatures(self.run, self.params.feature_norm)
        self.prototypes: Optional[torch.Tensor] = None
        self.present: Optional[torch.Tensor] = None
        self.head: Optional[dict] = None
        self.info: dict[str, Any] = {}

    # ---- step 1 (server) ----
    def labeled(self) -> tuple[np.ndarray, str]:
        return labeled_set(self.run, self.params.unheld_per_class)

    def ensure_prototypes(self) -> None:
        if self.prototypes is not None:
            return
        idx, source = self.labeled()
        labels = self.run.data.splits.train_y[torch.as_tensor(idx)]
        self.prototypes, self.present = class_prototypes(self.features.train(idx), labels, self.run.num_classes)
        # c: the labeled images' mean raw embedding norm over B, the scale of the image encoder's own embeddings
        self.condition_scale = float(self.features.raw_train(idx).norm(dim=1).mean()) / self.features.norm
        self.info.update(labeled_source=source, labeled_samples=int(len(idx)))

    def noise_process(self) -> str:
        if self.process is None:
            self.process = resolve_process(self.params.noise_process, self.features.model.is_unclip)
        return self.process

    def feature_noise(self, scale: Optional[float] = None, level: Optional[int] = None) -> FeatureNoise:
        """Eq. 5's noise process on the guidance model at ``level`` (default ``noise_level``; ``scale``: c,
        default the server's)."""
        process = self.noise_process()
        if process == "unclip" and scale is None:
            self.ensure_prototypes()
            scale = self.condition_scale
        level = self.params.noise_level if level is None else level
        return FeatureNoise.of(process, self.features.model, level, 1.0 if scale is None else scale)

    def server_payload(self, round_, client_id, global_weights):
        if round_ > 1:
            return {}
        self.ensure_prototypes()
        payload = {"prototypes": self.prototypes, "prototype_present": self.present}
        if self.noise_process() == "unclip":
            payload["condition_scale"] = float(self.condition_scale)
        return payload

    # ---- steps 2-3 (client) ----
    def client_start(self, ctx):
        return self.run.initial_weights  # the engine's model is not used by this method

    def fit(self, model, ctx, train):
        return None, None  # inference only: the client's work is its upload (pseudo-labels, centroids, noise)

    def client_upload(self, model, ctx, state):
        if "prototypes" not in ctx.payload:
            return {}
        feats = self.features.train(ctx.data.indices.numpy())
        pseudo = self.client_labels(feats, ctx)
        return client_summary(feats, pseudo, self.run.num_classes, self.params, self.client_noise(ctx),
                              lambda j: self.kmeans_seed(ctx, j), self.noise_generator(ctx))

    def client_noise(self, ctx, level: Optional[int] = None) -> FeatureNoise:
        """The client's noise process at ``level`` (default ``noise_level``), at the scale c the server sent."""
        scale = ctx.payload.get("condition_scale")
        if scale is None and self.noise_process() == "unclip":
            raise ConfigError("noise_process=unclip noises at the embedding scale the server sends with its "
                              "prototypes (condition_scale), and this payload has none; run server and clients "
                              "with the same method settings")
        return self.feature_noise(None if scale is None else float(scale), level)

    def kmeans_seed(self, ctx, j: int) -> int:
        return _seed32(self.run.seed, ctx.round, ctx.client_id, KMEANS_TAG, j)

    def noise_generator(self, ctx) -> torch.Generator:
        return torch_generator(self.run.seed, "client", ctx.round, ctx.client_id, NOISE_TAG)

    def client_labels(self, feats: torch.Tensor, ctx) -> torch.Tensor:
        """The class each of the client's samples is grouped under: Eq. 3's pseudo-label."""
        return pseudo_labels(feats, ctx.payload["prototypes"], ctx.payload["prototype_present"])

    # ---- server ----
    def fit_head(self, uploads: list[dict]) -> tuple[dict, dict[str, Any]]:
        raise NotImplementedError

    def train_server_head(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[dict, float]:
        """The server's linear head on the frozen encoder, trained on (features, labels) with the run's
        head settings and seed; returns (head state, final train loss)."""
        p = self.params
        seed = derive_seed(self.run.seed, "model", HEAD_TAG)
        head = new_head(self.features.dim, self.run.num_classes, seed)
        return train_head(head, features, labels, p.head_epochs, p.head_lr, p.head_batch_size, p.head_momentum,
                          p.head_weight_decay, torch.Generator().manual_seed(seed % 2 ** 31))

    def classifier_ready(self) -> bool:
        """Whether the server's classifier exists (round 1 built it)."""
        return self.head is not None

    def fitted_weights(self, global_weights: torch.Tensor) -> torch.Tensor:
        """The global weights after ``fit_head``: the run's model is not this classifier, so unchanged."""
        return global_weights

    def aggregate(self, round_, global_weights, uploads):
        uploads = [u for u in uploads if "centroids" in u]
        if not uploads or self.classifier_ready():
            return global_weights
        if sum(len(u["centroids"]) for u in uploads) == 0:
            raise ConfigError("no client uploaded a centroid (every pseudo-class is smaller than "
                              f"min_cluster_size={self.params.min_cluster_size}); give clients more data or lower "
                              "method.min_cluster_size")
        self.head, info = self.fit_head(uploads)
        self.info.update(info)
        self.info["pseudo_label_accuracy"] = self._pseudo_label_accuracy()
        self._write_privacy()
        return self.fitted_weights(global_weights)

    def _pseudo_label_accuracy(self) -> float:
        self.ensure_prototypes()
        correct = total = 0
        for cid in range(self.run.num_clients):
            data = self.run.data.client(cid)
            pred = pseudo_labels(self.features.train(data.indices.numpy()), self.prototypes, self.present)
            correct += int((pred == data.labels()).sum())
            total += len(data)
        return correct / max(total, 1)

    def privacy(self) -> dict[str, Any]:
        m = 1 if self.params.random_centroids else self.params.min_cluster_size
        return privacy_report(self.feature_noise(), self.features.norm, m, self.params.privacy_delta)

    def _write_privacy(self) -> None:

        write_json(self.run.run_dir / "privacy.json", self.privacy())

    def evaluate(self, round_, global_weights):
        if self.head is None:
            raise ConfigError(f"{type(self).__name__} has no classifier yet: round 1 had no uploads")
        return self.with_report(head_metrics(self.run, self.head, self.features.test()))

    def with_report(self, out: dict[str, Any]) -> dict[str, Any]:
        """A round's metrics plus the run's diagnostics and its privacy figures."""
        self.ensure_prototypes()
        out.update(self.info)
        report = self.privacy()
        out["privacy"] = {k: report[k] for k in ("epsilon", "epsilon_upload", "epsilon_classic", "delta", "mu",
                                                  "sensitivity", "sigma", "norm_bound", "min_samples_per_vector",
                                                  "noise_level", "noise_process", "alpha_bar")}
        return out

    # ---- checkpoints ----
    def server_state(self):
        return head_state(self.head)

    def load_server_state(self, state):
        if state:
            self.head = head_from_state(state, type(self).__name__)
