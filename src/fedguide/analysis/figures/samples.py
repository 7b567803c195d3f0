"""Generated images beside the clients' own images of the same class (FedCADO Figs. 7-10, FedDISC Fig. 6),
for the one-shot runs that keep what they generated:

- FedCADO and SD_Gen: the synthetic training set under ``synthetic/`` (methods/_synthetic.py), each image
  made for one client (guided by its classifier, or covering its classes);
- FedDISC: the images it keeps of its generation, ``feddisc_samples.safetensors``, each guided by one
  client's domain feature (-1 when the run used none).

One row per (client, class): up to ``PER_SIDE`` generated images, then up to ``PER_SIDE`` training images
of that class from that client (drawn with the analysis seed), or from every client when that client holds
none or the image belongs to no client. Rows cover the clients in turn, at most ``MAX_ROWS``. The
originals' classes are their true labels, also where the clients themselves hold no labels (FedDISC).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import new_figure, save_numbers, save_png

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun

PER_SIDE = 6
MAX_ROWS = 12
TILE = 96  # at most this many pixels a side per image in the figure
ORIGINALS_TAG = 0x5A3


@dataclass
class Generated:
    images: torch.Tensor  # float [N, 3, H, W] in [0, 1]
    labels: torch.Tensor  # int64 [N]
    clients: torch.Tensor  # int64 [N]: the client each image was made for or guided by, -1 for none
    sources: list[str]


def generated_images(run_dir: Path) -> Optional[Generated]:
    """Every generated image the run folder keeps, or None."""
    from safetensors.torch import load_file

    from fedguide.methods._synthetic import SyntheticStore
    from fedguide.methods.frozen_encoder.centroids.feddisc import SAMPLES_FILE

    images, labels, clients, sources = [], [], [], []
    store = SyntheticStore.of_run(run_dir)
    for cid in store.clients() if store.folder.is_dir() else []:
        part = store.load(cid)
        images.append(unit_rgb(part.images))
        labels.append(part.labels)
        clients.append(torch.full((len(part.labels),), cid, dtype=torch.long))
    if images:
        sources.append(f"{store.folder.name}/ (the synthetic training set)")
    kept = Path(run_dir) / SAMPLES_FILE
    if kept.is_file():
        tensors = load_file(str(kept))
        images.append(unit_rgb(tensors["images"]))
        labels.append(tensors["labels"])
        clients.append(tensors["clients"])
        sources.append(f"{SAMPLES_FILE} (the images kept of the generation)")
    if not images:
        return None
    return Generated(torch.cat(images), torch.cat(labels).long(), torch.cat(clients).long(), sources)


def unit_rgb(stored: torch.Tensor) -> torch.Tensor:
    """Stored pixels (uint8, or float in [0, 1]; one or three channels) -> float RGB in [0, 1]."""
    x = stored.float() / 255 if stored.dtype == torch.uint8 else stored.float()
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x


def row_pairs(generated: Generated, max_rows: int) -> list[tuple[int, int]]:
    """(client, class) pairs, the clients taking turns, at most ``max_rows``."""
    pairs = sorted({(int(k), int(c)) for k, c in zip(generated.clients.tolist(), generated.labels.tolist())})
    by_client: dict[int, list[tuple[int, int]]] = {}
    for pair in pairs:
        by_client.setdefault(pair[0], []).append(pair)
    out, queues = [], list(by_client.values())
    while len(out) < max_rows and any(queues):
        for q in queues:
            if q and len(out) < max_rows:
                out.append(q.pop(0))
    return sorted(out)


def fit_tiles(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Float RGB [n, 3, h, w] in [0, 1] -> uint8 [n, 3, *size]."""
    if len(images) and tuple(images.shape[-2:]) != tuple(size):
        shrink = size[0] < images.shape[-2] or size[1] < images.shape[-1]
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=shrink)
    return (images.clamp(0, 1) * 255).round().to(torch.uint8)


def originals(run: AnalysisRun, client: int, label: int, count: int, seed: int) -> tuple[np.ndarray, str]:
    """(global training indices, where from) of up to ``count`` training images of class ``label``."""
    labels = run.splits.train_y.numpy()
    client_indices = run.prepared.data.client_indices
    own = (np.asarray(client_indices[client], dtype=np.int64) if 0 <= client < len(client_indices)
           else np.empty(0, np.int64))
    pool, source = own[labels[own] == label], f"client {client}"
    if not len(pool):
        every = run.client_samples()
        pool, source = every[labels[every] == label], "every client (this client holds none of the class)"
    rng = np.random.default_rng(np.random.SeedSequence([seed, ORIGINALS_TAG, client + 1, label]))
    return np.sort(rng.choice(pool, size=min(count, len(pool)), replace=False)), source


@FIGURES.register(
    "samples",
    summary="one-shot generating runs: generated images beside client originals of the same class")
class GeneratedSamples(Figure):
    order = 60

    def applies(self, run: AnalysisRun) -> Optional[str]:
        if generated_images(run.run_dir) is None:
            return ("the run folder holds no generated images (a synthetic/ set or feddisc_samples.safetensors): only "
                    "the one-shot generating methods (fedcado, sd_gen, feddisc) keep them")
        if run.splits.pixel_stats is None or len(run.splits.input_shape) != 3:
            return "the dataset's images cannot be shown (its source declares no pixel statistics)"
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        generated = generated_images(run.run_dir)
        height, width = (int(s) for s in generated.images.shape[-2:])
        scale = min(1.0, TILE / max(height, width))
        tile = (max(1, round(height * scale)), max(1, round(width * scale)))
        rows, sheet_rows = [], []
        names = run.class_names
        for client, label in row_pairs(generated, MAX_ROWS):
            members = torch.nonzero((generated.clients == client) & (generated.labels == label)).flatten()
            shown = generated.images[members[:PER_SIDE]]
            idx, source = originals(run, client, label, PER_SIDE, seed)
            own = unit_rgb(run.splits.unit_images(run.splits.train_x[torch.from_numpy(idx)].float()))
            rows.append({"client": client, "class": label, "class_name": str(names[label]),
                         "generated_of_pair": int(len(members)), "generated_shown": int(len(shown)),
                         "original_indices": idx, "originals_from": source})
            sheet_rows.append((fit_tiles(shown, tile), fit_tiles(own, tile)))
        numbers = {
            "figure": "generated images beside client originals of the same class (FedCADO Figs. 7-10, FedDISC Fig. 6)",
            "run": str(run.run_dir), "method": run.method_label, "sources": generated.sources,
            "generated_total": int(len(generated.labels)), "image_size": [height, width], "seed": seed,
            "originals": "training images of the row's client and class (true labels), drawn with the analysis seed",
            "rows": rows,
        }
        png = save_png(draw(numbers, sheet_rows, tile), run.out_dir / "samples.png")
        return [png, save_numbers(run.out_dir / "samples.json", numbers)]


def sheet(sheet_rows: list[tuple[torch.Tensor, torch.Tensor]], tile: tuple[int, int], gap: int = 2
          ) -> tuple[np.ndarray, int, int]:
    """(uint8 RGB sheet, generated columns, original columns): per row its generated tiles, an empty column,
    its original tiles, white between."""
    (th, tw), (ch, cw) = tile, (tile[0] + gap, tile[1] + gap)
    n_gen = max([len(gen) for gen, _ in sheet_rows] + [1])
    n_own = max([len(own) for _, own in sheet_rows] + [1])
    out = np.full((len(sheet_rows) * ch, (n_gen + 1 + n_own) * cw, 3), 255, dtype=np.uint8)
    for r, (gen, own) in enumerate(sheet_rows):
        for col, img in [*enumerate(gen), *((n_gen + 1 + j, img) for j, img in enumerate(own))]:
            out[r * ch: r * ch + th, col * cw: col * cw + tw] = img.permute(1, 2, 0).numpy()
    return out, n_gen, n_own


def draw(numbers: dict, sheet_rows: list, tile: tuple[int, int]):
    pixels, n_gen, n_own = sheet(sheet_rows, tile)
    rows = max(len(sheet_rows), 1)
    fig = new_figure((2.0 + 0.85 * (n_gen + 1 + n_own), 1.0 + 0.85 * rows))
    ax = fig.add_subplot()
    ax.imshow(pixels, interpolation="nearest")
    cell, cw = tile[0] + 2, tile[1] + 2
    ax.set_yticks([r * cell + tile[0] / 2 for r in range(len(numbers["rows"]))],
                  [f"client {r['client']} · {r['class_name']}" if r["client"] >= 0 else r["class_name"]
                   for r in numbers["rows"]], fontsize="small")
    ax.set_xticks([n_gen * cw / 2, (n_gen + 1 + n_own / 2) * cw], ["generated", "client originals"])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(f"{numbers['method']}: generated images beside client originals", fontsize="medium")
    return fig
