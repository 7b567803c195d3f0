"""The server's synthetic training set of the generation-based one-shot methods (FedCADO, SD_Gen).

What it holds, per client k (the client whose classifier guided the images, or, for SD_Gen, whose
classes they cover): the images as the classifiers take them, at the dataset's own size and channels
(uint8 [n, C, H, W], or float32 [0, 1] pixels with ``pixel_format: float32``), their labels and,
implied by the folder, the client id. Layout in the run directory::

    synthetic/client_003/chunk_0000.safetensors   images, labels (int64); metadata: fingerprint, client,
                                                  chunk, first (its first image's index), recipe
    synthetic/client_003.png                      a grid: one row per class, up to ``GRID_COLUMNS`` images each
    synthetic/generation.jsonl                    one line per generated chunk: images, seconds, images/s
    synthetic/index.json                          the whole set: files, counts, class names, throughput

Decisions:

- Memory does not grow with the number of images. Generation streams: a client's images are generated
  ``chunk`` at a time, brought to the classifiers' format and written at once, so no more than one
  chunk ever exists at the generator's resolution. The aggregation reads each batch's rows from the
  chunk files (opened per batch and closed again, so no mapping of the whole set stays resident). What
  the set keeps in memory is its labels and client ids (16 bytes per image); md/sd add the teachers'
  targets (C floats per image).
- Stored at the classifiers' input size, not the generator's: what the aggregation trains on is exactly
  what is on disk (a reused set gives the same training as the run that generated it), and a DomainNet
  image takes 3·224·224 bytes instead of 3·512·512·4 for float pixels at Stable Diffusion's size.
  ``uint8`` is the form of every image source here (decoded from 8-bit files or 8-bit arrays);
  ``float32`` keeps the [0, 1] pixels unquantised for a source whose pixels are not 8-bit.
- Chunks are whole sampler batches (the chunk size is a multiple of ``gen_batch_size``) and image i of a
  client draws the noise of (seed, i) whichever chunk it falls in (``SamplerConfig.first_index``), so a
  client generated in chunks, or resumed after a kill, has the images of one uninterrupted call: the
  same noise and the same sampler batches (hence the same batch statistics in FedCADO's BN loss).
- Resumable per chunk: a chunk is written (atomically) as soon as it is done and skipped by a later call
  when its ``fingerprint`` matches: a hash of everything that determines its images (guidance model,
  prompt template, sampler and loss settings, seeds, classes, the guiding classifier's weights, the
  storage format, and the chunk's place in the client's sequence). A chunk with another fingerprint is
  stale and is regenerated, never silently reused; chunk files past a client's last chunk are removed.
- Prompt order: a client's images go through its classes round-robin (image j has class
  classes[j % len(classes)]), the deterministic form of the paper's "randomly select a category y
  supported by the client classifier" (Algorithm 1, line 4) with equal counts per class; a batch then
  mixes classes as a client's training batches do, which is what FedCADO's BN-statistics loss compares
  against.
- Generated pixels reach a client's classifier in the dataset's own format (``to_model_input``): the
  inverse of ``guidance_pixels``: [-1, 1] -> [0, 1], RGB -> grey by the channel mean for one-channel
  data (the generators see grey images as three equal channels), bilinear resizing to the dataset's
  size (antialiased when shrinking), then the source's standardisation (``pixel_stats``). The stored
  images are the first three steps, quantised; the standardisation is applied when a batch is read.
- Sets written before chunking (``client_003.safetensors``: uint8 RGB at the generator's size) are still
  read by ``reuse_synthetic``; their images are brought to the input size as they are read.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Sequence

import torch
import torch.nn.functional as F

from fedguide.core.atomic import write_atomic, write_json
from fedguide.core.sealed import TENSORS_DIGEST, Opened, Unverified, load_sealed, read_metadata, save_sealed
from fedguide.registry import ConfigError

FOLDER = "synthetic"
GRID_COLUMNS = 8
PixelFormat = Literal["uint8", "float32"]


# --- pixels --------------------------------------------------------------------------------------------
def check_image_data(splits, method: str) -> None:
    """A ConfigError unless the dataset is images whose standardisation the source declares."""
    if len(splits.input_shape) != 3 or splits.input_shape[0] not in (1, 3):
        raise ConfigError(f"{method} generates images; data '{tuple(splits.input_shape)}' is not [1 or 3, H, W] "
                          "images — choose an image dataset")
    if splits.pixel_stats is None:
        raise ConfigError(f"{method} needs the dataset's pixel statistics to hand generated images to the "
                          "classifiers; this source does not declare them (DatasetSplits.pixel_stats) — use a "
                          "source that does (fmnist, digits_domains, cifar10, ...)")


def fit_to_input(splits, pixels: torch.Tensor) -> torch.Tensor:
    """[0, 1] pixels [B, c, h, w] -> the dataset's channels and size [B, C, H, W] (differentiable)."""
    channels, height, width = splits.input_shape
    x = pixels.float()
    if channels == 1 and x.shape[1] != 1:
        x = x.mean(1, keepdim=True)
    if tuple(x.shape[-2:]) != (height, width):
        shrink = height < x.shape[-2] or width < x.shape[-1]
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=shrink)
    return x


def standardise(splits, pixels: torch.Tensor) -> torch.Tensor:
    """[0, 1] pixels in the dataset's format -> the source's standardisation (``pixel_stats``)."""
    mean, std = (torch.as_tensor(v, dtype=pixels.dtype, device=pixels.device).reshape(1, -1, 1, 1)
                 for v in splits.pixel_stats)
    return (pixels - mean) / std


def to_model_input(splits, images: torch.Tensor) -> torch.Tensor:
    """Generated images in [-1, 1] [B, 3, S, S] -> the dataset's format [B, C, H, W] (differentiable)."""
    return standardise(splits, fit_to_input(splits, (images.float() + 1) / 2))


def to_stored(splits, images: torch.Tensor, pixel_format: PixelFormat = "uint8") -> torch.Tensor:
    """Generated images in [-1, 1] -> what a chunk file holds: the dataset's channels and size, on the CPU."""
    with torch.no_grad():
        pixels = fit_to_input(splits, (images.float().clamp(-1, 1) + 1) / 2).clamp(0, 1).cpu()
    if pixel_format == "uint8":
        return (pixels * 255).round().to(torch.uint8)
    return pixels.contiguous()


def unit_pixels(stored: torch.Tensor) -> torch.Tensor:
    """Stored pixels (uint8 or float [0, 1]) -> float32 [0, 1]."""
    return stored.float() / 255 if stored.dtype == torch.uint8 else stored.float()


def stored_to_model_input(splits, stored: torch.Tensor) -> torch.Tensor:
    """Stored pixels -> the classifiers' input; images of another size or channel count (sets written at
    the generator's resolution) are brought to the dataset's format first."""
    return standardise(splits, fit_to_input(splits, unit_pixels(stored)))


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


def from_uint8(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float() / 127.5 - 1


# --- the set on disk -----------------------------------------------------------------------------------
@dataclass
class ClientImages:
    client_id: int
    images: torch.Tensor  # stored pixels [n, C, H, W]
    labels: torch.Tensor  # int64 [n]


class SyntheticSet:
    """The synthetic set as chunk files in order, with every image's label and client in memory.

    ``inputs(idx)`` reads rows for training; ``chunks()`` walks the set chunk by chunk (one chunk in memory)."""

    def __init__(self, splits, parts: Sequence[tuple[Path, int, torch.Tensor]]):
        """``parts``: (chunk file, client id, its labels) in set order."""
        if not parts:
            raise ConfigError("the synthetic set is empty: no client supports any class")
        self.splits = splits
        self.paths = [Path(p) for p, _, _ in parts]
        counts = [int(labels.numel()) for _, _, labels in parts]
        self.starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.long)
        self.labels = torch.cat([labels.long() for _, _, labels in parts])
        self.clients = torch.cat([torch.full((n,), cid, dtype=torch.long) for (_, cid, _), n in zip(parts, counts)])

    def __len__(self) -> int:
        return int(self.labels.numel())

    def _read_rows(self, chunk: int, rows: list[int]) -> torch.Tensor:
        """Stored pixels of ``rows`` (sorted) of one chunk file, reading runs of consecutive rows at once."""
        from safetensors import safe_open

        parts = []
        with safe_open(str(self.paths[chunk]), "pt") as fh:
            images = fh.get_slice("images")
            start = prev = rows[0]
            for r in rows[1:] + [None]:
                if r is not None and r == prev + 1:
                    prev = r
                    continue
                parts.append(images[start: prev + 1])
                if r is not None:
                    start = prev = r
        return torch.cat(parts)

    def inputs(self, idx: torch.Tensor) -> torch.Tensor:
        """The classifiers' input for the images ``idx`` (any order), read from their chunk files."""
        idx = torch.as_tensor(idx, dtype=torch.long).flatten()
        which = torch.searchsorted(self.starts, idx, right=True) - 1
        out: Optional[torch.Tensor] = None
        for chunk in which.unique().tolist():
            pos = torch.nonzero(which == chunk).flatten()
            local = idx[pos] - self.starts[chunk]
            order = torch.argsort(local)
            rows = stored_to_model_input(self.splits, self._read_rows(chunk, local[order].tolist()))
            if out is None:
                out = torch.empty((len(idx), *rows.shape[1:]), dtype=rows.dtype)
            out[pos[order]] = rows
        return out if out is not None else torch.empty((0, *self.splits.input_shape))

    def chunks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """(rows of the set, the classifiers' input) for every chunk in order."""
        from safetensors.torch import load_file

        for i, path in enumerate(self.paths):
            rows = slice(int(self.starts[i]), int(self.starts[i + 1]))
            yield rows, stored_to_model_input(self.splits, load_file(str(path))["images"])


def round_robin_labels(classes: Sequence[int], per_class: int) -> list[int]:
    """``per_class`` images of every class, classes interleaved (see the module docstring)."""
    return [int(classes[j % len(classes)]) for j in range(per_class * len(classes))]


def chunk_ranges(n: int, size: int) -> list[tuple[int, int]]:
    """[first, end) of consecutive chunks of ``size`` images covering ``n``."""
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def fingerprint(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


# --- the folder ----------------------------------------------------------------------------------------
CHUNK_KEYS = frozenset({"fingerprint", "client", "chunk", "first", "classes", "recipe"})


def _older_chunk(metadata: dict[str, str]) -> bool:
    """Chunks written before they were sealed (and one-file sets before chunking) are read, unverified: they
    carry no digest at all (a sealed chunk that lost only its metadata digest is refused)."""
    return TENSORS_DIGEST not in metadata


class SyntheticStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    @classmethod
    def of_run(cls, run_dir: Path) -> "SyntheticStore":
        return cls(Path(run_dir) / FOLDER)

    @classmethod
    def reused(cls, path: str) -> "SyntheticStore":
        """A run directory or its synthetic/ folder, as ``reuse_synthetic`` names it."""
        p = Path(path).expanduser()
        for folder in (p / FOLDER, p):
            if folder.is_dir() and cls(folder).clients():
                return cls(folder)
        raise ConfigError(f"reuse_synthetic: {path} holds no synthetic set (no {FOLDER}/client_*/chunk_*.safetensors); "
                          "name the run directory of a fedcado or sd_gen run")

    def client_folder(self, client_id: int) -> Path:
        return self.folder / f"client_{client_id:03d}"

    def chunk_path(self, client_id: int, chunk: int) -> Path:
        return self.client_folder(client_id) / f"chunk_{chunk:04d}.safetensors"

    def path(self, client_id: int, suffix: str = ".safetensors") -> Path:
        """``client_003<suffix>`` beside the chunk folders: the grid (.png), or a set written before chunking."""
        return self.folder / f"client_{client_id:03d}{suffix}"

    def chunk_files(self, client_id: int) -> list[Path]:
        """The client's chunk files in order (an unchunked file of an earlier set counts as one chunk)."""
        files = sorted(self.client_folder(client_id).glob("chunk_*.safetensors"))
        if not files and self.path(client_id).is_file():
            files = [self.path(client_id)]
        return files

    def clients(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        ids = {int(p.name.split("_")[1]) for p in self.folder.glob("client_*") if p.is_dir()
               and any(p.glob("chunk_*.safetensors"))}
        ids |= {int(p.stem.split("_")[1]) for p in self.folder.glob("client_*.safetensors")}
        return sorted(ids)

    @staticmethod
    def intact_chunk(path: Path) -> Optional[dict[str, str]]:
        """The metadata of the chunk file at ``path`` when it is there and verifies (tensors and metadata), else
        None: a chunk of this run's own set that does not verify is said and generated again."""
        if not path.is_file():
            return None
        try:
            return load_sealed(path, CHUNK_KEYS, _older_chunk).metadata
        except Unverified as err:
            print(f"synthetic: {path} cannot be trusted ({err.reason}); generating it again", file=sys.stderr)
            return None

    @staticmethod
    def _opened(path: Path) -> Opened:
        """A chunk read as it is (a reused set, an analysis), verified: one that does not verify is refused."""
        try:
            return load_sealed(path, CHUNK_KEYS, _older_chunk)
        except Unverified as err:
            raise ConfigError(f"synthetic set: {path} cannot be trusted: {err.reason}. Run the run that wrote the "
                              "set again (or, in a run that reuses it, leave reuse_synthetic out to generate "
                              "the set)") from None

    def metadata(self, client_id: int) -> Optional[dict[str, str]]:
        """The metadata of the client's first chunk (its recipe and classes), verified."""
        files = self.chunk_files(client_id)
        if not files:
            return None
        try:
            return read_metadata(files[0], CHUNK_KEYS, _older_chunk)[0]
        except Unverified as err:
            raise ConfigError(f"synthetic set: {files[0]} cannot be trusted: {err.reason}") from None

    def load(self, client_id: int) -> Optional[ClientImages]:
        """All the client's images in memory (small sets, inspection), verified; None if it has none."""
        files = self.chunk_files(client_id)
        if not files:
            return None
        tensors = [self._opened(p).tensors for p in files]
        return ClientImages(client_id, torch.cat([t["images"] for t in tensors]),
                            torch.cat([t["labels"] for t in tensors]))

    def parts(self, client_id: int) -> list[tuple[Path, int, torch.Tensor]]:
        """(chunk file, client, labels) of every chunk of the client, as SyntheticSet takes them; every chunk
        is verified whole here, once, so the reads of training batches (slices) need not be."""
        out, older = [], False
        for path in self.chunk_files(client_id):
            opened = self._opened(path)
            older |= opened.legacy
            out.append((path, client_id, opened.tensors["labels"]))
        if older:
            print(f"warning: the synthetic images of client {client_id} in {self.folder} were written before chunk "
                  "files carried a checksum; they are used unverified", file=sys.stderr)
        return out

    def save_chunk(self, client_id: int, chunk: int, images: torch.Tensor, labels: torch.Tensor,
                   meta: dict[str, str]) -> Path:
        path = self.chunk_path(client_id, chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_sealed(path, {"images": images.contiguous(), "labels": labels.contiguous()}, meta)
        return path

    def drop_chunks_from(self, client_id: int, first: int) -> None:
        """Remove the client's chunk files from index ``first`` on (left by a recipe with more images)."""
        for path in self.client_folder(client_id).glob("chunk_*.safetensors"):
            if int(path.stem.split("_")[1]) >= first:
                path.unlink()

    def log(self, row: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "generation.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def write_grid(self, client_id: int, files: Sequence[Path], classes: int, columns: int = GRID_COLUMNS) -> None:
        """One row per class present (label order), up to ``columns`` images each, black where fewer; the
        chunks are read one at a time until each of the ``classes`` rows is full."""
        from safetensors.torch import load_file

        rows: dict[int, list[torch.Tensor]] = {}
        for path in files:
            t = load_file(str(path))
            for image, label in zip(t["images"], t["labels"].tolist()):
                row = rows.setdefault(int(label), [])
                if len(row) < columns:
                    row.append(image)
            if len(rows) >= classes and all(len(r) >= columns for r in rows.values()):
                break
        if rows:
            write_grid(self.path(client_id, ".png"), rows, columns)

    def write_index(self, synthetic: SyntheticSet, info: dict[str, Any]) -> None:
        clients = []
        for cid in sorted({int(c) for c in synthetic.clients.tolist()}):
            labels = synthetic.labels[synthetic.clients == cid]
            files = [str(p.relative_to(self.folder)) for p in synthetic.paths if p.parent.name == f"client_{cid:03d}"]
            clients.append({"client": cid, "files": files, "images": int(labels.numel()),
                            "classes": sorted({int(c) for c in labels.tolist()})})
        write_json(self.folder / "index.json", {**info, "images": len(synthetic), "clients": clients})


def write_grid(path: Path, rows: dict[int, list[torch.Tensor]], columns: int = GRID_COLUMNS) -> None:
    """A PNG of stored images, one row per class (label order); grey images shown as grey, small ones enlarged."""
    from PIL import Image

    first = next(iter(rows.values()))[0]
    cell = (3, *first.shape[1:])
    strips = []
    for c in sorted(rows):
        strip = torch.zeros(columns, *cell, dtype=torch.uint8)
        for j, image in enumerate(rows[c][:columns]):
            strip[j] = (unit_pixels(image) * 255).round().to(torch.uint8).expand(cell)
        strips.append(torch.cat(list(strip), dim=2))  # [3, H, columns * W]
    sheet = torch.cat(strips, dim=1).permute(1, 2, 0).numpy()
    scale = max(2, 64 // max(cell[1:]))
    image = Image.fromarray(sheet).resize((sheet.shape[1] * scale, sheet.shape[0] * scale), Image.NEAREST)
    write_atomic(path, lambda tmp: image.save(tmp, format="PNG"))


# --- resumable generation ------------------------------------------------------------------------------
@dataclass
class GenerationJob:
    client_id: int
    classes: list[int]
    recipe: dict[str, Any]  # everything that determines the client's images; hashed into each chunk's fingerprint
    # (prompts, labels, index of the first image in the client's sequence) -> a result whose ``images`` are
    # in [-1, 1] [n, 3, S, S]; called once per chunk that has to be generated
    generate: Callable[[list[str], torch.Tensor, int], Any]


@dataclass
class GenerationStats:
    generated_images: int = 0
    reused_clients: int = 0
    reused_chunks: int = 0
    seconds: float = 0.0

    @property
    def images_per_second(self) -> float:
        return self.generated_images / self.seconds if self.seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {"generated_images": self.generated_images, "generation_seconds": round(self.seconds, 3),
                "generation_images_per_second": round(self.images_per_second, 4),
                "generation_clients_skipped": self.reused_clients, "generation_chunks_skipped": self.reused_chunks}


def generate_set(store: SyntheticStore, jobs: Sequence[GenerationJob], prompts_of: Callable[[list[int]], list[str]],
                 per_class: int, chunk: int, splits, pixel_format: PixelFormat = "uint8",
                 verbose: bool = False) -> tuple[SyntheticSet, GenerationStats]:
    """Every job's images, chunk by chunk: a chunk whose file matches is kept, any other is generated and
    written at once (module docstring)."""
    stats, parts = GenerationStats(), []
    storage = {"pixel_format": pixel_format, "stored_shape": list(splits.input_shape)}
    for job in jobs:
        if not job.classes:
            continue
        labels = torch.tensor(round_robin_labels(job.classes, per_class), dtype=torch.long)
        ranges = chunk_ranges(len(labels), chunk)
        files, generated = [], False
        for k, (lo, hi) in enumerate(ranges):
            recipe = {**job.recipe, **storage, "chunk": k, "first": lo, "images": hi - lo}
            digest = fingerprint(recipe)
            path = store.chunk_path(job.client_id, k)
            meta = store.intact_chunk(path)
            if meta is None or meta.get("fingerprint") != digest:
                start = time.perf_counter()
                result = job.generate(prompts_of(labels[lo:hi].tolist()), labels[lo:hi], lo)
                images = to_stored(splits, result.images, pixel_format)
                seconds = time.perf_counter() - start
                meta = {"fingerprint": digest, "client": str(job.client_id), "chunk": str(k), "first": str(lo),
                        "classes": json.dumps(job.classes), "recipe": json.dumps(recipe, sort_keys=True, default=str)}
                store.save_chunk(job.client_id, k, images, labels[lo:hi].clone(), meta)
                row = {"client": job.client_id, "chunk": k, "images": hi - lo, "classes": len(job.classes),
                       "seconds": round(seconds, 3), "images_per_second": round((hi - lo) / max(seconds, 1e-9), 4)}
                if getattr(result, "edit_losses", None):
                    row["edit_loss_first"], row["edit_loss_last"] = result.edit_losses[0], result.edit_losses[-1]
                store.log(row)
                if verbose:
                    print(f"synthetic: client {job.client_id} chunk {k + 1}/{len(ranges)}: {hi - lo} images in "
                          f"{seconds:.1f} s ({row['images_per_second']:.2f} img/s)", file=sys.stderr, flush=True)
                del result, images
                stats.generated_images += hi - lo
                stats.seconds += seconds
                generated = True
            else:
                stats.reused_chunks += 1
            files.append(path)
            parts.append((path, job.client_id, labels[lo:hi]))
        store.drop_chunks_from(job.client_id, len(ranges))
        if generated or not store.path(job.client_id, ".png").is_file():
            store.write_grid(job.client_id, files, len(job.classes))
        stats.reused_clients += not generated
    return SyntheticSet(splits, parts), stats
