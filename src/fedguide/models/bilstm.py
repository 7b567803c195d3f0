"""A bidirectional-LSTM text classifier over token ids [N, L] (int64, 0 = padding); d = 2 x hidden.

Encoder: token embedding (vocabulary ``spec.vocab_size``, row 0 = padding, kept at zero), a
bidirectional LSTM, and the mean of its outputs (both directions concatenated) over the
non-padding positions as z; the head is the linear classification layer.

Decisions:
- Padding is ignored wherever it sits: each row's tokens are moved to the front (their order kept)
  and packed with their length, so neither direction of the LSTM ever reads a padding position,
  and appending, prepending or interleaving padding does not change z.
- A row of padding only has z = 0 (no token to average).
- Token ids outside [0, vocab_size) are refused with the fix rather than failing inside the
  embedding lookup.
- The whole text encoder is one module: models/taps.py sees one level (z).
"""
from __future__ import annotations

import torch
from pydantic import Field
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from fedguide.models.registry import MODELS, ModelSpec
from fedguide.models.split import HeadParams, SplitModel, assemble
from fedguide.registry import ConfigError

PADDING_ID = 0


class MaskedBiLSTM(nn.Module):
    """Token ids [N, L] -> mean of the BiLSTM outputs over each row's non-padding positions, [N, 2 x hidden]."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, layers: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PADDING_ID)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True, bidirectional=True)

    def _check(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"model 'bilstm' takes integer token ids of shape [N, L]; got {ids.dtype} "
                             f"{tuple(ids.shape)} — give it a text dataset's token ids")
        if ids.numel():
            low, high = torch.stack([ids.min(), ids.max()]).tolist()
            if low < 0 or high >= self.vocab_size:
                raise ConfigError(f"token id {low if low < 0 else high} is outside the vocabulary [0, "
                                  f"{self.vocab_size}) — the model spec's vocab_size must exceed every id "
                                  "the data holds")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check(ids)
        is_token = ids != PADDING_ID
        lengths = is_token.sum(1)
        # A stable sort on "is padding" moves each row's tokens to the front in their original order.
        front = torch.sort((~is_token).to(torch.uint8), dim=1, stable=True).indices
        embedded = self.embedding(ids.gather(1, front))
        # Packing needs a length >= 1: an all-padding row reads its first (padding) position, zeroed below.
        packed = pack_padded_sequence(embedded, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
        outputs, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True)  # zeros past each length
        summed = outputs.sum(1) * (lengths > 0).unsqueeze(1)
        return summed / lengths.clamp(min=1).unsqueeze(1).to(summed.dtype)


class BiLSTMParams(HeadParams):
    embed_dim: int = Field(128, ge=1, description="token embedding size")
    hidden: int = Field(128, ge=1, description="LSTM units per direction (d = 2 x hidden)")
    layers: int = Field(1, ge=1, description="stacked bidirectional LSTM layers")


@MODELS.register("bilstm", params=BiLSTMParams,
                 summary="token embedding + bidirectional LSTM + masked mean pooling (d=2*hidden), for token ids")
def build_bilstm(params: BiLSTMParams, spec: ModelSpec) -> SplitModel:
    if spec.vocab_size <= 0:
        raise ConfigError(f"model 'bilstm' reads token ids, but the data has no vocabulary (vocab_size "
                          f"{spec.vocab_size}, input shape {tuple(spec.input_shape)}) — use a text dataset, "
                          "or an image model such as cnn or resnet18")
    encoder = nn.Sequential(MaskedBiLSTM(spec.vocab_size, params.embed_dim, params.hidden, params.layers))
    return assemble(encoder, 2 * params.hidden, spec.num_classes, params)
