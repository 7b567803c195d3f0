"""Payloads and uploads (fedguide records) to and from Flower's records, exactly.

A record is a dict with string keys whose values are tensors, Python scalars (int, float, bool, str)
or nested records. It travels as two Flower records: an ArrayRecord with every tensor and a
ConfigRecord with every scalar, nested keys joined with "/".

Decisions where Flower is silent:
- Tensors travel as their raw bytes with torch's dtype name (stype ``fedguide.torch-raw``), not
  through numpy: bfloat16 and every other torch dtype then come back bit for bit, with their shape.
- A key containing "/" is refused (it would be read back as nesting); so is any other value type
  (lists, None, numpy arrays), with the key named, rather than arriving changed.
- numpy scalars (e.g. ``np.int64`` from a count) arrive as the Python int/float/bool they hold.
- Empty nested records have no leaf to carry them; their paths travel in one reserved ConfigRecord
  entry, so the nesting comes back as it left.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedguide.core.records import Record

SEP = "/"
STYPE = "fedguide.torch-raw"
EMPTY_KEY = "\x00empty-records"  # cannot clash: a record's own keys never start with NUL
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _flatten(record: Record, prefix: str, tensors: dict, scalars: dict, empty: list) -> None:
    if not record and prefix:
        empty.append(prefix[:-1])
    for key, value in record.items():
        if not isinstance(key, str) or SEP in key or key.startswith("\x00"):
            raise TypeError(f"record key {prefix + str(key)!r}: keys must be strings without '{SEP}' "
                            "to travel through Flower")
        path = prefix + key
        if isinstance(value, torch.Tensor):
            tensors[path] = value
        elif isinstance(value, dict):
            _flatten(value, path + SEP, tensors, scalars, empty)
        elif isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float, str)):
            scalars[path] = value.item()
        elif isinstance(value, (bool, int, float, str)):
            scalars[path] = value
        else:
            raise TypeError(f"record entry {path!r} is a {type(value).__name__}; records carry tensors, "
                            "int/float/bool/str scalars and nested dicts only")


def tensor_to_array(t: torch.Tensor):
    from flwr.app import Array

    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return Array(dtype=str(t.dtype), shape=tuple(t.shape), stype=STYPE, data=data)


def array_to_tensor(array) -> torch.Tensor:
    if array.stype != STYPE or array.dtype not in _DTYPES:
        raise ValueError(f"array of stype {array.stype!r}, dtype {array.dtype!r} was not written by fedguide")
    dtype, shape = _DTYPES[array.dtype], tuple(array.shape)
    if not array.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(array.data), dtype=dtype).reshape(shape)  # bytearray: a writable copy


def encode(record: Record):
    """(ArrayRecord, ConfigRecord) holding ``record``."""
    from flwr.app import ArrayRecord, ConfigRecord

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    empty: list[str] = []
    _flatten(record, "", tensors, scalars, empty)
    if empty:
        scalars[EMPTY_KEY] = empty
    return ArrayRecord({k: tensor_to_array(v) for k, v in tensors.items()}), ConfigRecord(scalars)


def _put(record: Record, path: str, value: Any) -> None:
    *parents, leaf = path.split(SEP)
    for p in parents:
        record = record.setdefault(p, {})
    record[leaf] = value


def decode(arrays, config) -> Record:
    """The record ``encode`` turned into (arrays, config)."""
    record: Record = {}
    for path in config.get(EMPTY_KEY, []):
        _put(record, path, {})
    for path, value in config.items():
        if path != EMPTY_KEY:
            _put(record, path, value)
    for path, array in arrays.items():
        _put(record, path, array_to_tensor(array))
    return record
