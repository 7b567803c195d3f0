"""What the frozen-encoder methods share (FedDISC and its baselines): image-encoder features of the run's
images, the server's labeled set, class prototypes and pseudo-labels, and a linear head on top.

FedDISC's classifier is h = F ∘ E: the guidance model's frozen image encoder E (CLIP's in the paper, the
embedded mini CLIP by default) and a linear head F. Every method built on this module trains F only and
is evaluated as E + F on the test set; the engine's own model (``model:`` of the config) is never trained
and its weights travel nowhere (the engine still builds it; its weights stay the initial ones).

Decisions:
- Features: f(x) = B · E(x)/‖E(x)‖, the L2-normalised embedding scaled to the norm B = ``feature_norm``
  (default √D, D the embedding size: per-coordinate RMS 1, the scale at which unCLIP adds noise to its
  standardised image embeddings). Normalising every feature to norm B is the clipping FedDISC's privacy
  figure needs (‖f‖ ≤ B, every feature on the bound), and keeps the linear head's inputs at unit scale.
  Cosine similarities (prototypes, pseudo-labels, zero-shot) do not depend on B.
- The server's labeled set: the scenario's (``run.data.server_indices`` of ``semi_supervised``); else the
  public pool (``data.public_fraction``, labeled and held by the server); else, so the methods also run on
  label-skew configs, ``unheld_per_class`` stratified samples per class of the training images no client
  holds (e.g. the 95 % that ``data.fraction: 0.05`` leaves unused). Where it came from is reported as
  ``labeled_source``; with nothing unheld the run stops with a ConfigError naming the fix.
- Feature caching: the raw embeddings of a fixed set of images (the test split, one client's images, the
  labeled set) are computed once and kept in the feature store (``guidance.feature_cache``), keyed by the
  encoder's fingerprint, the dataset and its parameters, and a digest of the image indices; within a
  process they are also kept in memory. Augmented views (SemiFL, RSCFed) are kept in memory only.
- A class the labeled set lacks has no prototype: it is never a pseudo-label.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.core.aggregation import weighted_average
from fedguide.core.seeding import numpy_rng
from fedguide.registry import ConfigError

EMBED_BATCH = 256
# Cached feature sets at least this large show a progress bar (stderr); smaller ones compute silently.
PROGRESS_FROM = 4096


# ---- the labeled set ----------------------------------------------------------------------------------
def labeled_set(run, unheld_per_class: int = 100) -> tuple[np.ndarray, str]:
    """(indices into the training tensors, source name) of the server's labeled images (module docstring)."""
    data = run.data
    if data.server_indices is not None and len(data.server_indices):
        return np.asarray(data.server_indices, dtype=np.int64), "scenario"
    if len(data.public_indices):
        return np.asarray(data.public_indices, dtype=np.int64), "public"

    labels = data.splits.train_y.numpy()
    held = np.concatenate([np.asarray(c, dtype=np.int64) for c in data.client_indices])
    unheld = np.setdiff1d(np.arange(len(labels)), held)
    if len(unheld) == 0 or unheld_per_class < 1:
        raise ConfigError("this method needs a labeled set on the server, and the run has none: use partition "
                          "semi_supervised (server_domain or server_fraction), set data.public_fraction > 0, or "
                          "leave training images to no client (data.fraction < 1)")
    rng = numpy_rng(run.seed, "data", 1)
    keep = []
    for c in np.unique(labels[unheld]):
        members = unheld[labels[unheld] == c]
        keep.append(rng.choice(members, size=min(unheld_per_class, len(members)), replace=False))
    return np.sort(np.concatenate(keep)), "unheld"


# ---- prototypes and pseudo-labels (FedDISC Eq. 2-3) ---------------------------------------------------
def class_prototypes(features: torch.Tensor, labels: torch.Tensor,
                     num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 2: p_j = mean of the features of class j; (prototypes [C, D], present [C] bool), absent rows zero."""
    if features.ndim != 2 or len(features) != len(labels):
        raise ValueError(f"features [N, D] and labels [N] must match, got {tuple(features.shape)} and "
                         f"{tuple(labels.shape)}")
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64)
    sums.index_add_(0, labels.long(), features.double())
    counts = torch.bincount(labels.long(), minlength=num_classes)
    present = counts > 0
    return (sums / counts.clamp(min=1).unsqueeze(1)).float(), present


def pseudo_labels(features: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Eq. 3: argmax_j cos(f, p_j) over the classes that have a prototype."""
    if not bool(present.any()):
        raise ConfigError("no class has a prototype: the server's labeled set is empty")
    sim = F.normalize(features.float(), dim=1) @ F.normalize(prototypes.float(), dim=1).T
    return sim.masked_fill(~present.bool(), float("-inf")).argmax(1)


# ---- features ------------------------------------------------------------------------------------------
def _digest(indices: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(indices, dtype=np.int64).tobytes()).hexdigest()[:16]


class FrozenFeatures:
    """f(x) = B·E(x)/‖E(x)‖ of the run's images through the guidance model's frozen image encoder."""

    def __init__(self, run, norm: Optional[float] = None, batch_size: int = EMBED_BATCH):
        self.run = run
        self.cfg = run.guidance
        self._norm = norm
        self.batch_size = batch_size
        self._memory: dict[tuple, torch.Tensor] = {}
        self._encoder_id: Optional[str] = None

    # --- the models ---
    @property
    def model(self):
        from fedguide.guidance.shared import guidance_model

        return guidance_model(self.cfg, self.run)

    @property
    def encoder(self):
        enc = self.model.image_encoder
        if enc is None:
            raise ConfigError("this method classifies with the guidance model's image encoder, and it has none: set "
                              "guidance.image_encoder to a CLIP folder or hub id (e.g. openai/clip-vit-large-patch14) "
                              "or use a pipeline with an image_encoder/ folder")
        return enc

    @property
    def dim(self) -> int:
        return int(self.encoder.dim)

    @property
    def norm(self) -> float:
        """B: every feature's norm (and so the clipping bound)."""
        return float(self._norm) if self._norm is not None else float(np.sqrt(self.dim))

    def encoder_id(self) -> str:
        """A fingerprint of the image encoder for cache keys (``id@revision`` form)."""
        if self._encoder_id is None:
            source = self.cfg.image_encoder
            if source is None:
                self._encoder_id = self.model.model_id
            else:
                from fedguide.guidance.sources import MODEL_FILES, fingerprint, resolve_source

                # the folder, or the hub snapshot the encoder was loaded from (its commit names the weights)
                self._encoder_id = fingerprint(resolve_source(source, None, allow=MODEL_FILES), source)
        return self._encoder_id

    # --- embedding ---
    @torch.no_grad()
    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Raw (unnormalised) embeddings [N, D] float32 on the CPU of images in [-1, 1]."""
        out = [self.encoder.embed(images[s: s + self.batch_size]).float().cpu()
               for s in range(0, len(images), self.batch_size)]
        return torch.cat(out) if out else torch.empty(0, self.dim)

    def scale(self, raw: torch.Tensor) -> torch.Tensor:
        return self.norm * F.normalize(raw.float(), dim=-1)

    def of_images(self, images: torch.Tensor) -> torch.Tensor:
        """f of images in [-1, 1] (e.g. generated ones)."""
        return self.scale(self.embed(images))

    def _pixels(self, x: torch.Tensor) -> torch.Tensor:
        from fedguide.guidance.shared import guidance_pixels

        return guidance_pixels(self.run.data.splits, x)

    def _cached(self, split: str, indices: np.ndarray, images: torch.Tensor,
                source_indices: Optional[np.ndarray] = None) -> torch.Tensor:
        """Features of ``images[indices]``, cached under ``source_indices`` (the same samples' indices in the
        dataset source's split; default ``indices``) so a key names the same images in every run."""
        key = (split, _digest(indices if source_indices is None else source_indices), len(indices))
        if key in self._memory:
            return self._memory[key]
        if len(indices) == 0:
            return torch.empty(0, self.dim)
        from fedguide.guidance.shared import feature_store
        from fedguide.guidance.store import FeatureKey

        data = self.run.data_settings
        params = {k: v for k, v in data.params_dict().items() if k != "root"}  # where the files sit is no recipe
        fkey = FeatureKey(model=self.encoder_id(), dataset=data.name, split=split,
                          recipe={"features": "image_embeds", "data": params, "indices": key[1], "count": len(indices)})
        array = feature_store(self.cfg).get_or_compute(
            fkey, len(indices), lambda pos: self.embed(self._pixels(images[torch.as_tensor(indices[pos])])),
            batch_size=self.batch_size, rebuild=self.cfg.rebuild, description=f"image features ({split})",
            progress=len(indices) >= PROGRESS_FROM)
        raw = torch.from_numpy(np.array(array, dtype=np.float32))
        self._memory[key] = raw
        return raw

    def raw_train(self, indices) -> torch.Tensor:
        """Raw embeddings of training images ``indices`` (a client's, the labeled set)."""
        idx = np.asarray(indices, dtype=np.int64)
        return self._cached("train", idx, self.run.data.splits.train_x)

    def train(self, indices) -> torch.Tensor:
        return self.scale(self.raw_train(indices))

    def raw_test(self) -> torch.Tensor:
        splits = self.run.data.splits
        # Under eval.test_subset the test tensors hold only the subset: the key names its source indices.
        return self._cached("test", np.arange(len(splits.test_y)), splits.test_x, self.run.data.test_subset)

    def test(self) -> torch.Tensor:
        return self.scale(self.raw_test())

    def augmented_views(self, indices, views: int, augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
                        seed: int) -> torch.Tensor:
        """f of ``views`` augmented copies of each training image: [views, N, D], view v drawn with its own
        generator seeded by (seed, v); kept in memory only."""
        idx = np.asarray(indices, dtype=np.int64)
        key = ("views", _digest(idx), len(idx), views, seed, getattr(augment, "__name__", repr(augment)))
        if key not in self._memory:
            pixels = self._pixels(self.run.data.splits.train_x[torch.as_tensor(idx)])
            out = []
            for v in range(views):
                gen = torch.Generator().manual_seed(seed * 1_000_003 + v)
                out.append(self.scale(self.embed(augment(pixels, gen))))
            self._memory[key] = torch.stack(out) if out else torch.empty(0, len(idx), self.dim)
        return self._memory[key]


# ---- the linear head -----------------------------------------------------------------------------------
Head = dict[str, torch.Tensor]  # {"weight": [C, D], "bias": [C]}


def new_head(dim: int, num_classes: int, seed: int) -> Head:
    """nn.Linear's default initialisation, drawn from a generator of ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / float(np.sqrt(dim))
    return {"weight": (torch.rand(num_classes, dim, generator=gen) * 2 - 1) * bound,
            "bias": (torch.rand(num_classes, generator=gen) * 2 - 1) * bound}


def head_logits(head: Head, features: torch.Tensor) -> torch.Tensor:
    return features.float() @ head["weight"].T + head["bias"]


def copy_head(head: Head) -> Head:
    return {k: v.detach().clone() for k, v in head.items()}


def head_state(head: Optional[Head]) -> dict[str, torch.Tensor]:
    """The server state of a head-training method (empty before its head exists)."""
    return {} if head is None else {"head_weight": head["weight"], "head_bias": head["bias"]}


def head_from_state(state: dict[str, torch.Tensor], owner: str) -> Optional[Head]:
    """Inverse of ``head_state``; a checkpoint without the head's tensors is an error naming them."""
    if not state:
        return None
    if set(state) != {"head_weight", "head_bias"}:
        raise ValueError(f"{owner} checkpoint state should hold head_weight and head_bias, got {sorted(state)}")
    return copy_head({"weight": state["head_weight"], "bias": state["head_bias"]})


def average_heads(heads: Sequence[Head], weights: Sequence[float]) -> Head:

    return {k: weighted_average([h[k] for h in heads], weights) for k in ("weight", "bias")}


def sgd_steps(head: Head, n: int, epochs: int, batch_size: int, lr: float, momentum: float, weight_decay: float,
              generator: torch.Generator, batch_loss: Callable[[Head, torch.Tensor], torch.Tensor],
              after_step: Optional[Callable[[Head], None]] = None, max_grad_norm: Optional[float] = None
              ) -> tuple[Head, float, int]:
    """``epochs`` passes of SGD over ``n`` items in shuffled batches; ``batch_loss(head, batch positions)``
    gives the loss. Returns (trained head, mean loss, steps). The given head is not modified."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in head.items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=momentum, weight_decay=weight_decay)
    total, steps = 0.0, 0
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, batch_size):
                loss = batch_loss(params, order[start: start + batch_size])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
                opt.step()
                total += float(loss.detach())
                steps += 1
                if after_step is not None:
                    after_step(params)
    if steps and not np.isfinite(total):
        raise FloatingPointError(f"the linear head diverged (loss {total}); lower its learning rate")
    return {k: v.detach() for k, v in params.items()}, (total / steps if steps else float("nan")), steps


def train_head(head: Head, features: torch.Tensor, labels: torch.Tensor, epochs: int, lr: float, batch_size: int,
               momentum: float = 0.9, weight_decay: float = 0.0, generator: Optional[torch.Generator] = None
               ) -> tuple[Head, float]:
    """Cross-entropy SGD of the linear head on (features, labels); returns (head, mean loss)."""
    if len(features) == 0:
        return copy_head(head), float("nan")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    labels = labels.long()

    def ce(params: Head, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head_logits(params, features[idx]), labels[idx])

    trained, loss, _ = sgd_steps(head, len(features), epochs, batch_size, lr, momentum, weight_decay, gen, ce)
    return trained, loss


def head_metrics(run, head: Head, test_features: torch.Tensor) -> dict:
    """The evaluator's metrics of encoder + head on the test set, plus per-class accuracy."""
    with torch.no_grad():
        logits = head_logits(head, test_features)
    return score(run, logits.argmax(1), logits)


def score(run, predictions: torch.Tensor, logits: Optional[torch.Tensor] = None) -> dict:
    out = run.evaluator.score(predictions, logits)
    y = run.evaluator.y
    correct = (predictions == y).double()
    out["class_accuracy"] = [float(correct[y == c].mean()) if bool((y == c).any()) else None
                             for c in range(run.num_classes)]
    return out
