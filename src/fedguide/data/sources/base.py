"""What every dataset source yields: in-memory tensors, ready for batching by index."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from pydantic import BaseModel, ConfigDict

from fedguide.registry import Registry


@dataclass
class DatasetSplits:
    """Inputs and int64 labels, held in memory for the whole run.

    Images are normalised float32 [N, C, H, W]; text is int64 token ids [N, L] (0 = padding).
    A source with domains (Digits, Office-Caltech, DomainNet, ...) also gives every train and test
    sample an int64 domain id indexing ``domain_names``.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]
    train_domains: Optional[torch.Tensor] = None
    test_domains: Optional[torch.Tensor] = None
    domain_names: Optional[list[str]] = None

    def __post_init__(self) -> None:
        has = [self.train_domains is not None, self.test_domains is not None, self.domain_names is not None]
        if any(has) and not all(has):
            raise ValueError("train_domains, test_domains and domain_names come together or not at all")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size) for text; 0 for images."""
        if self.train_x.dtype.is_floating_point:
            return 0
        return int(max(self.train_x.max(), self.test_x.max())) + 1

    def model_spec(self):
        from fedguide.models.registry import ModelSpec

        return ModelSpec(self.input_shape, self.num_classes, self.vocab_size)


class SourceParams(BaseModel):
    """Keys of the ``data`` section that every source understands (a source may add its own)."""

    model_config = ConfigDict(extra="forbid")
    root: Optional[str] = None


DATASETS: Registry = Registry("dataset")

