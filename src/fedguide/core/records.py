"""The plain record every payload and upload is: a dict of tensors and scalars, the same in-process and
on the wire."""
from __future__ import annotations

from typing import Any

import torch

Record = dict[str, Any]


def record_bytes(record: Record) -> int:
    """Bytes a record occupies on the wire: tensor payloads, plus 8 bytes per scalar."""
    total = 0
    for v in record.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            total += record_bytes(v)
        else:
            total += 8
    return total
