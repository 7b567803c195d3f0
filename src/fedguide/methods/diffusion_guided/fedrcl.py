"""FedRCL (Seo, Kim, Kim, Han, CVPR 2024): relaxed contrastive learning for federated learning.

Local objective: CE + w · mean over encoder levels l of L_RCL(z^l), server = FedAvg (w = ``weight``, or λ
under ``lambda_role: weight``), with

    L_RCL = L_SCL + β · L_DP                                     (per anchor i, averaged over anchors)
    L_SCL(i) = −1/|P_i| Σ_{p∈P_i} log( e^{s_ip/τ} / Σ_{a≠i} e^{s_ia/τ} )          supervised contrastive
    L_DP(i)  = −log( e^{s_ii/τ} / (e^{s_ii/τ} + Σ_{p∈P_i^λ} e^{s_ip/τ}) )
             = log(1 + Σ_{p∈P_i^λ} e^{(s_ip − 1)/τ})                              divergence penalty

s = cosine similarity, P_i = the other samples of i's class in the batch, P_i^λ = {p ∈ P_i : s_ip > λ}
(the "excessively similar" positive pairs; the threshold is λ under ``lambda_role: threshold``, else
``threshold``). The penalty contrasts each anchor with itself against its
too-similar positives, pushing those apart until their similarity falls under λ; this is the
released code's ``penalty`` pair (``loss_type: unsupervised`` = the sample itself as positive,
``neg_sample_type: intra_class_thresholding`` = same-class pairs above the threshold as negatives).
Sources: the form above follows the paper's description (SCL plus
a divergence penalty on excessively similar same-class pairs, applied to multiple levels) and the
released code (skynbe/FedRCL: utils/loss.py ``CLLoss``, clients/rcl_client.py, configs/client/
fedrcl.yaml). Of the paper only the abstract and introduction could be obtained: the values below
are checked against the released configuration and against FedDifRC, whose tables this baseline
serves.

Hyperparameters and what they mean:
- λ (``lam``, default 0.6) and ``lambda_role`` (default ``threshold``): FedDifRC's appendix (its baseline
  hyperparameters) tunes "FedRCL λ" over {0.2, 0.4, 0.6, 0.8}, selects 0.6 and calls it "the regularization
  coefficient", with β 1.0; its released code (hwang52/FedDifRC) holds no FedRCL and names no such setting
  (its only size option is ``--diffu_size 224``, utils/options.py L29). Which FedRCL setting λ is, is
  therefore an option:
  ``threshold`` (the default): λ is the similarity above which a positive pair is penalised (P_i^λ above).
  FedRCL's released config has exactly one setting on a 0-1 scale that a {0.2, ..., 0.8} grid can tune, the
  penalty's ``threshold: 0.7`` (skynbe/FedRCL/configs/client/fedrcl.yaml L27), which sits inside that grid;
  its loss weights are all 1 (the SCL pair's ``weight: 1`` L19, the penalty's L24, ``rcl_loss.weight: 1``
  L28), and a grid for a weight of 1 that stops at 0.8 would not contain the released value; β, the other
  tuned number, is the penalty weight. ``weight``: λ weighs the RCL term against cross-entropy instead, and
  the threshold is ``threshold`` (default 0.7, the released config's). Each reading hands one setting to λ:
  ``weight`` applies under ``threshold`` only and ``threshold`` under ``weight`` only (a value set for the
  other reading is refused rather than ignored). ``lam: 0.7`` with the default role is FedRCL's own setting.
- β (``beta``, default 1.0): the weight of the divergence penalty (FedDifRC: tuned over
  {0.5, 1, 2, 3, 4}, selected 1.0; the released config's penalty weight is 1).
- τ (``tau``, default 0.05): the released config's temperature, used for both terms.
- ``weight`` (default 1.0): under ``lambda_role: threshold``, the weight of the RCL term against CE (the
  released config: 1).
- Levels (``levels``, default all): the paper applies RCL to the intermediate representations as
  well as the final one and averages the per-level losses (released code: ``branch_level [0..4]``
  of ResNet-18 = stem and the four stages, mean over levels). Here the levels are the stages of
  ``fedguide.models.taps.encoder_stages`` (cnn: 3, resnet10: 5, mlp: 2); ``levels: [-1]`` keeps
  only the last one (z before its final activation).
- ``preactivation`` (default true): each level is tapped before the last activation of its stage,
  as the released code does (``feature_relu: False``: the stem and every stage's last block before
  its final ReLU), then global-average-pooled and L2-normalised. After a ReLU every feature is
  non-negative and cosine similarities crowd together: on configs/smoke.yaml at initialisation
  the cnn's post-activation levels give a mean cosine of 0.75-0.88 between samples of different
  classes and put 98-100 % of same-class pairs over λ = 0.6 (pre-activation: 0.26-0.77, 65-98 %),
  and training from them was much worse (one seed, 3 rounds: best accuracy 33 % post-activation,
  62 % pre-activation; FedAvg 57 %).

Decisions where the released code and this implementation differ:
- SCL uses every positive and every other sample as in the paper's equation (Khosla et al.); the
  released code mines one hardest positive and two hardest negatives per anchor (topk_pos 1,
  topk_neg 2), and its penalty keeps only the least similar same-class pair.
- An anchor without a positive in the batch (a class with one sample) has no L_RCL term and is left
  out of the average; it still serves as a negative for the others. A batch with no positive pair at
  all contributes 0.
- Not reproduced: the released trainer's gradient clipping (norm 10) and per-epoch lr decay.

FedDifRC's Table 6 variants (options; both off by default, ◇+† is both on):
- ◇ ``generated: {}``: each client's batches are joined by images the guidance model generated for the
  classes it holds, as many in all as its real ones by default (_generated_data.py, the machinery of
  ``feddda``): ``fedguide run CONFIG method.name=fedrcl 'method.generated={}'``.
- † ``sd_align: w``: + w·‖ẑ − (P e(x))^‖², z's L2 alignment to the guidance model's features of the image
  fed directly into it (t = 0, empty prompt, every UNet block pooled; _sd_alignment.py); the paper gives no
  weight: 1 is align_features' (Table 8) choice. With ◇ the term covers the batch's real samples. The
  features are extracted at FedDifRC's guidance input size (``sd_image_size: paper``, feddifrc's
  ``image_size`` setting and resolution: 224 px on Stable Diffusion, fedguide's own 32-px models their
  own size), not at the data's (CIFAR's 32 px would be 4 x 4 SD latents; ``native`` keeps the data's).
Both need the guidance layer (``pip install 'fedguide[guidance]'``) and the ``guidance:`` section's model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedguide.methods.diffusion_guided._generated_data import GeneratedData, GeneratedDataParams, extra_count, mix
from fedguide.methods.base import METHODS, Method
from fedguide.models.taps import FeatureTap, encoder_stages
from fedguide.registry import ConfigError

if TYPE_CHECKING:
    from fedguide.methods.diffusion_guided._sd_alignment import SDRound


class FedRCLParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lam: float = Field(0.6, ge=-1.0, le=1.0, description="FedDifRC's λ (0.6): the similarity threshold or the RCL "
                                                         "weight, as lambda_role says")
    lambda_role: Literal["threshold", "weight"] = Field(
        "threshold", description="threshold = λ is the similarity above which positive pairs are penalised (the "
                                 "released config's 0.7); weight = λ weighs the RCL term against CE (released: 1)")
    threshold: float = Field(0.7, ge=-1.0, le=1.0, description="lambda_role=weight: the similarity threshold "
                                                               "(released config: 0.7)")
    beta: float = Field(1.0, ge=0.0, description="weight β of the divergence penalty")
    tau: float = Field(0.05, gt=0.0, description="temperature of the contrastive terms")
    weight: float = Field(1.0, ge=0.0, description="lambda_role=threshold: weight of the RCL term against "
                                                   "cross-entropy (released config: 1)")
    levels: Optional[list[int]] = Field(
        None, min_length=1, description="encoder levels to apply RCL to (indices, -1 = last); null = all")
    preactivation: bool = Field(
        True, description="tap each level before its last activation (released code) rather than after")
    generated: Optional[GeneratedDataParams] = Field(
        None, description="◇ (FedDifRC Table 6): each client's data joined by images the guidance model generates for "
                          "its classes (settings of _generated_data.py; {} = the defaults); null = off")
    sd_align: float = Field(0.0, ge=0.0, description="† (FedDifRC Table 6): weight of the L2 alignment of z to the "
                                                     "guidance model's features of the image; 0 = off")
    sd_image_size: Union[Annotated[int, Field(ge=1)], Literal["paper", "native", "pipeline"]] = Field(
        "paper", description="†: pixels per side of the images the VAE encodes, as feddifrc's image_size: paper = "
                             "FedDifRC's 224 (fedguide's own 32-px models: their size), native = the data's, "
                             "pipeline = the pipeline's")

    @model_validator(mode="after")
    def _one_reading(self) -> "FedRCLParams":
        # Each reading of λ hands one of weight / threshold to λ; a value set there would be silently unused. Checked
        # by value, not by what a config named: a run folder's config.yaml writes every option out.
        fields = type(self).model_fields
        if self.lambda_role == "threshold" and self.threshold != fields["threshold"].default:
            raise ValueError(f"threshold {self.threshold} applies with lambda_role: weight; under lambda_role: "
                             "threshold λ (lam) is the threshold: set lam instead")
        if self.lambda_role == "weight":
            if self.weight != fields["weight"].default:
                raise ValueError(f"weight {self.weight} applies with lambda_role: threshold; under lambda_role: "
                                 "weight λ (lam) is the RCL weight: set lam instead")
            if self.lam < 0:
                raise ValueError(f"lam {self.lam} is a loss weight under lambda_role: weight; use lam >= 0")
        return self

    def rcl_threshold(self) -> float:
        """The similarity above which a positive pair is penalised."""
        return self.lam if self.lambda_role == "threshold" else self.threshold

    def rcl_weight(self) -> float:
        """The weight of the RCL term against cross-entropy."""
        return self.lam if self.lambda_role == "weight" else self.weight


def _cosine_matrix(features: torch.Tensor) -> torch.Tensor:
    z = F.normalize(features.flatten(1), dim=1)
    return z @ z.T


def _positives(labels: torch.Tensor) -> torch.Tensor:
    """positives[i, j]: same class and i != j."""
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    return (labels[:, None] == labels[None, :]) & ~eye


def _supcon(sim: torch.Tensor, pos: torch.Tensor, tau: float) -> torch.Tensor:
    eye = torch.eye(sim.shape[0], dtype=torch.bool, device=sim.device)
    logits = (sim / tau).masked_fill(eye, float("-inf"))  # a ≠ i in the denominator
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    return -log_prob.masked_fill(~pos, 0.0).sum(1) / pos.sum(1).clamp(min=1)


def _penalty(sim: torch.Tensor, pos: torch.Tensor, tau: float, lam: float) -> torch.Tensor:
    over = pos & (sim.detach() > lam)  # which pairs count is a hard selection, not differentiated
    logits = ((sim - 1.0) / tau).masked_fill(~over, float("-inf"))
    zero = torch.zeros_like(logits[:, :1])  # the anchor itself: s_ii = 1 → (1 − 1)/τ = 0
    return torch.logsumexp(torch.cat([zero, logits], dim=1), dim=1)


def supcon_per_anchor(features: torch.Tensor, labels: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """L_SCL(i) for every anchor, and the mask of anchors that have a positive (others are 0)."""
    pos = _positives(labels)
    return _supcon(_cosine_matrix(features), pos, tau), pos.any(1)


def divergence_penalty_per_anchor(features: torch.Tensor, labels: torch.Tensor, tau: float, lam: float) -> torch.Tensor:
    """L_DP(i) = log(1 + Σ_{p ∈ P_i, s_ip > λ} exp((s_ip − 1)/τ)) for every anchor (0 without such p)."""
    return _penalty(_cosine_matrix(features), _positives(labels), tau, lam)


def relaxed_supcon_loss(features: torch.Tensor, labels: torch.Tensor, tau: float = 0.05, beta: float = 1.0,
                        lam: float = 0.6) -> torch.Tensor:
    """FedRCL's L_RCL = L_SCL + β·L_DP averaged over the anchors that have a positive in the batch.

    ``features``: (B, ...) representations (cosine similarity: any scale); ``labels``: (B,).
    Returns 0 (still attached to ``features``) when no two samples share a class.
    """
    if features.shape[0] < 2:  # no pair at all (a shape, known on the host without asking the device)
        return features.sum() * 0.0
    pos = _positives(labels)
    has_pos = pos.any(1).to(features.dtype)
    sim = _cosine_matrix(features)
    per_anchor = _supcon(sim, pos, tau)
    if beta != 0:
        per_anchor = per_anchor + beta * _penalty(sim, pos, tau, lam)
    # The mean over anchors with a positive as a masked sum: selecting them (per_anchor[has_pos]) or asking
    # whether there are any would make the host wait for the device every step. Anchors without a positive
    # hold a finite 0, so a batch without pairs gives 0, attached to ``features``.
    return (per_anchor * has_pos).sum() / has_pos.sum().clamp(min=1)


def select_levels(stages: list, levels: Optional[list[int]]) -> list:
    if levels is None:
        return stages
    n = len(stages)
    bad = [i for i in levels if not -n <= i < n]
    if bad:
        raise ValueError(f"method.levels {bad} out of range: this encoder has {n} levels "
                         f"(indices 0..{n - 1}, or -{n}..-1 from the end)")
    return [stages[i] for i in sorted({i % n for i in levels})]


@dataclass
class RCLRound:
    """A client's round: ◇'s generated images and labels of its classes, †'s feature targets (None when off)."""

    generated: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    sd: Optional[SDRound] = None


@METHODS.register("fedrcl", params=FedRCLParams)
class FedRCL(Method):
    """FedRCL: CE + supervised contrastive loss with a divergence penalty, on every encoder level."""

    paper = "https://arxiv.org/abs/2401.04928"

    @classmethod
    def option_extras(cls, params):
        # ◇ and † are the only parts built on the guidance model; plain FedRCL stays in the core.
        needs = {"method.generated": params.generated is not None, "method.sd_align": params.sd_align > 0}
        return {key: ("guidance",) for key, on in needs.items() if on}

    def __init__(self, params, run):
        super().__init__(params, run)
        self._tap = FeatureTap()
        self._generated = GeneratedData(run, params.generated) if params.generated is not None else None
        self._sd = None
        if params.sd_align > 0:
            from fedguide.methods.diffusion_guided._sd_alignment import SDFeatureTargets

            self._sd = SDFeatureTargets(run, params.sd_image_size)

    def setup(self):
        try:  # a wrong level index is a config error, found before the first round
            select_levels(encoder_stages(self.run.model.encoder), self.params.levels)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self._generated is None and self._sd is None:
            return
        from fedguide.methods.diffusion_guided._diffusion_features import GuidanceRecord

        record = GuidanceRecord(self.run, "fedrcl")
        if self._generated is not None:
            record.note("generated_data", self._generated.setup())
        if self._sd is not None:
            record.note("sd_features", self._sd.setup())
        record.write()

    def begin_local(self, model, ctx):
        # attach() drops any hooks a previous client left (e.g. after an exception): one set at a time.
        stages = select_levels(encoder_stages(model.encoder), self.params.levels)
        self._tap.attach(model.encoder, stages, preactivation=self.params.preactivation)
        state = RCLRound()
        if self._generated is not None:
            state.generated = self._generated.pool(ctx.client_id, ctx.payload["weights"].device)
        if self._sd is not None:
            state.sd = self._sd.begin(ctx)
        return state

    def local_loss(self, model, x, y, ctx, state: RCLRound):
        p, real = self.params, len(y)
        if self._generated is not None:  # ◇: generated images of the client's classes join the batch
            pool_x, pool_y = state.generated
            x, y = mix(x, y, pool_x, pool_y, extra_count(real, len(pool_y), len(ctx.data)))
        z, logits = model.forward_features(x)
        levels = self._tap.collect()
        loss = F.cross_entropy(logits, y)
        weight = p.rcl_weight()
        if weight:
            rcl = torch.stack([relaxed_supcon_loss(f, y, p.tau, p.beta, p.rcl_threshold()) for f in levels]).mean()
            loss = loss + weight * rcl
        if self._sd is not None:  # †: the real samples' z towards the guidance model's features of their images
            from fedguide.methods.diffusion_guided.align_features import alignment_loss

            loss = loss + p.sd_align * alignment_loss(z[:real], self._sd.targets(ctx, z, state.sd),
                                                      normalize=True)
        return loss

    def client_upload(self, model, ctx, state):
        self._tap.detach()  # the live model goes on to other clients and to evaluation without hooks
        return super().client_upload(model, ctx, state)
