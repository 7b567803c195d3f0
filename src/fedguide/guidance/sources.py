"""Where guidance models come from: a local folder, a hub snapshot or the embedded folder, and the
fingerprint that keys feature caches on them.

The lowest layer of loading (the pipeline reader, the CLIP image-encoder loader and the methods' own
encoders all resolve sources here), so it imports nothing else of the guidance layer; that keeps
``loading``, ``model`` and ``image_encoder`` from importing one another in a circle.

A hub id is resolved to a local snapshot of only the subfolders the layer uses (not the multi-GB
single-file checkpoints or the safety checker), so that offline (``HF_HUB_OFFLINE=1``) a hub id that is
not in the local cache fails at once with an error that says how to pass a folder instead.

The fingerprint is the hub commit of a snapshot, or, for a local folder, a hash of every config file
and of each weight file's size, head and tail (hashing GBs of weights on every load would cost more than
it guards against; a retrained model changes its head/tail bytes).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fedguide.core.checksums import cached_file_sha256
from fedguide.registry import ConfigError

SUBFOLDERS = ("vae", "unet", "text_encoder", "tokenizer", "scheduler", "image_encoder", "feature_extractor",
              "image_normalizer", "image_noising_scheduler")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


class GuidanceLoadError(ConfigError):
    """A guidance model cannot be loaded; the message names the fix."""


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "FEDGUIDE_OFFLINE"))


# Per subfolder: configs, tokenizer files and the fp32 safetensors weights — not the .bin, fp16, non-EMA
# and single-file checkpoint copies that triple SD-1.5's download.
PIPELINE_FILES = tuple(f"{sub}/{pattern}" for sub in SUBFOLDERS for pattern in
                       ("*.json", "*.txt", "diffusion_pytorch_model.safetensors", "model.safetensors")) \
    + ("model_index.json",)
# A single-model repo (a CLIP checkpoint): configs, tokenizer files and safetensors weights, not the
# TensorFlow/Flax copies.
MODEL_FILES = ("*.json", "*.txt", "*.safetensors")


def resolve_source(source: str, revision: str | None = None, allow: tuple[str, ...] = PIPELINE_FILES,
                   setting: str = "guidance.model") -> Path:
    """A local folder as is; a hub id as its local snapshot (downloaded unless offline); ``embedded``
    as the folder shipped with fedguide. ``setting``: the config key an error tells the user to set."""
    if source == "embedded":
        from fedguide.guidance.embedded import SHIPPED

        if not (SHIPPED / "model_index.json").is_file():
            raise GuidanceLoadError(f"the embedded guidance models are missing ({SHIPPED}); reinstall fedguide or "
                                    f"rebuild them with `fedguide pretrain-guidance --out {SHIPPED}`")
        return SHIPPED
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise GuidanceLoadError(
            f"guidance model '{source}' is neither a folder nor a hub id (owner/name); pass a folder with the "
            "Stable Diffusion layout (vae/, unet/, text_encoder/, tokenizer/, scheduler/) or a hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=list(allow), local_files_only=_offline()))
    except Exception as err:  # the hub raises several types (offline, missing repo, gated, network)
        how = ("on a machine with a network run `huggingface-cli download "
               f"{source} --local-dir DIR` (or save the pipeline with save_pretrained), copy DIR here and pass "
               f"{setting}=DIR")
        if _offline():
            raise GuidanceLoadError(f"guidance model '{source}' is not in the local hub cache and downloads are "
                                    f"off (HF_HUB_OFFLINE/FEDGUIDE_OFFLINE); {how}") from None
        raise GuidanceLoadError(f"cannot fetch guidance model '{source}': {err}; {how}") from None


def fingerprint(folder: Path, source: str) -> str:
    """``source@commit`` for a hub snapshot, ``source@<hash of configs and weight files>`` for a folder."""
    if folder.parent.name == "snapshots":
        return f"{source}@{folder.name}"
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder).as_posix()
        if f.suffix in (".json", ".txt"):
            digest.update(rel.encode() + f.read_bytes())
        elif f.suffix in _WEIGHT_SUFFIXES:
            # The whole file: a change anywhere in the weights is another model. Read once per size and
            # mtime (cached_file_sha256), so a multi-GB pipeline costs its read only the first time.
            digest.update(f"{rel}:{cached_file_sha256(f)}".encode())
    return f"{source}@{digest.hexdigest()[:16]}"
