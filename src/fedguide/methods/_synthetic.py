"""The server's synthetic training set of the generation-based one-shot methods (FedCADO, SD_Gen).

What it holds, per client k (the client whose classifier guided the images, or, for SD_Gen, whose
classes they cover): images as uint8 RGB [n, 3, S, S] (S = the generator's image size), their labels
and, implied by the file, the client id. Layout in the run directory::

    synthetic/client_003.safetensors   images (uint8), labels (int64); metadata: fingerprint, client, classes
    synthetic/client_003.png           a grid: one row per class, up to ``GRID_COLUMNS`` images each
    synthetic/generation.jsonl         one line per generated client: images, seconds, images/s
    synthetic/index.json               the whole set: files, counts, class names, throughput

Decisions:

- Images are stored as 8-bit pixels, the form any image set has; they are quantised once, and the
  aggregation trains on exactly what is on disk (a reused set gives the same training as the run that
  generated it).
- Resumable per client: a client's file is written (atomically) as soon as its images are done and is
  skipped by a later call when its ``fingerprint`` matches: a hash of everything that determines the
  images (guidance model, sampler and loss settings, seeds, classes, and the guiding classifier's
  weights). A file with another fingerprint is stale and is regenerated, never silently reused.
- Prompt order: a client's images go through its classes round-robin (image j has class
  classes[j % len(classes)]), the deterministic form of the paper's "randomly select a category y
  supported by the client classifier" (Algorithm 1, line 4) with equal counts per class; a batch then
  mixes classes as a client's training batches do, which is what FedCADO's BN-statistics loss compares
  against.
- Generated pixels reach a client's classifier in the dataset's own format (``to_model_input``): the
  inverse of ``guidance_pixels``: [-1, 1] -> [0, 1], RGB -> grey by the channel mean for one-channel
  data (the generators see grey images as three equal channels), bilinear resizing to the dataset's
  size (antialiased when shrinking), then the source's standardisation (``pixel_stats``).
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from fedguide.core.atomic import write_atomic, write_json
from fedguide.registry import ConfigError

FOLDER = "synthetic"
GRID_COLUMNS = 8


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


def to_model_input(splits, images: torch.Tensor) -> torch.Tensor:
    """Generated images in [-1, 1] [B, 3, S, S] -> the dataset's format [B, C, H, W] (differentiable)."""
    channels, height, width = splits.input_shape
    x = (images.float() + 1) / 2
    if channels == 1:
        x = x.mean(1, keepdim=True)
    if tuple(x.shape[-2:]) != (height, width):
        shrink = height < x.shape[-2] or width < x.shape[-1]
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=shrink)
    mean, std = (torch.as_tensor(v, dtype=x.dtype, device=x.device).reshape(1, -1, 1, 1) for v in splits.pixel_stats)
    return (x - mean) / std


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


def from_uint8(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float() / 127.5 - 1


# --- one client's images -------------------------------------------------------------------------------
@dataclass
class ClientImages:
    client_id: int
    images: torch.Tensor  # uint8 [n, 3, S, S]
    labels: torch.Tensor  # int64 [n]


@dataclass
class SyntheticSet:
    images: torch.Tensor  # uint8 [N, 3, S, S]
    labels: torch.Tensor  # int64 [N]
    clients: torch.Tensor  # int64 [N]: the client each image was generated for

    @classmethod
    def concat(cls, parts: Sequence[ClientImages]) -> "SyntheticSet":
        if not parts:
            raise ConfigError("the synthetic set is empty: no client supports any class")
        return cls(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]),
                   torch.cat([torch.full((len(p.labels),), p.client_id, dtype=torch.long) for p in parts]))

    def __len__(self) -> int:
        return int(self.labels.numel())


def round_robin_labels(classes: Sequence[int], per_class: int) -> list[int]:
    """``per_class`` images of every class, classes interleaved (see the module docstring)."""
    return [int(classes[j % len(classes)]) for j in range(per_class * len(classes))]


def fingerprint(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


# --- the folder ----------------------------------------------------------------------------------------
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
            if folder.is_dir() and any(folder.glob("client_*.safetensors")):
                return cls(folder)
        raise ConfigError(f"reuse_synthetic: {path} holds no synthetic set (no {FOLDER}/client_*.safetensors); "
                          "name the run directory of a fedcado or sd_gen run")

    def path(self, client_id: int, suffix: str = ".safetensors") -> Path:
        return self.folder / f"client_{client_id:03d}{suffix}"

    def metadata(self, client_id: int) -> Optional[dict[str, str]]:
        from safetensors import safe_open

        path = self.path(client_id)
        if not path.is_file():
            return None
        with safe_open(str(path), "pt") as fh:
            return dict(fh.metadata() or {})

    def load(self, client_id: int, expected: Optional[str] = None) -> Optional[ClientImages]:
        """The client's images; None if absent or (with ``expected``) made by another recipe."""
        from safetensors.torch import load_file

        meta = self.metadata(client_id)
        if meta is None or (expected is not None and meta.get("fingerprint") != expected):
            return None
        tensors = load_file(str(self.path(client_id)))
        return ClientImages(client_id, tensors["images"], tensors["labels"])

    def clients(self) -> list[int]:
        return sorted(int(p.stem.split("_")[1]) for p in self.folder.glob("client_*.safetensors"))

    def save(self, part: ClientImages, meta: dict[str, str], class_names: Sequence[str]) -> None:
        from safetensors.torch import save_file

        tensors = {"images": part.images.contiguous(), "labels": part.labels.contiguous()}
        write_atomic(self.path(part.client_id), lambda tmp: save_file(tensors, tmp, metadata=meta))
        write_grid(self.path(part.client_id, ".png"), part, class_names)

    def log(self, row: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "generation.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def write_index(self, synthetic: "SyntheticSet", info: dict[str, Any]) -> None:
        clients = []
        for cid in sorted({int(c) for c in synthetic.clients.tolist()}):
            labels = synthetic.labels[synthetic.clients == cid]
            clients.append({"client": cid, "file": self.path(cid).name, "images": int(labels.numel()),
                            "classes": sorted({int(c) for c in labels.tolist()})})
        write_json(self.folder / "index.json", {**info, "images": len(synthetic), "clients": clients})


def write_grid(path: Path, part: ClientImages, class_names: Sequence[str], columns: int = GRID_COLUMNS,
               scale: int = 2) -> None:
    """One row per class present (label order), up to ``columns`` images each, black where fewer."""
    from PIL import Image

    rows = []
    for c in sorted({int(v) for v in part.labels.tolist()}):
        members = part.images[part.labels == c][:columns]
        row = torch.zeros(columns, *part.images.shape[1:], dtype=torch.uint8)
        row[: len(members)] = members
        rows.append(torch.cat(list(row), dim=2))  # [3, S, columns * S]
    if not rows:
        return
    sheet = torch.cat(rows, dim=1).permute(1, 2, 0).numpy()
    image = Image.fromarray(sheet).resize((sheet.shape[1] * scale, sheet.shape[0] * scale), Image.NEAREST)
    write_atomic(path, lambda tmp: image.save(tmp, format="PNG"))


# --- resumable generation ------------------------------------------------------------------------------
@dataclass
class GenerationJob:
    client_id: int
    classes: list[int]
    recipe: dict[str, Any]  # everything that determines the images; its hash is the file's fingerprint
    # (prompts, labels) -> (images in [-1, 1] [n, 3, S, S], sampler result); called only when generating
    generate: Callable[[list[str], torch.Tensor], Any]


@dataclass
class GenerationStats:
    generated_images: int = 0
    reused_clients: int = 0
    seconds: float = 0.0

    @property
    def images_per_second(self) -> float:
        return self.generated_images / self.seconds if self.seconds > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        return {"generated_images": self.generated_images, "generation_seconds": round(self.seconds, 3),
                "generation_images_per_second": round(self.images_per_second, 4),
                "generation_clients_skipped": self.reused_clients}


def generate_set(store: SyntheticStore, jobs: Sequence[GenerationJob], prompts_of: Callable[[list[int]], list[str]],
                 per_class: int, class_names: Sequence[str],
                 verbose: bool = False) -> tuple[SyntheticSet, GenerationStats]:
    """Every job's images: read back where a matching file exists, otherwise generated and written at once."""
    stats, parts = GenerationStats(), []
    for job in jobs:
        if not job.classes:
            continue
        digest = fingerprint(job.recipe)
        part = store.load(job.client_id, expected=digest)
        if part is not None:
            stats.reused_clients += 1
            parts.append(part)
            continue
        labels = round_robin_labels(job.classes, per_class)
        start = time.perf_counter()
        result = job.generate(prompts_of(labels), torch.tensor(labels, dtype=torch.long))
        seconds = time.perf_counter() - start
        part = ClientImages(job.client_id, to_uint8(result.images), torch.tensor(labels, dtype=torch.long))
        store.save(part, {"fingerprint": digest, "client": str(job.client_id), "classes": json.dumps(job.classes),
                          "recipe": json.dumps(job.recipe, sort_keys=True, default=str)}, class_names)
        row = {"client": job.client_id, "images": len(labels), "classes": len(job.classes),
               "seconds": round(seconds, 3), "images_per_second": round(len(labels) / max(seconds, 1e-9), 4)}
        if getattr(result, "edit_losses", None):
            row["edit_loss_first"], row["edit_loss_last"] = result.edit_losses[0], result.edit_losses[-1]
        store.log(row)
        if verbose:
            print(f"synthetic: client {job.client_id} {len(labels)} images in {seconds:.1f} s "
                  f"({row['images_per_second']:.2f} img/s)", file=sys.stderr, flush=True)
        stats.generated_images += len(labels)
        stats.seconds += seconds
        parts.append(part)
    return SyntheticSet.concat(parts), stats
