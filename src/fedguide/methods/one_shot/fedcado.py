"""FedCADO (Yang, Su, Li, Xue): one-shot FL by classifier-guided diffusion on the server.

1. Clients train their classifiers to convergence and upload them once, BatchNorm running statistics
   included (``_one_shot.py``: one round, heterogeneous architectures through ``client_models``).
2. The server generates, per client k and class y that k holds, ``images_per_class`` images from the
   class prompt alone (``prompt``, "a photo of a {class}"; CFG scale 3), guided by F_k (Sec. 3.2-3.3):
   L = CE(F_k(x̂₀), y) + λ·L_BN (Eq. 4, λ = 0.1), with x̂₀ = decode((s_t − √(1−ᾱ_t)·ε(s_t,t|y)) / √ᾱ_t)
   (Eq. 3) and L_BN = Σ_l ‖μ_l − μ_k,l‖₂ + ‖σ²_l − σ²_k,l‖₂ over F_k's BatchNorm layers (the generated
   batch's statistics at each BN layer's input against the layer's stored running statistics);
   initial-noise editing s_T ← s_T − η·∇L for M = 10 steps (η = 0.1), then guided denoising
   ε̂ = ε + √(1−ᾱ_t)·∇L (Eq. 5, with the sign that lowers L; see guidance/samplers.py). The sampling
   itself is ``fedguide.guidance.samplers.sample``; the synthetic set is streamed to the run directory in
   chunks at the classifiers' input size, resumable per chunk, and trained on from there, so host memory
   does not grow with the number of images (``_synthetic.py``).
3. The global model is trained from scratch on the synthetic set by ``aggregation`` ft | md | sd
   (Eq. 6, ``_distill.py``).

Ablation switches (Table 3): ``ce_loss``, ``bn_loss``, ``noise_editing``. With both losses off the
generation is SD_Gen's (sd_gen.py registers that baseline with the same pipeline).

Decisions where the paper is silent:
- The loss handed to the sampler, per image i of a batch of B: CE_i + λ·L_BN(batch). The sampler
  differentiates the sum, B·(mean CE + λ·L_BN): each image's gradient is that of the paper's L
  evaluated on its own image (exactly so for B = 1, the released code's batch size), and the balance
  of the CE and BN terms does not depend on the batch size.
- Batch statistics: biased variance over all axes but the channel axis (what BatchNorm normalises
  with); the classifier runs in eval mode (it normalises with its running statistics, as in
  DeepInversion, whose BN loss this is); BN layers without running statistics are skipped. The paper
  says "output feature from the l-th BN layer"; the running statistics it compares with are those of
  the layer's input, so the input is used.
- ``bn_loss`` alone with a classifier that has no BatchNorm layer (e.g. ``mlp``, ``cnn``) gives no
  guidance at all: refused. With ``ce_loss`` on, such a classifier simply contributes no BN term.
- Generated images reach F_k in the dataset's format (``_synthetic.to_model_input``).
- Steps: the paper does not state them; 50 DDIM steps (eta 0), Stable Diffusion's default.
- Prompt: the paper uses "solely ... the textual information of the class labels" (Sec. 4.1), no words
  describing a client's distribution; the template around the class name is not given. The default is
  "a photo of a {}" (the embedded models' training prompt, also FedDISC's here); the released code's
  "an image of {}" (generate_images.py) is ``prompt: "an image of {}"``, and ``"{}"`` is the bare name.
- ``aggregation`` defaults to ``ft`` (λ = 0 in Eq. 6): the base case, reported in every table of the
  paper and usable in every scenario (``md`` is "not suitable under label distribution skew"; which of
  sd/md is best differs by table).
- Not reproduced from the released code: it generates one image at a time and edits the initial noise
  with the BN term alone (0.1·L_BN); Algorithm 1 (the whole L for editing) is followed here.
- Per-client noise: client k's image i starts from the noise of seed (run seed · 65537 + k, i), so
  FedCADO and SD_Gen runs of one seed start every image from the same noise.
- ``reuse_synthetic: <run dir>`` trains on an earlier run's synthetic set instead of generating (to try
  another aggregation); the set must have the same class names and client ids; for ``sd`` each client's
  images must lie within the classes it holds in this run. Clients then train only when the
  aggregation needs teachers (md, sd).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator

from fedguide.methods.one_shot._distill import (KLDirection, predict_logits, sgd, teacher_targets, train_on_labeled)
from fedguide.methods.one_shot._one_shot import OneShotMethod, OneShotParams, server_generator
from fedguide.methods._synthetic import (GenerationJob, PixelFormat, SyntheticSet, SyntheticStore, check_image_data,
                                         generate_set, tensor_digest, to_model_input)
from fedguide.methods.base import METHODS
from fedguide.registry import ConfigError

NOISE_CLIENT_STRIDE = 65_537


class GenerationParams(OneShotParams):
    """The generation and aggregation settings FedCADO and SD_Gen share."""

    images_per_class: int = Field(30, ge=1, description="images per class per client (paper: 30)")
    prompt: str = Field("a photo of a {}", description="class prompt template, filled with the lower-cased class "
                                                       "name: the class name only, no client or domain words (paper "
                                                       "Sec. 4.1); the released code's is \"an image of {}\"")
    steps: int = Field(50, ge=1, description="denoising steps")
    scheduler: Literal["ddim", "ddpm"] = "ddim"
    cfg_scale: float = Field(3.0, description="classifier-free guidance scale (paper: 3)")
    gen_batch_size: int = Field(16, ge=1, description="images per sampler batch (also the batch of the BN statistics)")
    aggregation: Literal["ft", "md", "sd"] = Field(
        "ft", description="Eq. 6: ft = fine-tuning (CE), md = + KL to the mean of all teachers, "
                          "sd = + KL to the teacher of the image's client")
    distill_weight: float = Field(1.0, ge=0.0, description="λ of Eq. 6 for md/sd (paper: 1)")
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature of the md/sd targets")
    kl_direction: KLDirection = Field("teacher_student", description="KL(teacher‖student) (usual distillation) "
                                                                     "or the literal KL(student‖teacher)")
    agg_epochs: int = Field(20, ge=1, description="epochs of the global model on the synthetic set (paper: 20)")
    agg_lr: float = Field(0.01, gt=0.0, description="SGD learning rate on the synthetic set (paper: 0.01)")
    agg_batch_size: Optional[int] = Field(None, ge=1, description="null = train.batch_size")
    reuse_synthetic: Optional[str] = Field(
        None, description="train on the synthetic set of this earlier run directory instead of generating")
    chunk_images: Optional[int] = Field(
        None, ge=1, description="images generated, then written to the run directory, at a time (the most held at the "
                                "generator's resolution); a multiple of gen_batch_size; null = 4 sampler batches")
    pixel_format: PixelFormat = Field(
        "uint8", description="how the synthetic set is stored at the classifiers' input size: uint8 (8-bit "
                             "images, every source here) or float32 (sources whose pixels are not 8-bit)")

    @field_validator("prompt")
    @classmethod
    def _one_slot(cls, template: str) -> str:
        if template.count("{}") != 1:
            raise ValueError(f"prompt {template!r} must contain {{}} once, where the class name goes "
                             "(e.g. \"a photo of a {}\")")
        return template

    @model_validator(mode="after")
    def _whole_batches(self) -> "GenerationParams":
        if self.chunk_images is not None and self.chunk_images % self.gen_batch_size:
            up = -(-self.chunk_images // self.gen_batch_size) * self.gen_batch_size
            raise ValueError(f"chunk_images ({self.chunk_images}) must be a multiple of gen_batch_size "
                             f"({self.gen_batch_size}), so chunks end between sampler batches; use e.g. {up}")
        return self

    @property
    def chunk(self) -> int:
        return self.chunk_images or 4 * self.gen_batch_size


class FedCADOParams(GenerationParams):
    ce_loss: bool = Field(True, description="classifier cross-entropy in the guidance loss (Table 3)")
    bn_loss: bool = Field(True, description="BatchNorm-statistics loss in the guidance loss (Table 3)")
    bn_weight: float = Field(0.1, ge=0.0, description="λ of Eq. 4 (paper: 0.1)")
    noise_editing: bool = Field(True, description="initial-noise editing before denoising (Table 3)")
    edit_steps: int = Field(10, ge=1, description="M, editing steps (paper: 10)")
    edit_lr: float = Field(0.1, gt=0.0, description="η, editing step size (paper: 0.1)")
    classifier_scale: float = Field(1.0, ge=0.0, description="multiplies ∇L in Eq. 5 (paper: 1)")

    @model_validator(mode="after")
    def _editing_needs_a_loss(self) -> "FedCADOParams":
        if self.noise_editing and not (self.ce_loss or self.bn_loss):
            raise ValueError("noise_editing edits the initial noise with the guidance loss's gradient; turn on "
                             "ce_loss or bn_loss, or set noise_editing: false")
        return self


# --- the BN-statistics loss ----------------------------------------------------------------------------
def batch_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance over every axis but axis 1 (what BatchNorm normalises with)."""
    dims = [0, *range(2, x.ndim)]
    return x.mean(dims), x.var(dims, unbiased=False)


def bn_statistics_loss(layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """L_BN = Σ_l ‖μ_l − μ_k,l‖₂ + ‖σ²_l − σ²_k,l‖₂ over (layer input, running mean, running var) triples."""
    terms = []
    for x, running_mean, running_var in layers:
        mean, var = batch_moments(x)
        terms.append(torch.linalg.vector_norm(mean - running_mean) + torch.linalg.vector_norm(var - running_var))
    return torch.stack(terms).sum() if terms else torch.zeros(())


class BatchNormStatistics:
    """Forward hooks recording every BatchNorm layer's input; ``loss()`` is L_BN of the last forward pass."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules()
                       if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]
        self.inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._record) for m in self.layers]

    def _record(self, module, inputs, output) -> None:
        self.inputs.append((inputs[0], module.running_mean, module.running_var))

    def reset(self) -> None:
        self.inputs = []

    def loss(self) -> torch.Tensor:
        return bn_statistics_loss(self.inputs)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "BatchNormStatistics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def guidance_loss(classifier: torch.nn.Module, splits, labels: torch.Tensor, ce: bool,
                  bn: Optional[BatchNormStatistics], bn_weight: float):
    """The sampler's ``loss_fn`` for one client: per image CE_i + λ·L_BN(batch) (module docstring)."""
    batch: dict[str, torch.Tensor] = {}

    def batch_labels(idx: torch.Tensor) -> torch.Tensor:
        # The sampler passes one batch's positions (on the host) to every step of that batch: its labels are
        # looked up once per batch, not copied to the device at every step.
        if batch.get("idx") is not idx:
            batch["idx"], batch["labels"] = idx, labels[idx.to(labels.device)]
        return batch["labels"]

    def loss_fn(images: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if bn is not None:
            bn.reset()
        logits = classifier(to_model_input(splits, images))
        rows = torch.zeros(len(idx), device=logits.device)
        if ce:
            rows = rows + F.cross_entropy(logits.float(), batch_labels(idx), reduction="none")
        if bn is not None:
            rows = rows + bn_weight * bn.loss().to(rows.device)
        return rows
    return loss_fn


def generation_seed(run_seed: int, client_id: int) -> int:
    return run_seed * NOISE_CLIENT_STRIDE + client_id


# --- the method ----------------------------------------------------------------------------------------
@METHODS.register("fedcado", params=FedCADOParams)
class FedCADO(OneShotMethod):
    """FedCADO: one shot; classifier-guided generation per client on the server; global model trained on it."""

    paper = "https://arxiv.org/abs/2311.08870"

    extras = ("guidance",)  # built on the guidance model (diffusers, transformers)
    Params = FedCADOParams

    @classmethod
    def gpu_nondeterminism(cls, params, config):
        if params.ce_loss or params.bn_loss:
            return ("the classifier guidance differentiates through the bilinear resize of each generated image to "
                    "the classifier's input, whose CUDA backward has no deterministic kernel; write "
                    "method.ce_loss=false method.bn_loss=false (text-only generation) or train.deterministic: false")
        return None

    # ---- what the subclass SD_Gen changes ---------------------------------------------------------
    def guidance_terms(self) -> tuple[bool, bool, bool]:
        """(CE loss, BN loss, noise editing)."""
        p = self.params
        return p.ce_loss, p.bn_loss, p.noise_editing

    @property
    def guided(self) -> bool:
        ce, bn, _ = self.guidance_terms()
        return ce or bn

    @property
    def clients_train(self) -> bool:
        needs_teachers = self.params.aggregation != "ft"
        return needs_teachers or (self.guided and self.params.reuse_synthetic is None)

    def __init__(self, params, run):
        from fedguide.guidance.shared import require_generation

        super().__init__(params, run)
        # When the method is built (a dry run refuses too), before any client trains: the guidance source must
        # generate, and its images reach the classifiers.
        require_generation(run.guidance, run.method_name)
        check_image_data(run.data.splits, run.method_name)

    # ---- round 1 ----------------------------------------------------------------------------------
    def one_shot(self, uploads):
        run, p = self.run, self.params
        teachers = self.teachers(uploads) if self.clients_train else {}
        if p.reuse_synthetic is not None:
            synthetic = self.reused_set(p.reuse_synthetic, teachers)
            self.stats["synthetic_reused"] = 1
        else:
            synthetic = self.generate(teachers, uploads)
        y = synthetic.labels
        targets = self.targets(synthetic, teachers) if teachers else None
        student = self.fresh_global()
        train = run.train
        optimizer = sgd(student, p.agg_lr, train.momentum, train.weight_decay)
        loss = train_on_labeled(student, synthetic.inputs, y, targets, p.agg_epochs,
                                p.agg_batch_size or train.batch_size, optimizer,
                                server_generator(run.seed, 0), p.distill_weight, p.temperature, p.kl_direction)
        self.stats.update({"synthetic_images": len(synthetic), "aggregation_loss": loss})
        return run.layout.flatten(student)

    def targets(self, synthetic: SyntheticSet, teachers: dict) -> Optional[torch.Tensor]:
        """Eq. 6's KL targets of every image (None for ft), computed chunk by chunk; also the share of the
        images their own client's teacher classifies as their label."""
        p = self.params
        order = sorted(teachers)
        position = {c: i for i, c in enumerate(order)}
        own = torch.tensor([position[int(c)] for c in synthetic.clients.tolist()], dtype=torch.long)
        parts, correct = [], 0
        for rows, x in synthetic.chunks():
            # on the host, with the set's labels and client ids (the student's batches move one by one)
            logits = torch.stack([predict_logits(teachers[c], x) for c in order]).cpu()
            mine = own[rows]
            correct += int((logits[mine, torch.arange(len(x))].argmax(1) == synthetic.labels[rows]).sum())
            parts.append(teacher_targets(logits, p.aggregation, mine, p.temperature))
        self.stats["synthetic_teacher_accuracy"] = correct / len(synthetic)
        return None if parts[0] is None else torch.cat(parts)

    # ---- the synthetic set ------------------------------------------------------------------------
    def recipe(self, model, client_id: int, classes: list[int],
               teacher_weights: Optional[torch.Tensor]) -> dict[str, Any]:
        p, splits = self.params, self.run.data.splits
        ce, bn, edit = self.guidance_terms()
        recipe = {
            "method": "classifier-guided" if self.guided else "text-only",
            "guidance_model": model.model_id, "dtype": str(model.dtype),
            "dataset": self.run.data_settings.name, "class_names": list(splits.class_names),
            "input_shape": list(splits.input_shape), "pixel_stats": str(splits.pixel_stats),
            "prompt": p.prompt, "scheduler": p.scheduler, "steps": p.steps, "cfg_scale": p.cfg_scale,
            "batch_size": p.gen_batch_size,
            "seed": generation_seed(self.run.seed, client_id), "images_per_class": p.images_per_class,
            "client": client_id, "classes": classes,
        }
        if self.guided:
            recipe.update(ce_loss=ce, bn_loss=bn, bn_weight=self.params.bn_weight, classifier_scale=p.classifier_scale,
                          edit_steps=p.edit_steps if edit else 0, edit_lr=p.edit_lr if edit else None,
                          teacher=self.arch_of(client_id).describe(), teacher_weights=tensor_digest(teacher_weights))
        return recipe

    def sampler_config(self, client_id: int, first_index: int = 0):
        from fedguide.guidance.samplers import SamplerConfig

        p = self.params
        _, _, edit = self.guidance_terms()
        return SamplerConfig(scheduler=p.scheduler, steps=p.steps, guidance_scale=p.cfg_scale, eta=0.0,
                             loss_scale=getattr(p, "classifier_scale", 1.0),
                             edit_steps=p.edit_steps if (self.guided and edit) else 0,
                             edit_lr=getattr(p, "edit_lr", 0.1), batch_size=p.gen_batch_size,
                             seed=generation_seed(self.run.seed, client_id), progress=p.progress,
                             first_index=first_index)

    def sample_client(self, model, client_id: int, teacher, prompts: list[str], labels: torch.Tensor,
                      first_index: int = 0):
        """A chunk of one client's images (from its image ``first_index`` on) through the guidance layer's
        sampler, guided by ``teacher`` when given."""
        from fedguide.guidance import samplers

        config = self.sampler_config(client_id, first_index)
        if teacher is None:
            return samplers.sample(model, prompts, config)
        ce, bn_on, _ = self.guidance_terms()
        home = next(teacher.parameters()).device  # the run's device: the teachers' targets are computed there
        teacher.to(model.device)
        try:
            with BatchNormStatistics(teacher) as bn:
                if bn_on and not ce and not bn.layers:
                    raise ConfigError(f"bn_loss alone guides by BatchNorm statistics, but client {client_id}'s "
                                      f"classifier ({self.arch_of(client_id).name}) has no BatchNorm layer; "
                                      "turn on ce_loss or use a model with BatchNorm")
                loss_fn = guidance_loss(teacher, self.run.data.splits, labels.to(model.device), ce,
                                        bn if bn_on else None, self.params.bn_weight)
                return samplers.sample(model, prompts, config, loss_fn=loss_fn)
        finally:
            teacher.to(home)  # no move where the guidance model computes on the run's device

    def generate(self, teachers: dict, uploads: list[dict[str, Any]]) -> SyntheticSet:
        from fedguide.guidance.shared import class_prompts, guidance_model

        run, p = self.run, self.params
        model = guidance_model(run.guidance)
        store = SyntheticStore.of_run(run.run_dir)
        weights = {int(u["client_id"]): u.get("weights") for u in uploads}
        jobs = []
        for cid, classes in sorted(self.client_classes.items()):
            teacher = teachers.get(cid) if self.guided else None
            if self.guided and teacher is None:
                raise ConfigError(f"client {cid} uploaded no model to guide the generation")
            recipe = self.recipe(model, cid, classes, weights[cid] if self.guided else None)
            jobs.append(GenerationJob(cid, classes, recipe, partial(self.sample_client, model, cid, teacher)))
        prompts = class_prompts(run.data.splits.class_names, p.prompt)
        synthetic, stats = generate_set(store, jobs, lambda labels: [prompts[c] for c in labels], p.images_per_class,
                                        p.chunk, run.data.splits, p.pixel_format, verbose=p.progress)
        store.write_index(synthetic, {"method": run.method_name,
                                      "class_names": list(run.data.splits.class_names), "num_clients": run.num_clients,
                                      "guidance_model": model.model_id, **stats.metrics()})
        self.stats.update(stats.metrics())
        return synthetic

    def reused_set(self, path: str, teachers: dict) -> SyntheticSet:
        """An earlier run's synthetic set, checked against this run (module docstring)."""
        import json

        store = SyntheticStore.reused(path)
        names = list(self.run.data.splits.class_names)
        parts = []
        for cid in store.clients():
            meta = store.metadata(cid) or {}
            recipe = json.loads(meta.get("recipe", "{}"))
            if recipe.get("class_names") != names:
                raise ConfigError(f"reuse_synthetic: {store.path(cid)} was generated for classes "
                                  f"{recipe.get('class_names')}, this run has {names}; reuse a run of the same dataset")
            if cid >= self.run.num_clients:
                raise ConfigError(f"reuse_synthetic: the set has images of client {cid}, this run has "
                                  f"{self.run.num_clients} clients; reuse a run with the same clients")
            if teachers and cid not in teachers:
                raise ConfigError(f"reuse_synthetic: the set has images of client {cid}, which sent no model in this "
                                  f"run, so no teacher can supervise them ({self.params.aggregation}); reuse a run "
                                  "with the same clients or use aggregation ft")
            chunks = store.parts(cid)
            if self.params.aggregation == "sd":
                held = set(torch.cat([labels for _, _, labels in chunks]).tolist())
                extra = sorted(held - set(self.client_classes.get(cid, [])))
                if extra:
                    raise ConfigError(f"reuse_synthetic: client {cid}'s synthetic images include classes {extra} it "
                                      "does not hold in this run, so its teacher cannot supervise them (sd); reuse a "
                                      "run with the same partition or use aggregation ft")
            parts.extend(chunks)
        return SyntheticSet(self.run.data.splits, parts)
