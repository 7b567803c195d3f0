"""IMDB movie reviews (Maas et al. 2011) from the official ``aclImdb`` folder, as int64 token ids.

Layout: ``aclImdb/{train,test}/{neg,pos}/*.txt`` (25k reviews per split; ``train/unsup`` is ignored).
The official archive is downloaded and unpacked (then deleted) when no copy is found and downloads are
allowed; finding, fetching and unpacking are ``_files``'s, as for every source with a download.

Decisions, where the dataset and FedDW leave a choice open:

- Tokeniser: lower-case, the ``<br />`` line breaks of the HTML source replaced by spaces, then the
  runs of letters and digits, keeping inner apostrophes ("don't", "it's"); punctuation is dropped.
  Simple and deterministic, with no tokenizer model to download.
- Vocabulary from the training split only (so no test statistics leak into the model): id 0 = padding,
  1 = unknown, then the ``vocab_size - 2`` most frequent training words, ties broken alphabetically.
  Counts are over the full reviews, before truncation.
- Each review becomes its first ``max_len`` tokens (``truncation: start``; ``end`` keeps the last ones),
  padded with 0 at the end. Labels: 0 = negative (``neg``), 1 = positive (``pos``).
- Order: negatives then positives, each by file name, so two runs give identical tensors.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
from pydantic import Field

from fedguide.data.sources._files import fetch_archive, find_or_fetch, has_paths
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.registry import ConfigError

URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
LAYOUT = "aclImdb/{train,test}/{neg,pos}/*.txt (the official aclImdb_v1.tar.gz unpacked); root may be aclImdb itself"
CLASS_NAMES = ["negative", "positive"]
LABEL_FOLDERS = ("neg", "pos")
PAD, UNK = 0, 1
_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


class ImdbParams(SourceParams):
    vocab_size: int = Field(20000, ge=3, description="token ids incl. 0 = padding and 1 = unknown")
    max_len: int = Field(256, ge=1, description="tokens per review, longer ones truncated, shorter padded")
    truncation: Literal["start", "end"] = Field("start", description="keep the first (start) or last tokens")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(_BREAK.sub(" ", text).lower())


def build_vocab(token_lists: list[list[str]], vocab_size: int) -> dict[str, int]:
    counts = Counter(t for tokens in token_lists for t in tokens)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(token_lists: list[list[str]], vocab: dict[str, int], max_len: int, truncation: str) -> torch.Tensor:
    out = np.zeros((len(token_lists), max_len), dtype=np.int64)
    for i, tokens in enumerate(token_lists):
        kept = tokens[:max_len] if truncation == "start" else tokens[-max_len:]
        out[i, : len(kept)] = [vocab.get(t, UNK) for t in kept]
    return torch.from_numpy(out)


def read_split(folder: Path) -> tuple[list[list[str]], list[int]]:
    texts, labels = [], []
    for label, sub in enumerate(LABEL_FOLDERS):
        part = folder / sub
        if not part.is_dir():
            raise ConfigError(f"{part} is missing. Expected layout: {LAYOUT}")
        files = sorted(p for p in part.iterdir() if p.suffix == ".txt" and p.is_file())
        if not files:
            raise ConfigError(f"{part} holds no .txt reviews. Expected layout: {LAYOUT}")
        for path in files:
            try:
                texts.append(tokenize(path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError) as err:
                raise ConfigError(f"cannot read review {path} ({err}); re-extract the archive from {URL}. "
                                  f"Expected layout: {LAYOUT}") from None
            labels.append(label)
    return texts, labels


def locate(root: Optional[str]) -> Path:
    """The aclImdb folder: searched, else downloaded."""
    return find_or_fetch("IMDB", root, "imdb", ("", "aclImdb", "imdb/aclImdb"),
                         has_paths(dirs=[f"{s}/{c}" for s in ("train", "test") for c in LABEL_FOLDERS]), LAYOUT,
                         URL, fetch_archive(URL, "aclImdb_v1.tar.gz"))


@DATASETS.register("imdb", params=ImdbParams, summary="IMDB reviews (aclImdb), 2 classes, int64 token ids")
def load_imdb(params: ImdbParams) -> DatasetSplits:
    folder = locate(params.root)
    train_tokens, train_y = read_split(folder / "train")
    test_tokens, test_y = read_split(folder / "test")
    vocab = build_vocab(train_tokens, params.vocab_size)
    return DatasetSplits(
        train_x=encode(train_tokens, vocab, params.max_len, params.truncation),
        train_y=torch.tensor(train_y, dtype=torch.int64),
        test_x=encode(test_tokens, vocab, params.max_len, params.truncation),
        test_y=torch.tensor(test_y, dtype=torch.int64),
        class_names=list(CLASS_NAMES),
    )
