"""What every stage trains on: the public pools of the embedded datasets (drawn as a run's
``data.public_fraction`` draws them, so no client or test image is ever seen) and the frozen text
encoder's states of their class prompts."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.guidance.embedded.backbones import text_encoder_path
from fedguide.guidance.embedded.clip import mean_pool
from fedguide.guidance.embedded.pretrain.settings import DATASETS, PROMPT, PretrainSettings


@dataclass
class Pool:
    images: torch.Tensor  # [N, 3, 32, 32] in [-1, 1]
    labels: torch.Tensor  # [N] prompt index
    sources: torch.Tensor  # [N] index into DATASETS
    prompts: list[str]
    slices: list[dict]  # per dataset: name, public indices count, per-class counts, sha256 of indices


def pool_indices(labels: np.ndarray, public_fraction: float, public_seed: int,
                 max_per_class: Optional[int] = None) -> np.ndarray:
    """Sorted training indices of one dataset's pool: its public pool of these settings, drawn as a run's
    ``data.public_fraction`` draws it, at most ``max_per_class`` of each class (the oracle guidance source
    learns from the same images)."""
    from fedguide.data.federated import public_pool

    idx = public_pool(labels, public_fraction, public_seed)
    if max_per_class is not None:
        y = labels[idx]
        idx = np.sort(np.concatenate([idx[y == c][:max_per_class] for c in np.unique(y)]))
    return idx


def indices_sha256(indices: np.ndarray) -> str:
    """The digest a pool's indices are recorded under (the model card's slices, the oracle's key)."""
    return hashlib.sha256(np.asarray(indices, np.int64).tobytes()).hexdigest()


def rgb_input(x: torch.Tensor, side: int = 32) -> torch.Tensor:
    """Images in [-1, 1] ([B, 1 or 3, H, W]) as the embedded models (and the oracle) read them: float32 RGB,
    ``side`` square, resized bilinearly with corners not aligned."""
    x = x.float()
    if tuple(x.shape[-2:]) != (side, side):
        x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
    return x.expand(-1, 3, -1, -1).contiguous()


def load_pool(settings: PretrainSettings) -> Pool:
    import fedguide.data.sources  # noqa: F401  (registers every source)
    from fedguide.data.sources.base import DATASETS as SOURCES

    images, labels, sources, prompts, slices = [], [], [], [], []
    for position, name in enumerate(DATASETS):
        splits = SOURCES.get(name).obj(SOURCES.parse_params(name, {}, "data"))
        idx = pool_indices(splits.train_y.numpy(), settings.public_fraction, settings.public_seed,
                           settings.max_per_class)
        images.append(rgb_input(splits.unit_images(splits.train_x[idx]) * 2 - 1))
        labels.append(splits.train_y[idx] + len(prompts))
        sources.append(torch.full((len(idx),), position, dtype=torch.long))
        prompts += [PROMPT.format(c.lower()) for c in splits.class_names]
        slices.append({"dataset": name, "public_fraction": settings.public_fraction,
                       "public_seed": settings.public_seed, "images": int(len(idx)),
                       "per_class": np.bincount(splits.train_y[idx].numpy()).tolist(),
                       "indices_sha256": indices_sha256(idx)})
    return Pool(torch.cat(images), torch.cat(labels), torch.cat(sources), prompts, slices)


@dataclass
class PromptText:
    tokenizer: object  # saved with the models, its model_max_length set to the run's max_length
    tokens: torch.Tensor  # [P, L, H] token states of every class prompt (the UNet's context)
    mask: torch.Tensor  # [P, L] 1 for real tokens
    empty: torch.Tensor  # [1, L, H] the empty prompt's states (text dropout)
    pooled: torch.Tensor  # [P, H] sentence embeddings (the CLIP stage's targets)


def text_states(tokenizer, text_encoder, prompts: list[str], max_length: int):
    enc = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    with torch.no_grad():
        tokens = text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask).last_hidden_state
    return tokens, enc.attention_mask


def encode_prompts(prompts: list[str], max_length: int) -> PromptText:
    """The frozen MiniLM's view of the class prompts and of the empty prompt."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_encoder_path())
    tokenizer.model_max_length = max_length
    text_encoder = AutoModel.from_pretrained(text_encoder_path()).eval()
    tokens, mask = text_states(tokenizer, text_encoder, prompts, max_length)
    empty, _ = text_states(tokenizer, text_encoder, [""], max_length)
    return PromptText(tokenizer, tokens, mask, empty, mean_pool(tokens, mask))
