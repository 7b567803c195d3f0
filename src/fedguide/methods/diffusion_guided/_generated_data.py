"""Client data augmented with images the guidance model generates: FedDDA's (``feddda``) and FedRCL's ◇ variant in
FedDifRC's Table 6 ("we generate data for each client (same amount) by the SD model").

Which images a client gets: a plan of [K clients, C classes] counts, fixed before round 1 from the clients'
label histograms, in one of three forms:

- ``held`` (FedRCL ◇, ``GeneratedDataParams``): for client k and every class c it holds, ``per_class``
  images, ``match`` = ⌈n_k / |C_k|⌉ per class, so the client gets as many generated images as it has real
  ones, spread evenly over its classes. No class it lacks is generated.
- ``random`` (FedDDA's default, ``AddedDataParams.add``; the released code's ``add_random``,
  ZhZhuang/FedDDA Fed_classifier/common.py L190-191 and utils.py L598-605 ``get_data_random_idx``): a
  class-balanced pool of ``pool_per_class`` images of every class is cut into ``n_block`` random slices
  of ⌊C·P / n_block⌋ images, drawn without replacement, and client k gets slice k (common.py L200-209;
  the reference's defaults n_block = n_clients = 10, common.py L242, L267). A client's slice follows the
  pool's classes, not its own: every class it lacks arrives in about the pool's proportion.
- ``lack`` (the released ``add_lack``, utils.py L616-650 ``get_lackdata_idx``; common.py L192-194): for
  client k, mean_k = ⌊n_k / div⌋ (``div`` 10, common.py L266); every class j with n_kj < mean_k gets
  mean_k − n_kj images of class j, taken from the same finite pool, clients in order 0, 1, ...; a class
  whose pool runs out gives what is left (utils.py L639-641). A client's missing and under-represented
  classes are filled up to ⌊n_k/div⌋; classes at or above it get nothing.

The pool's size: ``pool_per_class: reference`` = 2·⌊N/C⌋ per class (N the training samples the clients
hold): the released generator wrote 10 000 images per class for CIFAR-10's 5 000 and 12 000 for
Fashion-MNIST's 6 000 (fed-ddim-main/runners/diffusion.py L264 and its comment; the default ``gen_path``
"...-10w", common.py L259), twice the training set in both. The pool's images are independent draws of
their class, so only the images a client is handed are generated: a slice of the pool (``random``) or
the filled counts (``lack``) have the reference's class counts without the unused rest of the pool.

Generation (once, before round 1): client k's images from the class prompt alone (text-to-image,
classifier-free guidance ``cfg_scale``), classes interleaved. They are written to
``<run>/generated_data/client_XXX/`` in the dataset's own format through the resumable, chunked
synthetic-set store of the one-shot methods (_synthetic.py): a chunk whose recipe fingerprint matches is
kept, so a resumed run or a worker process opening the same run directory reuses them. Image i of client
k draws the noise of (seed·65537 + k, i). The run's guidance record notes every client's label histogram
before (its real samples), the generated counts and after (real + generated): ``fedguide analyze RUN
--generated-data`` draws them.

Training, two ways:
- FedRCL ◇ (``mix``): every local batch of B real samples is joined by ⌈B·g_k/n_k⌉ generated ones (g_k
  the client's generated images), drawn uniformly without replacement from its generated set with the
  client's seeded torch stream: over an epoch the model sees its generated images as often as its real
  ones, and every hook of the method (its loss, its feature taps) sees the joined batch.
- FedDDA (``joined``): the real and generated samples are one set of n_k + g_k, of which each epoch is
  one shuffled pass in batches of ``train.batch_size`` (the reference's DataLoader over
  ``data_list[index] + client.dataset`` with shuffle=True, core_feddiffusion.py L101-108), generated
  images augmented by ``train.augment`` as the real ones (the reference's one transform for both,
  common.py L73-92, L183-186).

Decisions (neither FedDifRC nor the FedDDA code states them): the prompt "a photo of a {class}" (the class
name only; the reference's DDIM is conditioned on the label), DDIM with 50 steps and CFG 7.5 (Stable
Diffusion's defaults), the evenly spread ``match`` count above, the ``random`` slices drawn with
``method.seed``. Generation runs where ``setup`` runs: on the server before round 1, where worker
processes then find the chunks; the ``random`` and ``lack`` plans need every client's histogram (the
pool is shared), which the run's data holds.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fedguide.registry import ConfigError

FOLDER = "generated_data"
NOISE_CLIENT_STRIDE = 65_537
# The released generator's pool: twice the training set's images of every class (module docstring).
REFERENCE_POOL_FACTOR = 2


class GenerationSettings(BaseModel):
    """How the guidance model draws the images (shared by every plan)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field("a photo of a {}", description="class prompt template (the class name only)")
    steps: int = Field(50, ge=1, description="denoising steps")
    scheduler: Literal["ddim", "ddpm"] = "ddim"
    cfg_scale: float = Field(7.5, description="classifier-free guidance scale")
    gen_batch_size: int = Field(16, ge=1, description="images per sampler batch")
    seed: int = Field(0, ge=0, description="seed of the generation noise (and of the random plan's slices)")

    @field_validator("prompt")
    @classmethod
    def _one_slot(cls, template: str) -> str:
        if template.count("{}") != 1:
            raise ValueError(f"prompt {template!r} must contain {{}} once, where the class name goes")
        return template


class GeneratedDataParams(GenerationSettings):
    """FedRCL ◇: images of the classes a client holds."""

    per_class: Union[Annotated[int, Field(ge=1)], Literal["match"]] = Field(
        "match", description="generated images per class a client holds; match = as many in all as its real ones")


class AddedDataParams(GenerationSettings):
    """FedDDA: images from a class-balanced pool, in random slices or where a client lacks them."""

    add: Literal["random", "lack"] = Field(
        "random", description="random = client k gets the k-th random slice of the class-balanced pool (the "
                              "reference's default); lack = each class a client has under ⌊n_k/div⌋ of is "
                              "filled up to it")
    div: int = Field(10, ge=1, description="lack: the per-class level ⌊n_k / div⌋ a client's classes are filled to")
    n_block: Optional[int] = Field(
        None, ge=1, description="random: slices the pool is cut into (client k gets slice k); null = one per client")
    pool_per_class: Union[Annotated[int, Field(ge=1)], Literal["reference"]] = Field(
        "reference", description="images of every class in the pool; reference = twice the clients' training "
                                 "samples per class, as the released generator's pool")


def per_class_count(num_samples: int, num_classes_held: int, per_class: Union[int, str]) -> int:
    """Images per held class: ``per_class``, or ⌈n / |C_k|⌉ for ``match``."""
    if per_class == "match":
        return math.ceil(num_samples / max(num_classes_held, 1))
    return int(per_class)


def held_counts(histograms: np.ndarray, per_class: Union[int, str]) -> np.ndarray:
    """[K, C] generated images: ``per_class_count`` of every class a client holds, none of the others."""
    out = np.zeros_like(histograms, dtype=np.int64)
    for k, row in enumerate(histograms):
        held = row > 0
        out[k, held] = per_class_count(int(row.sum()), int(held.sum()), per_class)
    return out


def reference_pool_per_class(histograms: np.ndarray) -> int:
    """The released pool's size per class: twice the clients' training samples per class."""
    return REFERENCE_POOL_FACTOR * (int(histograms.sum()) // histograms.shape[1])


def lack_counts(histograms: np.ndarray, div: int, pool_per_class: int) -> np.ndarray:
    """[K, C] generated images of ``add_lack`` (ZhZhuang/FedDDA Fed_classifier/utils.py L631-649): client i's
    class j gets ⌊n_i/div⌋ − n_ij where that is positive, from a pool of ``pool_per_class`` per class that
    clients draw from in order; a class whose pool is short gives what is left."""
    left = np.full(histograms.shape[1], pool_per_class, dtype=np.int64)
    out = np.zeros_like(histograms, dtype=np.int64)
    for i, row in enumerate(histograms):
        mean = int(row.sum()) // div
        for j, held in enumerate(row):
            lack = mean - int(held)
            if lack > 0:
                out[i, j] = min(lack, int(left[j]))
                left[j] -= out[i, j]
    return out


def check_blocks(n_block: int, num_clients: int) -> None:
    if n_block < num_clients:
        raise ConfigError(f"method.n_block {n_block} is below the number of clients {num_clients}: client k gets "
                          f"slice k of the pool; set method.n_block to at least {num_clients} or null (one per client)")


def random_counts(num_clients: int, num_classes: int, pool_per_class: int, n_block: int,
                  rng: np.random.Generator) -> np.ndarray:
    """[K, C] generated images of ``add_random`` (utils.py L598-605, common.py L200-209): the pool of
    ``pool_per_class`` images per class cut into ``n_block`` random slices of ⌊C·P / n_block⌋ images
    without replacement; client k gets slice k."""
    check_blocks(n_block, num_clients)
    labels = np.repeat(np.arange(num_classes), pool_per_class)
    size = len(labels) // n_block
    order = rng.permutation(len(labels))
    return np.stack([np.bincount(labels[order[k * size:(k + 1) * size]], minlength=num_classes)
                     for k in range(num_clients)]).astype(np.int64)


def interleaved(counts: Sequence[int]) -> list[int]:
    """Labels of ``counts[c]`` images of each class c, classes taking turns (a sampler batch mixes them)."""
    left, out = [int(n) for n in counts], []
    while any(left):
        for c, n in enumerate(left):
            if n:
                out.append(c)
                left[c] -= 1
    return out


def extra_count(batch: int, generated: int, real: int) -> int:
    """Generated samples joining a batch of ``batch`` real ones: ⌈batch·generated/real⌉, at most ``generated``."""
    if generated == 0 or real == 0:
        return 0
    return min(generated, math.ceil(batch * generated / real))


def mix(x: torch.Tensor, y: torch.Tensor, pool_x: torch.Tensor, pool_y: torch.Tensor,
        count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch joined by ``count`` rows of the generated pool drawn without replacement by the pool device's
    default generator: no host copy inside the step. On the CPU (and the simulated device, a CPU device) that is
    torch's global stream, so a CPU run draws what it drew when the rows were drawn on the host; on a GPU it is
    the GPU's stream, whose draws differ from the CPU's (as FedEMA's device draws do)."""
    if count == 0:
        return x, y
    rows = torch.randperm(len(pool_y), device=pool_y.device)[:count]
    return torch.cat([x, pool_x[rows].to(x.device, x.dtype)]), torch.cat([y, pool_y[rows].to(y.device)])


@dataclasses.dataclass
class JoinedSet:
    """A client's real and generated samples as one training set for the local loop: host indices below
    ``offset`` (the training set's size) are its real samples, ``offset + j`` its j-th generated image."""

    indices: torch.Tensor
    offset: int

    def __len__(self) -> int:
        return int(self.indices.numel())


@dataclasses.dataclass
class JoinedBatch:
    """One batch of a ``JoinedOrder``: positions [start, start + size) of the epoch's order, whose real rows are
    the order's real rows [r0, r1) and generated rows its generated rows [g0, g1) (counted on the host)."""

    order: "JoinedOrder"
    start: int
    size: int
    r0: int
    r1: int
    g0: int
    g1: int


class JoinedOrder:
    """An epoch's shuffled order of a ``JoinedSet``, split on the host into real and generated rows and copied
    to the device once: a batch is a slice of it, with no copy, lookup or sync of its own."""

    def __init__(self, order: torch.Tensor, offset: int, real_indices, device: torch.device):
        # Host work once an epoch, before its first step (the local loop's feed.indices): ``order`` is the
        # epoch's host indices, so the reads below touch no device.
        if order.device.type != "cpu":
            raise ValueError("a JoinedOrder splits the epoch's host indices; got a tensor on " + str(order.device))
        generated = order >= offset
        # generated rows before each position: a batch's share of each kind, known on the host
        self._before = torch.cat([torch.zeros(1, dtype=torch.long), generated.long().cumsum(0)]).tolist()
        self.length = len(order)
        n_gen = self._before[-1]
        positions = torch.arange(self.length)
        self.real = real_indices(order[~generated])  # where the real rows are kept (DeviceData: one copy)
        packed = torch.cat([order[generated] - offset, positions[~generated], positions[generated]])
        packed = packed.to(device, non_blocking=True)  # one copy for the three
        self.gen, self.real_at, self.gen_at = packed.split([n_gen, self.length - n_gen, n_gen])

    def __getitem__(self, part: slice) -> JoinedBatch:
        start, stop, step = part.indices(self.length)
        if step != 1:
            raise ValueError("a JoinedOrder is sliced into contiguous batches only")
        g0, g1 = self._before[start], self._before[stop]
        return JoinedBatch(self, start, stop - start, start - g0, stop - g1, g0, g1)


class JoinedFeed:
    """The batches of a ``JoinedSet`` as the local loop takes them (the interface of ``DeviceData`` it uses):
    real samples from the run's device data (or the client's host tensors), generated ones from the pool,
    each in its place in the shuffled order, the generated ones augmented by ``train.augment`` as well."""

    def __init__(self, ctx, pool_x: torch.Tensor, pool_y: torch.Tensor, offset: int, pixel_stats):
        self.base, self.ctx, self.offset = ctx.device_data, ctx, offset
        self.device = self.base.device if self.base is not None else ctx.data.x.device
        self.pool_x, self.pool_y = pool_x.to(self.device), pool_y.to(self.device)
        self.augment = self.base.augment if self.base is not None else None
        if self.augment is not None:  # generated images are standardised like the real ones: augment their pixels
            self._mean, self._std = (torch.as_tensor(v, dtype=torch.float32, device=self.device).view(-1, 1, 1)
                                     for v in pixel_stats)

    def indices(self, idx: torch.Tensor) -> JoinedOrder:
        """The epoch's order (host indices of the joined set) split and copied once."""
        real = self.base.indices if self.base is not None else (lambda i: i)
        return JoinedOrder(idx, self.offset, real, self.device)

    def _real(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.base is None:  # no device data: the client's host tensors, as ctx.batch reads them
            return self.ctx.batch(idx)
        return self.base.train_batch(idx)

    def _generated(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.pool_x[rows], self.pool_y[rows]
        if self.augment is not None:
            x = (self.augment(x * self._std + self._mean) - self._mean) / self._std
        return x, y

    def train_batch(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``JoinedBatch`` (a slice of ``indices``'s order), a whole order, or host indices of the joined set."""
        if isinstance(batch, torch.Tensor):
            batch = self.indices(batch)
        if isinstance(batch, JoinedOrder):
            batch = batch[:]
        order = batch.order
        real, gen = order.real[batch.r0: batch.r1], order.gen[batch.g0: batch.g1]
        if batch.g0 == batch.g1:
            return self._real(real)
        if batch.r0 == batch.r1:
            return self._generated(gen)
        gx, gy = self._generated(gen)
        rx, ry = self._real(real)
        x = rx.new_empty((batch.size, *rx.shape[1:]))
        y = ry.new_empty(batch.size)
        at_real = order.real_at[batch.r0: batch.r1] - batch.start
        at_gen = order.gen_at[batch.g0: batch.g1] - batch.start
        x[at_real], x[at_gen] = rx, gx.to(rx.dtype)
        y[at_real], y[at_gen] = ry, gy.to(ry.dtype)
        return x, y


class GeneratedData:
    """The generated images of every client: ``plan`` says how many of each class, ``setup`` makes (or finds)
    them, ``pool`` reads one client's, ``joined`` makes a client's context train on real + generated."""

    def __init__(self, run, params: Union[GeneratedDataParams, AddedDataParams], folder: Optional[Path] = None):
        self.run, self.params = run, params
        self.folder = Path(folder) if folder is not None else Path(run.run_dir) / FOLDER
        self._pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Found when the method is built (a dry run), not after the first generation.
        from fedguide.guidance.shared import require_generation
        from fedguide.methods._synthetic import check_image_data

        require_generation(run.guidance, run.method_name)
        check_image_data(run.data.splits, run.method_name)
        if self.mode == "random":
            check_blocks(params.n_block or run.num_clients, run.num_clients)

    @property
    def mode(self) -> str:
        return "held" if isinstance(self.params, GeneratedDataParams) else self.params.add

    def histograms(self) -> np.ndarray:
        """[K, C] the clients' real training samples per class."""
        return np.stack([self.run.data.client(cid).class_counts().numpy()
                         for cid in range(self.run.num_clients)]).astype(np.int64)

    def pool_per_class(self) -> Optional[int]:
        if self.mode == "held":
            return None
        p = self.params.pool_per_class
        return reference_pool_per_class(self.histograms()) if p == "reference" else int(p)

    def plan(self) -> np.ndarray:
        """[K, C] generated images per client and class."""
        p, hist = self.params, self.histograms()
        if self.mode == "held":
            return held_counts(hist, p.per_class)
        if self.mode == "lack":
            return lack_counts(hist, p.div, self.pool_per_class())
        return random_counts(len(hist), hist.shape[1], self.pool_per_class(), p.n_block or len(hist),
                             np.random.default_rng(p.seed))

    def setup(self) -> dict:
        """Generates whatever images are missing; returns what the run's record notes."""
        from fedguide.guidance.shared import class_prompts, guidance_model
        from fedguide.methods._synthetic import GenerationJob, SyntheticStore, generate_set

        run, p = self.run, self.params
        model = guidance_model(run.guidance)
        store = SyntheticStore(self.folder)
        prompts = class_prompts(run.data.splits.class_names, p.prompt)
        real, plan = self.histograms(), self.plan()
        generated, seconds = 0, 0.0
        for cid, counts in enumerate(plan):
            recipe = {"method": "text-only", "guidance_model": model.model_id, "dtype": str(model.dtype),
                      "dataset": run.data_settings.name, "class_names": list(run.data.splits.class_names),
                      "input_shape": list(run.data.splits.input_shape), "prompt": p.prompt, "scheduler": p.scheduler,
                      "steps": p.steps, "cfg_scale": p.cfg_scale, "batch_size": p.gen_batch_size,
                      "seed": p.seed * NOISE_CLIENT_STRIDE + cid, "client": cid}
            if self.mode == "held":
                classes = np.nonzero(counts)[0].tolist()
                per_class = int(counts[classes[0]]) if classes else 0
                recipe.update(classes=classes, images_per_class=per_class)
            else:
                # generate_set gives ``per_class`` images of each entry of ``classes`` in turn: the label sequence
                # itself, one image per entry, gives the plan's uneven counts.
                classes, per_class = interleaved(counts), 1
                recipe.update(add=self.mode, counts=counts.tolist())
            if not classes:
                store.drop_chunks_from(cid, 0)  # nothing for this client: no images of an earlier plan stay
                continue
            job = GenerationJob(cid, classes, recipe, partial(self._sample, model, cid))
            # minutes to hours on a CPU: each chunk says so as it lands (its client, its place, its rate), as the
            # one-shot methods' generation does
            _, stats = generate_set(store, [job], lambda labels: [prompts[c] for c in labels], per_class,
                                    4 * p.gen_batch_size, run.data.splits, verbose=True)
            generated, seconds = generated + stats.generated_images, seconds + stats.seconds
        note = {"folder": str(self.folder), "add": self.mode, "generated_images": generated,
                "seconds": round(seconds, 3), "per_client": {cid: int(n) for cid, n in enumerate(plan.sum(1))},
                "histograms": {"class_names": list(run.data.splits.class_names), "real": real.tolist(),
                               "generated": plan.tolist(), "after": (real + plan).tolist()}}
        if self.mode != "held":
            note["pool_per_class"] = self.pool_per_class()
        return note

    def _sample(self, model, client_id: int, prompts: list[str], labels: torch.Tensor, first: int):
        from fedguide.guidance.samplers import SamplerConfig, sample

        p = self.params
        config = SamplerConfig(scheduler=p.scheduler, steps=p.steps, guidance_scale=p.cfg_scale, eta=0.0,
                               batch_size=p.gen_batch_size, seed=p.seed * NOISE_CLIENT_STRIDE + client_id,
                               progress=True, first_index=first)
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

    def joined(self, ctx):
        """``ctx`` with its data the client's real and generated samples as one set (``JoinedSet``), whose
        batches the local loop gathers through a ``JoinedFeed``."""
        offset = len(self.run.data.splits.train_y)
        pool_x, pool_y = self.pool(ctx.client_id, ctx.device)
        indices = torch.cat([ctx.data.indices, offset + torch.arange(len(pool_y), dtype=ctx.data.indices.dtype)])
        feed = JoinedFeed(ctx, pool_x, pool_y, offset, self.run.data.splits.pixel_stats)
        return dataclasses.replace(ctx, data=JoinedSet(indices, offset), device_data=feed)
