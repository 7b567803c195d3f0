"""Client data augmented with images the guidance model generates for the client's classes (FedDDA, and
FedRCL's ◇ variant in FedDifRC's Table 6: "we generate data for each client (same amount) by the SD model").

Generation (once, before round 1): for client k and every class c it holds, ``per_class`` images from the
class prompt alone (text-to-image, classifier-free guidance ``cfg_scale``), ``match`` = ⌈n_k / |C_k|⌉ per
class, so the client gets as many generated images as it has real ones, spread evenly over its classes.
They are written to ``<run>/generated_data/client_XXX/`` in the dataset's own format through the
resumable, chunked synthetic-set store of the one-shot methods (_synthetic.py): a chunk whose recipe
fingerprint matches is kept, so a resumed run or a worker process opening the same run directory reuses
them. Image i of client k draws the noise of (seed·65537 + k, i).

Training: every local batch of B real samples is joined by ⌈B·g_k/n_k⌉ generated ones (g_k the client's
generated images), drawn uniformly without replacement from its generated set with the client's seeded
torch stream: over an epoch the model sees its generated images as often as its real ones, and every hook
of the method (its loss, its feature taps) sees the joined batch.

Decisions (neither FedDifRC nor a released FedDDA code states them): the prompt "a photo of a {class}" (the
class name only), DDIM with 50 steps and CFG 7.5 (Stable Diffusion's defaults), the evenly spread ``match``
count above. Generation runs where ``setup`` runs: on the server before round 1, where worker processes
then find the chunks; a client of a deployment without the run directory generates its own missing chunks
(its class set is all the recipe needs).
"""
from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

FOLDER = "generated_data"
NOISE_CLIENT_STRIDE = 65_537


class GeneratedDataParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    per_class: Union[Annotated[int, Field(ge=1)], Literal["match"]] = Field(
        "match", description="generated images per class a client holds; match = as many in all as its real ones")
    prompt: str = Field("a photo of a {}", description="class prompt template (the class name only)")
    steps: int = Field(50, ge=1, description="denoising steps")
    scheduler: Literal["ddim", "ddpm"] = "ddim"
    cfg_scale: float = Field(7.5, description="classifier-free guidance scale")
    gen_batch_size: int = Field(16, ge=1, description="images per sampler batch")
    seed: int = Field(0, ge=0, description="seed of the generation noise")

    @field_validator("prompt")
    @classmethod
    def _one_slot(cls, template: str) -> str:
        if template.count("{}") != 1:
            raise ValueError(f"prompt {template!r} must contain {{}} once, where the class name goes")
        return template


def per_class_count(num_samples: int, num_classes_held: int, per_class: Union[int, str]) -> int:
    """Images per held class: ``per_class``, or ⌈n / |C_k|⌉ for ``match``."""
    if per_class == "match":
        return math.ceil(num_samples / max(num_classes_held, 1))
    return int(per_class)


def extra_count(batch: int, generated: int, real: int) -> int:
    """Generated samples joining a batch of ``batch`` real ones: ⌈batch·generated/real⌉, at most ``generated``."""
    if generated == 0 or real == 0:
        return 0
    return min(generated, math.ceil(batch * generated / real))


def mix(x: torch.Tensor, y: torch.Tensor, pool_x: torch.Tensor, pool_y: torch.Tensor,
        count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch joined by ``count`` rows of the generated pool drawn without replacement (torch's global
    stream, on the host: the same draw on any device; the rows go to the pool's device without waiting)."""
    if count == 0:
        return x, y
    rows = torch.randperm(len(pool_y))[:count].to(pool_y.device, non_blocking=True)
    return torch.cat([x, pool_x[rows].to(x.device, x.dtype)]), torch.cat([y, pool_y[rows].to(y.device)])


class GeneratedData:
    """The generated images of every client: ``setup`` makes (or finds) them, ``pool`` reads one client's."""

    def __init__(self, run, params: GeneratedDataParams, folder: Optional[Path] = None):
        self.run, self.params = run, params
        self.folder = Path(folder) if folder is not None else Path(run.run_dir) / FOLDER
        self._pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(self) -> dict[int, tuple[list[int], int]]:
        """Per client: (the classes it holds, images per class)."""
        out = {}
        for cid in range(self.run.num_clients):
            counts = self.run.data.client(cid).class_counts()
            classes = torch.nonzero(counts).flatten().tolist()
            out[cid] = (classes, per_class_count(int(counts.sum()), len(classes), self.params.per_class))
        return out

    def setup(self) -> dict:
        """Generates whatever images are missing; returns what the run's record notes."""
        from fedguide.guidance.shared import class_prompts, guidance_model
        from fedguide.methods._synthetic import GenerationJob, SyntheticStore, check_image_data, generate_set

        run, p = self.run, self.params
        check_image_data(run.data.splits, run.method_name)
        model = guidance_model(run.guidance)
        store = SyntheticStore(self.folder)
        prompts = class_prompts(run.data.splits.class_names, p.prompt)
        generated, seconds = 0, 0.0
        for cid, (classes, per_class) in sorted(self.plan().items()):
            recipe = {"method": "text-only", "guidance_model": model.model_id, "dtype": str(model.dtype),
                      "dataset": run.data_settings.name, "class_names": list(run.data.splits.class_names),
                      "input_shape": list(run.data.splits.input_shape), "prompt": p.prompt, "scheduler": p.scheduler,
                      "steps": p.steps, "cfg_scale": p.cfg_scale, "batch_size": p.gen_batch_size,
                      "seed": p.seed * NOISE_CLIENT_STRIDE + cid, "client": cid, "classes": classes,
                      "images_per_class": per_class}
            job = GenerationJob(cid, classes, recipe, partial(self._sample, model, cid))
            _, stats = generate_set(store, [job], lambda labels: [prompts[c] for c in labels], per_class,
                                    4 * p.gen_batch_size, run.data.splits)
            generated, seconds = generated + stats.generated_images, seconds + stats.seconds
        return {"folder": str(self.folder), "generated_images": generated, "seconds": round(seconds, 3),
                "per_client": {cid: len(classes) * n for cid, (classes, n) in self.plan().items()}}

    def _sample(self, model, client_id: int, prompts: list[str], labels: torch.Tensor, first: int):
        from fedguide.guidance.samplers import SamplerConfig, sample

        p = self.params
        config = SamplerConfig(scheduler=p.scheduler, steps=p.steps, guidance_scale=p.cfg_scale, eta=0.0,
                               batch_size=p.gen_batch_size, seed=p.seed * NOISE_CLIENT_STRIDE + client_id,
                               progress=False, first_index=first)
        return sample(model, prompts, config)

    def pool(self, client_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the client's generated images, in the model's input format, on ``device``."""
        if client_id not in self._pools:
            from fedguide.methods._synthetic import SyntheticStore, stored_to_model_input

            found = SyntheticStore(self.folder).load(client_id)
            if found is None:
                x = torch.empty(0, *self.run.data.splits.input_shape)
                y = torch.empty(0, dtype=torch.long)
            else:
                x, y = stored_to_model_input(self.run.data.splits, found.images), found.labels.long()
            self._pools = {client_id: (x, y)}  # one client's pool at a time: memory does not grow with clients
        x, y = self._pools[client_id]
        return x.to(device), y.to(device)
