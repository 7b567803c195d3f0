"""FedDifRC ("FedDifRC: Unlocking the Potential of Text-to-Image Diffusion Models in Heterogeneous Federated
Learning"): diffusion representations steering local training.

Local objective (Eq. 14): L = L_CE + λ_TDCL·L_TDCL + λ_NDCR·L_NDCR (λ = 1 in the paper); server: FedAvg.

- Fused diffusion features (Eq. 8): the UNet's decoder blocks L ∈ ``layers`` (default {2, 3, 4} of 4;
  L = 1 is the lowest resolution, hook ``up.{L-1}``), a channel PCA per layer (d/2, d/4, d/4 of d by
  default, ``dims`` to choose), spatial pooling (``pool``), concatenation to d = the encoder's z dim, so
  that z and the features are comparable (FusedFeatures in guidance/fused.py).
- TDCL (Eq. 10-11): conditional representations F̃_i^c of image x_i at timestep 0 under every prompt
  "a photo of a {class c}"; positive = the true class, negatives = the others.
  s(z, F) = cos(z, F) / U with U = mean_m ‖z_m − F‖₂, and
  L_TDCL = log(1 + Σ_neg exp(s_neg/τ) / exp(s_pos/τ)) = cross-entropy of s/τ with the positive as target.
- NDCR (Eq. 9, 12): H̃_i = fused features of x_i noised to t under the true-class prompt (the paper's 150 on
  SD-1.5 at 224 px; ``t: paper``, the default, matches it to the pipeline's latent size by the resolution shift of
  guidance/timesteps.py: 150 there, 18 on the embedded model's 8 x 8 latents; an integer is used as it is);
  L_NDCR = Σ_q (z_iq − H̃_iq)², averaged over the batch.
- Self-supervised variant (Sec. 4.3, ``self_supervised: true``): positive prompt "a photo of a similar
  object", negatives "a photo of a {name}" for names of a public class vocabulary, NDCR prompt "a photo
  of a visual object", loss L_TDCL + L_NDCR (no cross-entropy, no label used in training); evaluated by
  a linear probe on the frozen encoder (``accuracy`` and ``probe_accuracy``). Sec. 4.3 reports linear
  evaluation without defining it; the probe is FedEMA's released one, whose protocol Table 5's self-supervised
  baselines come from (``_linear_probe.py``: a linear layer trained with Adam on the features of every training
  sample; ``probe: sklearn`` a logistic regression).

Decisions where the paper is silent (each is an option, default first)
- ``condition_refresh: never``: F̃ computed once per sample and class prompt without the model condition
  and cached (the paper's own 1.48x FedAvg wall time is only consistent with stored features, and the
  released code loads precomputed ones). ``round``: the paper's literal variant: once per round, each
  participating client recomputes F̃ for all its samples and every prompt with c_i = h(x_i) of the
  global encoder it received (eval mode), injected per ``condition_mode`` (``append``: one extra
  context token through a fixed seeded ConditionMap from z's dim to the text hidden size; ``add``: added
  to every token, as the released code; ``none``), batched; its cost is reported per round as
  ``condition_seconds`` and ``condition_unet_images`` (summed over the round's clients).
  ``every_k``: a client recomputes when its last refresh is ``refresh_every`` or more rounds old (kept in
  its own state), else reuses it.
- The PCA bases (one for TDCL at t = 0, one for NDCR at t) are fitted once on the server on the public
  pool when ``data.public_fraction > 0``, else on a seeded sample of the clients' training images (the
  run's guidance record says which), saved in the run directory and shared by every client. TDCL's basis
  is fitted on maps without the client condition (no trained encoder exists at setup); the released code
  refits PCA on every batch, which gives inconsistent bases, and is not reproduced.
- U is estimated on the current mini-batch and detached (the all-samples mean is O(n²) per step).
  One U per target vector F (Eq. 10 defines it for F̃_i; negatives use their own F̃_j).
- ``spread: normalized``: U from the distances between the L2-normalised z and F (U ∈ [0, 2]), so that
  s = cos/U does not depend on the scales of z and of the features. ``raw`` is Eq. 10 literally: with
  the embedded model's fused features (norm ≈ 3) and the CNN's z (norm in the tens) U is large, s/τ
  spans well under one logit and L_TDCL stays at log C (measured on configs/demo.yaml, TDCL alone, 10
  rounds: total loss 2.68 = CE ≈ 0.45 + 2.23, log 10 = 2.30; normalised: 1.32, TDCL ≈ 0.87).
- ``ndcr_form: mse_normalized``: Eq. 12 on L2-normalised z and H̃ (scale-free; default);
  ``mse_raw``: Eq. 12 literally; ``kl``: the released code's KL(softmax(Ĥ) ‖ softmax(ẑ)) of the
  normalised vectors, batch mean.
- d: the fused features have z's dim. When the chosen layers cannot give that many (a layer's PCA
  gives at most its channel count; the embedded UNet's decoder layers 2-4 have 128, 128, 64 channels,
  so at most 256 with the halving split), setup raises a ConfigError naming the fixes: ``fused_dim``
  (the features are lifted into z's space by a fixed seeded map with orthonormal columns, which keeps
  their norms, distances and cosines), ``model.feature_dim`` or ``dims``. ``fused_dim: auto`` takes the
  most the layers give (at most z's dim) and lifts when that is fewer.
- Self-supervised negatives: a seeded draw of ``negatives`` names from ``vocabulary`` (default the 100
  CIFAR-100 class names; the paper draws from Tiny-ImageNet's or CIFAR-100's), the same for every
  sample: per-sample draws would cost the same UNet passes but one cached context set per sample.
- ``seed`` seeds the features' noise (per sample index), the PCA, the condition map, the lift and the
  vocabulary draw.
- ``image_size: paper``: images are resized to 224 x 224 before the VAE (Sec. 4.1: "the image size is
  224x224", decoder maps of {7, 14, 28, 28} on SD-1.5), not to the pipeline's 512, which costs about five
  times the UNet work; fedguide's own models (the embedded ones, trained on 32-px images only) take their
  own size. ``native``: the data's own size; ``pipeline``: the pipeline's; an integer: that size. A size
  the VAE cannot take is refused when the method is built (guidance/pipeline_facts.py); the size is in
  the feature-cache key and the run's guidance record.

Settings chosen for the embedded benchmark (configs/demo.yaml's ``method_options``; benchmarks/guidance_study.py,
each stage chosen on a validation tenth of the training data, seeds 0-2, results/guidance_study/demo.md):
λ_NDCR = 16, t = 150, τ = 0.03. On the embedded 8x8x4 latents the loss weights, not the timestep, decide: at the
paper's λ = 1 FedDifRC stays within seed noise of FedAvg (+2.0 [−2.9, +5.1] points of last-k test accuracy at
t = 150; ``t: paper``, 18 there, +1.1), at λ_NDCR 4, 16 and 64 it gains +11.3, +13.0 and +11.1, and τ moves it by
less than 0.3. It stays 2.5 [2.3, 2.7] points below FedRCL, and an oracle guidance source (features of a network
trained on the guidance pool's labels) gains less (+7.8 at its own best weights): the loss form and its weight
at this scale, not the guidance model, are the limit. Run untuned on the diffusion-methods suite (a quarter
of the pool, 20 rounds, seeds 0-2; benchmarks/results/diffusion_methods/) the same settings are above FedAvg in
every scenario on every seed (Dir 0.05 +6.3 [+4.1, +8.0]) and above FedRCL at Dir 0.05 (+2.8 [+0.3, +5.1]), NID2
and the long tail; FedRCL stays ahead at Dir 0.2 (by 1.6). The defaults stay the paper's (λ = 1, ``t: paper``,
τ 0.06), and configs/paper/ keep them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, model_validator

from fedguide.guidance.condition import ConditionMap
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec
from fedguide.guidance.fused import FusedFeatures, layer_dims
from fedguide.guidance.hooks import decoder_layer
from fedguide.guidance.shared import PROMPT, class_prompts, feature_store, guidance_model
from fedguide.guidance.store import FeatureKey, FeatureStore
from fedguide.guidance.timesteps import pipeline_t, t_note
from fedguide.methods.diffusion_guided._diffusion_features import (ClientPositions, ClientTargets, GuidanceRecord, RowLookup,
                                                  block_channels, cached_features, data_recipe, digest, feature_key,
                                                  fit_basis, fit_sample, guidance_images, in_batches, input_size,
                                                  input_size_note, loaded_input_size, prompt_maps, prompt_vectors,
                                                  timed, training_rows)
from fedguide.methods._linear_probe import LinearProbe, ProbeParams, linear_probe  # noqa: F401  (linear_probe: its tests)
from fedguide.methods.base import METHODS, Method
from fedguide.registry import ConfigError

if TYPE_CHECKING:
    from fedguide.guidance.model import GuidanceModel

SIMILAR_PROMPT = "a photo of a similar object"
PAPER_IMAGE_SIZE = 224  # Sec. 4.1
VISUAL_PROMPT = "a photo of a visual object"
# CIFAR-100's class names: the public vocabulary of the self-supervised variant's negatives.
CIFAR100_NAMES = (
    "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly camel can "
    "castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup dinosaur dolphin "
    "elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster "
    "man maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree pear pickup_truck "
    "pine_tree plain plate poppy porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk "
    "skyscraper snail snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television tiger "
    "tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm"
).split()


class FedDifRCParams(ProbeParams):
    model_config = ConfigDict(extra="forbid")
    tdcl: bool = Field(True, description="Text-driven Diffusion Contrastive Learning (Table 1 ablation)")
    ndcr: bool = Field(True, description="Noise-driven Diffusion Consistent Restriction (Table 1 ablation)")
    lambda_tdcl: float = Field(1.0, ge=0.0, description="weight of L_TDCL (paper: 1)")
    lambda_ndcr: float = Field(1.0, ge=0.0, description="weight of L_NDCR (paper: 1)")
    tau: float = Field(0.06, gt=0.0, description="TDCL temperature (Fig. 6 right)")
    spread: Literal["normalized", "raw"] = Field(
        "normalized", description="U of Eq. 10 from distances of L2-normalised z and F (scale-free) or raw ones")
    t: Union[Literal["paper"], Annotated[int, Field(ge=0)]] = Field(
        "paper", description="NDCR noise timestep: paper = the paper's t = 150 on SD-1.5 at 224 px matched to this "
                             "pipeline's latent size (guidance/timesteps.py); an integer is used as it is "
                             "(0: clean latents, no noise)")
    layers: list[int] = Field([2, 3, 4], min_length=1, description="decoder layers L (1 = lowest resolution); "
                                                                   "one layer = Table 2's single-layer rows")
    dims: Optional[list[int]] = Field(None, description="per-layer PCA dims summing to d; null = d/2, d/4, ...")
    # auto by default: SD-1.5's decoder layers give the paper's d = 512 exactly; a smaller guidance model
    # (the embedded one gives 256) is lifted into z's space instead of refusing to run.
    fused_dim: Union[Annotated[int, Field(ge=1)], Literal["auto"], None] = Field(
        "auto", description="dims of the fused features; auto = the most the layers give, at most z's dim; "
                            "null = z's dim exactly; fewer than z's: lifted into z's space by a fixed orthonormal map")
    pool: Literal["mean", "l2"] = Field("mean", description="spatial pooling of each layer's reduced map")
    ndcr_form: Literal["mse_normalized", "mse_raw", "kl"] = "mse_normalized"
    condition_refresh: Literal["never", "round", "every_k"] = Field(
        "never", description="never = conditional features cached once without the model condition; round = "
                             "recomputed per round per participating client with h(x) of the global encoder")
    refresh_every: int = Field(5, ge=1, description="condition_refresh=every_k: rounds a refresh is reused")
    condition_mode: Literal["append", "add", "none"] = Field(
        "append", description="how h(x) enters the UNet context when refreshed (never uses none)")
    self_supervised: bool = Field(False, description="Sec. 4.3: TDCL + NDCR without labels, linear-probe evaluation")
    negatives: int = Field(9, ge=1, description="self-supervised: vocabulary names drawn as negative prompts")
    vocabulary: Optional[list[str]] = Field(None, description="self-supervised negatives' names; null = CIFAR-100's")
    fit_samples: int = Field(1000, ge=2, description="images the PCA bases are fitted on")
    samples_per_image: int = Field(64, ge=1, description="spatial positions per image and layer in the PCA fit")
    extract_batch: int = Field(32, ge=1, description="images per UNet batch (times the prompts per image)")
    seed: int = Field(0, ge=0, description="noise, PCA, condition map, lift and vocabulary seed")
    image_size: Union[Annotated[int, Field(ge=1)], Literal["paper", "native", "pipeline"]] = Field(
        "paper", description="pixels per side of the images the VAE encodes: paper = 224 (Sec. 4.1; fedguide's "
                             "own 32-px models: their size), native = the data's, pipeline = the pipeline's")

    @model_validator(mode="after")
    def _check(self) -> "FedDifRCParams":
        if self.self_supervised and not (self.tdcl or self.ndcr):
            raise ValueError("self_supervised trains on TDCL + NDCR alone; keep tdcl or ndcr on")
        if any(level < 1 for level in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers {self.layers}: decoder layers are 1, 2, ... (1 = lowest resolution), each once")
        return self


# ---- the losses ------------------------------------------------------------------------------------
def _sq_dist(a: torch.Tensor, b: torch.Tensor, lift: Optional[torch.Tensor]) -> torch.Tensor:
    """‖a_m − lift·b_n‖² for every pair [M, N], without forming lift·b (lift has orthonormal columns)."""
    projected = a if lift is None else a @ lift
    return (a.square().sum(1, keepdim=True) + b.square().sum(1) - 2 * projected @ b.T).clamp_min(0)


def tdcl_similarity(z: torch.Tensor, targets: torch.Tensor, spread: str = "raw",
                    lift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. 10: s[i, p] = cos(z_i, F_ip) / U_ip, U_ip = mean_m ‖z_m − F_ip‖₂ over the batch (detached);
    ``spread="normalized"`` measures the distances between the L2-normalised vectors.

    ``lift`` [z dim, d] with orthonormal columns: the targets are d-dim and stand for lift·F. Every term
    is computed in the d-dim space (z·lift·F = (liftᵀz)·F, ‖lift·F‖ = ‖F‖): the same values and
    gradients as lifting the batch's B·P targets, at the cost of projecting B vectors."""
    batch, per_sample, dim = targets.shape
    z_hat, f_hat = F.normalize(z, dim=1), F.normalize(targets.to(z.dtype), dim=-1)
    cos = torch.einsum("bd,bpd->bp", z_hat if lift is None else z_hat @ lift, f_hat)
    with torch.no_grad():
        if spread == "normalized":
            anchors, flat = z_hat.detach(), f_hat.reshape(batch * per_sample, dim)
        else:
            anchors, flat = z.detach(), targets.to(z.dtype).reshape(batch * per_sample, dim)
        u = _sq_dist(anchors, flat, lift).sqrt().mean(dim=0).reshape(batch, per_sample).clamp_min(1e-12)
    return cos / u


def tdcl_loss(z: torch.Tensor, targets: torch.Tensor, positive: torch.Tensor, tau: float,
              spread: str = "raw", lift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. 11, batch mean: log(1 + Σ_neg e^{s_neg/τ} / e^{s_pos/τ}) = logsumexp(s/τ) − s_pos/τ."""
    return F.cross_entropy(tdcl_similarity(z, targets, spread, lift) / tau, positive)


def ndcr_loss(z: torch.Tensor, target: torch.Tensor, form: str = "mse_normalized") -> torch.Tensor:
    """Eq. 12, batch mean of Σ_q (z_q − H_q)² (``mse_raw``), on L2-normalised vectors (``mse_normalized``),
    or KL(softmax(Ĥ) ‖ softmax(ẑ)) of the normalised vectors (``kl``)."""
    if form == "mse_raw":
        return (z - target).square().sum(dim=1).mean()
    z_hat, h_hat = F.normalize(z, dim=1), F.normalize(target, dim=1)
    if form == "mse_normalized":
        return (z_hat - h_hat).square().sum(dim=1).mean()
    if form == "kl":
        return F.kl_div(F.log_softmax(z_hat, dim=1), F.log_softmax(h_hat, dim=1), reduction="batchmean",
                        log_target=True)
    raise ConfigError(f"unknown ndcr_form '{form}'; use mse_normalized, mse_raw or kl")


def orthonormal_lift(in_dim: int, out_dim: int, seed: int) -> torch.Tensor:
    """[out_dim, in_dim] with orthonormal columns: x -> lift @ x keeps norms, distances and cosines."""
    gaussian = torch.randn(out_dim, in_dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(gaussian).Q.float()


def max_halving_dim(channels: list[int], limit: int) -> int:
    """The largest d <= limit whose halving split over these layers fits every layer's channels."""
    for d in range(min(limit, sum(channels)), 0, -1):
        try:
            split = layer_dims(d, len(channels))
        except ConfigError:
            continue
        if all(s <= c for s, c in zip(split, channels)):
            return d
    return 0


@dataclass(frozen=True)
class _Extraction:
    """What setup's steps share: the guidance model and store, the run's guidance record, whether to rebuild,
    the decoder layers, the training samples the features are cached for and the bases' fit sample."""
    model: GuidanceModel
    store: FeatureStore
    record: GuidanceRecord
    rebuild: bool
    layers: tuple[str, ...]
    rows: np.ndarray
    fit_idx: np.ndarray
    fit_desc: dict


@dataclass
class DifRCRound:
    """A client's round: NDCR's and TDCL's targets (``ClientTargets`` by batch; a refreshed TDCL: a tensor indexed
    by the batch's positions in ``client_rows``) and the seconds and UNet images of a condition refresh."""

    ndcr: Any = None
    tdcl: Any = None
    client_rows: Any = None
    condition_seconds: float = 0.0
    condition_images: int = 0


@METHODS.register("feddifrc", params=FedDifRCParams)
class FedDifRC(Method):
    """FedDifRC: CE + TDCL (conditional diffusion features) + NDCR (denoising diffusion features), FedAvg."""

    paper = "https://github.com/hwang52/FedDifRC"

    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)

    def __init__(self, params: FedDifRCParams, run):
        super().__init__(params, run)
        self.z_dim = int(run.model.feature_dim)
        self.fused_dim = self.z_dim if params.fused_dim in (None, "auto") else params.fused_dim  # auto: in setup
        if self.fused_dim > self.z_dim:
            raise ConfigError(f"method.fused_dim={self.fused_dim} exceeds z's {self.z_dim} dims; the features can "
                              "only be lifted into z's space, not projected out of it: lower fused_dim")
        self.lift = None
        self.refresh = params.condition_refresh if params.tdcl else "never"
        if params.self_supervised:
            vocabulary = [name.replace("_", " ") for name in (params.vocabulary or CIFAR100_NAMES)]
            if len(vocabulary) < params.negatives:
                raise ConfigError(f"method.negatives={params.negatives} but the vocabulary has {len(vocabulary)} "
                                  "names; lower negatives or give a longer vocabulary")
            draw = np.random.default_rng(np.random.SeedSequence([params.seed, 0x55])).choice(
                len(vocabulary), params.negatives, replace=False)
            self.tdcl_prompts = [SIMILAR_PROMPT] + [PROMPT.format(vocabulary[i].lower()) for i in sorted(draw)]
            self.ndcr_prompts = [VISUAL_PROMPT]
        else:
            self.tdcl_prompts = class_prompts(run.data.splits.class_names)
            self.ndcr_prompts = list(self.tdcl_prompts)
        self._stats = {"condition_seconds": 0.0, "condition_unet_images": 0}
        self._probe_model = None
        # Resolved (and refused if the VAE cannot take it) when the method is built, so --dry-run says so.
        self.image_size = input_size(run, params.image_size, PAPER_IMAGE_SIZE) if params.tdcl or params.ndcr else None

    # ---- server: bases and cached features ----------------------------------------------------------
    def _recipe(self, layers: tuple[str, ...]) -> FusedFeatures:
        p = self.params
        return FusedFeatures(layers, d=self.fused_dim, dims=p.dims, pool=p.pool,
                             samples_per_image=p.samples_per_image, seed=p.seed)

    def _check_capacity(self, model, layers: tuple[str, ...]) -> None:
        channels = [block_channels(model.unet, name) for name in layers]
        if any(c is None for c in channels):
            return  # a layout this cannot read: the fit reports a mismatch itself
        if self.params.fused_dim == "auto":
            dims = self.params.dims
            self.fused_dim = min(self.z_dim, sum(dims)) if dims else max_halving_dim(channels, self.z_dim)
        split = layer_dims(self.fused_dim, len(layers), self.params.dims)
        if all(s <= c for s, c in zip(split, channels)):
            return
        best = max_halving_dim(channels, self.z_dim)
        raise ConfigError(
            f"FedDifRC: fused features of {self.fused_dim} dims split {split} over decoder layers "
            f"{self.params.layers} ({list(layers)}), which have {channels} channels: a layer's PCA gives at most "
            f"its channels. Fix: method.fused_dim={best} (the features are lifted into z's {self.z_dim} dims by a "
            f"fixed orthonormal map), or model.feature_dim={best} (cnn, mlp), or method.dims=[...] with at most "
            f"{channels} per layer, summing to d")

    def _positive_ids(self, indices: np.ndarray) -> torch.Tensor:
        if self.params.self_supervised:
            return torch.zeros(len(indices), 1, dtype=torch.long)
        return self.run.data.splits.train_y[torch.as_tensor(indices, dtype=torch.long)].unsqueeze(1)

    def setup(self):
        p = self.params
        if not (p.tdcl or p.ndcr):
            return  # plain cross-entropy: nothing to extract
        ex = self._open_guidance()
        if p.tdcl:
            self._build_tdcl(ex)
            self._fit_or_load_basis(ex, "tdcl", self.tdcl_feats, self.tdcl_prompts, self.tdcl_tokens)
            if self.refresh == "never":
                self._tdcl = self._cache_tdcl(ex)
        if p.ndcr:
            tokens = self._build_ndcr(ex)
            self._fit_or_load_basis(ex, "ndcr", self.ndcr_feats, self.ndcr_prompts, tokens)
            self._ndcr = self._cache_ndcr(ex, tokens)
        ex.record.write()

    def _open_guidance(self) -> _Extraction:
        """Loads the guidance model and feature store, settles the fused dims and draws the bases' fit sample,
        noting each in the run's guidance record."""
        p, run = self.params, self.run
        model, store = guidance_model(run.guidance, run), feature_store(run.guidance)
        record = GuidanceRecord(run, "feddifrc")
        rebuild = run.guidance.rebuild and record.first
        layers = tuple(decoder_layer(level) for level in p.layers)
        if self.image_size is None:  # the pipeline's configs were not readable before the model was loaded
            self.image_size = loaded_input_size(run, p.image_size, PAPER_IMAGE_SIZE)
        record.note("image_size", input_size_note(p.image_size, self.image_size, model))
        self._settle_fused_dim(model, layers, record)
        rows = training_rows(run)
        self._rows = RowLookup(rows)
        fit_idx, fit_source = fit_sample(run, p.fit_samples, p.seed)
        record.note("basis_fit", fit_source, f"FedDifRC: PCA bases fitted on {fit_source}")
        record.note("condition_refresh", self.refresh)
        fit_desc = {"data": data_recipe(run.data_settings), "samples": digest(fit_idx), "count": int(len(fit_idx))}
        return _Extraction(model, store, record, rebuild, layers, rows, fit_idx, fit_desc)

    def _settle_fused_dim(self, model: GuidanceModel, layers: tuple[str, ...], record: GuidanceRecord) -> None:
        """Checks the layers can give the fused dims (settling ``auto``) and builds the lift when they are fewer."""
        self._check_capacity(model, layers)
        if self.fused_dim < self.z_dim:
            self.lift = orthonormal_lift(self.fused_dim, self.z_dim, self.params.seed)
        record.note("fused_dim", self.fused_dim)

    def _build_tdcl(self, ex: _Extraction) -> None:
        """TDCL's recipe at t = 0 (with the condition map when refreshed per round) and its prompts' tokens."""
        p = self.params
        mode = "none" if self.refresh == "never" else p.condition_mode
        cmap = ConditionMap(self.z_dim, ex.model.context_dim, p.seed) if mode != "none" else None
        spec = FeatureSpec(ex.layers, t=0, noise_seed=p.seed, condition_mode=mode, extra={"role": "tdcl"},
                           image_size=self.image_size)
        self.tdcl_feats = DiffusionFeatures(ex.model, spec, self._recipe(ex.layers), cmap)
        self.tdcl_tokens = ex.model.encode_text(tuple(self.tdcl_prompts)).tokens

    def _build_ndcr(self, ex: _Extraction) -> torch.Tensor:
        """NDCR's recipe at the noise timestep t; returns its prompts' tokens."""
        p = self.params
        t = pipeline_t(p.t, ex.model, self.image_size)
        ex.record.note("ndcr_t", t_note(p.t, t), f"FedDifRC: NDCR features at t = {t} ({p.t})")
        spec = FeatureSpec(ex.layers, t=t, noise_seed=p.seed, extra={"role": "ndcr"}, image_size=self.image_size)
        self.ndcr_feats = DiffusionFeatures(ex.model, spec, self._recipe(ex.layers))
        return ex.model.encode_text(tuple(self.ndcr_prompts)).tokens

    def _fit_or_load_basis(self, ex: _Extraction, role: str, feats: DiffusionFeatures, prompts: list[str],
                           tokens: torch.Tensor) -> None:
        """Fits the role's PCA basis on the fit sample, each image under its positive prompt (or loads it)."""
        run, batch = self.run, self.params.extract_batch

        def batches():
            return (prompt_maps(feats, guidance_images(run, b), b, tokens, self._positive_ids(b))
                    for b in in_batches(ex.fit_idx, batch))

        fitted = fit_basis(feats, f"feddifrc_{role}", run, ex.store, {**ex.fit_desc, "prompts": prompts}, batches,
                           len(ex.fit_idx), ex.rebuild)
        ex.record.note(f"{role}_basis_fitted", fitted)

    def _cache_tdcl(self, ex: _Extraction) -> np.ndarray:
        """F̃ of every training sample under every TDCL prompt, without the model condition, computed once."""
        run, every = self.run, torch.arange(len(self.tdcl_prompts))
        key = feature_key(self.tdcl_feats, run, ex.rows, prompts=self.tdcl_prompts, per_sample="every prompt")

        def tdcl_rows(b):
            return prompt_vectors(self.tdcl_feats, guidance_images(run, b), b, self.tdcl_tokens,
                                  every.expand(len(b), -1))

        return self._cached(ex, key, tdcl_rows, "FedDifRC conditional features", "tdcl_features")

    def _cache_ndcr(self, ex: _Extraction, tokens: torch.Tensor) -> np.ndarray:
        """H̃ of every training sample under its NDCR prompt (true class or visual object), computed once."""
        run = self.run
        key = feature_key(self.ndcr_feats, run, ex.rows, prompts=self.ndcr_prompts,
                          per_sample="visual object" if self.params.self_supervised else "true class")

        def ndcr_rows(b):
            return prompt_vectors(self.ndcr_feats, guidance_images(run, b), b, tokens, self._positive_ids(b))[:, 0]

        return self._cached(ex, key, ndcr_rows, "FedDifRC denoising features", "ndcr_features")

    def _cached(self, ex: _Extraction, key: FeatureKey, compute_rows: Callable[[np.ndarray], torch.Tensor],
                description: str, note: str) -> np.ndarray:
        """The store's features of ``key`` (computed once, timed); notes their folder, seconds and shape."""
        features, seconds = timed(lambda: cached_features(
            ex.store, key, ex.rows, compute_rows, self.params.extract_batch, ex.rebuild, description))
        ex.record.note(note, {"folder": str(ex.store.path(key)), "seconds": round(seconds, 3),
                              "shape": list(features.shape)})
        return features

    # ---- client ------------------------------------------------------------------------------------
    def _refresh(self, model, ctx) -> torch.Tensor:
        """F̃ of every sample of this client under every prompt, conditioned on the received encoder's h(x)."""
        indices = ctx.data.indices.numpy()
        every = torch.arange(len(self.tdcl_prompts))
        was_training = model.training
        model.eval()
        out = []
        with torch.no_grad():
            for b in in_batches(indices, self.params.extract_batch):
                condition = model.encoder(ctx.batch(torch.from_numpy(b))[0])  # the client's data where h is
                out.append(prompt_vectors(self.tdcl_feats, guidance_images(self.run, b), b, self.tdcl_tokens,
                                          every.expand(len(b), -1), condition=condition))
        model.train(was_training)
        return torch.cat(out)

    def begin_local(self, model, ctx) -> DifRCRound:
        p = self.params
        state = DifRCRound()
        if self.lift is not None:  # to the device before the steps, once: a step never copies it from the host
            self.lift = self.lift.to(ctx.device)
        # The client's cached targets go to the device once per round; a step looks its batch up there.
        n = len(self.run.data.splits.train_y)
        if p.ndcr and p.lambda_ndcr > 0:
            state.ndcr = ClientTargets(self._ndcr, self._rows, ctx, n, ctx.device)
        if self.refresh == "never":
            if p.tdcl and p.lambda_tdcl > 0:
                state.tdcl = ClientTargets(self._tdcl, self._rows, ctx, n, ctx.device)
            return state
        state.client_rows = ClientPositions(ctx.data.indices, n, ctx.device)
        stored = ctx.state.get("tdcl_features")
        if (self.refresh == "every_k" and stored is not None
                and ctx.round - int(ctx.state["tdcl_round"]) < self.params.refresh_every):
            state.tdcl = stored
            return state
        features, seconds = timed(lambda: self._refresh(model, ctx))
        state.tdcl = features
        state.condition_seconds, state.condition_images = seconds, len(features) * len(self.tdcl_prompts)
        if self.refresh == "every_k":
            ctx.update_state(tdcl_features=features, tdcl_round=ctx.round)
        return state

    def _lift_like(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        if self.lift is not None and (self.lift.device != like.device or self.lift.dtype != like.dtype):
            self.lift = self.lift.to(like.device, like.dtype)
        return self.lift

    def local_loss(self, model, x, y, ctx, state: DifRCRound):
        p = self.params
        z, logits = model.forward_features(x)
        loss = z.new_zeros(()) if p.self_supervised else F.cross_entropy(logits, y)
        use_tdcl, use_ndcr = p.tdcl and p.lambda_tdcl > 0, p.ndcr and p.lambda_ndcr > 0
        if use_tdcl:
            if self.refresh == "never":
                targets = state.tdcl(ctx)
            else:
                targets = state.tdcl[state.client_rows(ctx)]
            positive = torch.zeros_like(y) if p.self_supervised else y
            loss = loss + p.lambda_tdcl * tdcl_loss(z, targets.to(z.device, z.dtype), positive, p.tau, p.spread,
                                                    self._lift_like(z))
        if use_ndcr:
            target = state.ndcr(ctx).to(z.dtype)
            lift = self._lift_like(z)
            # One target per sample: lifting it costs what projecting z would (unlike TDCL's B·P targets).
            loss = loss + p.lambda_ndcr * ndcr_loss(z, target if lift is None else target @ lift.T, p.ndcr_form)
        return loss

    def client_upload(self, model, ctx, state: DifRCRound):
        upload = super().client_upload(model, ctx, state)
        if self.refresh != "never":
            upload.update(condition_seconds=float(state.condition_seconds),
                          condition_unet_images=int(state.condition_images))
        return upload

    # ---- server ------------------------------------------------------------------------------------
    def aggregate(self, round_, global_weights, uploads):
        self._stats = {"condition_seconds": sum(float(u.get("condition_seconds", 0.0)) for u in uploads),
                       "condition_unet_images": sum(int(u.get("condition_unet_images", 0)) for u in uploads)}
        return super().aggregate(round_, global_weights, uploads)

    def evaluate(self, round_, global_weights):
        if self.params.self_supervised:
            metrics = self._probe(global_weights)
        else:
            metrics = super().evaluate(round_, global_weights)
        if self.refresh != "never":
            metrics.update(self._stats)
        return metrics

    def _probe(self, global_weights) -> dict:
        if self._probe_model is None:
            self._probe_model = LinearProbe(self.run, self.params)
        return self._probe_model(global_weights)
