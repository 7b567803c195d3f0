"""What every dataset source yields: in-memory tensors, ready for batching by index."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict

from fedguide.registry import ConfigError, Registry


@dataclass
class DatasetSplits:
    """Inputs and int64 labels, held in memory for the whole run.

    Images are normalised float32 [N, C, H, W]; text is int64 token ids [N, L] (0 = padding).
    A source with domains (Digits, Office-Caltech, DomainNet, ...) also gives every train and test
    sample an int64 domain id indexing ``domain_names``.

    A source whose samples each have a natural owner (FEMNIST: the writer) gives every training sample an
    int64 group id indexing ``group_names`` (``train_groups``), and the test samples theirs where they have
    one (``test_groups``; a test-only writer is a group with no training sample). Group ids follow the
    order of ``group_names``, which is the order the ``natural`` partition hands groups out in.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]
    train_domains: Optional[torch.Tensor] = None
    test_domains: Optional[torch.Tensor] = None
    domain_names: Optional[list[str]] = None
    train_groups: Optional[torch.Tensor] = None
    test_groups: Optional[torch.Tensor] = None
    group_names: Optional[list[str]] = None
    # The per-channel (or scalar) mean and std the images were standardised with, so frozen image models
    # (guidance) can see the pixels again; None where a source does not declare them.
    pixel_stats: Optional[tuple[Any, Any]] = None

    def __post_init__(self) -> None:
        has = [self.train_domains is not None, self.test_domains is not None, self.domain_names is not None]
        if any(has) and not all(has):
            raise ValueError("train_domains, test_domains and domain_names come together or not at all")
        if (self.train_groups is None) != (self.group_names is None) or (
                self.test_groups is not None and self.group_names is None):
            raise ValueError("train_groups and group_names come together (test_groups only with them)")
        for name, ids, n in (("train_groups", self.train_groups, len(self.train_y)),
                             ("test_groups", self.test_groups, len(self.test_y))):
            if ids is not None and (ids.dtype != torch.int64 or ids.shape != (n,)):
                raise ValueError(f"{name} must be int64 of shape ({n},), got {ids.dtype} {tuple(ids.shape)}")

    def owner_groups(self, indices: Any = None) -> tuple[Optional[Any], Optional[list[str]]]:
        """The training samples' group ids (numpy int64, at ``indices`` when given) and the group names: the
        source's groups, else its domains (a domain is a group where a dataset has no finer one), else
        (None, None)."""
        ids, names = ((self.train_groups, self.group_names) if self.train_groups is not None
                      else (self.train_domains, self.domain_names))
        if ids is None:
            return None, None
        ids = ids.numpy()
        return (ids if indices is None else ids[indices]), names

    def unit_images(self, x: torch.Tensor) -> torch.Tensor:
        """Standardised images back to [0, 1] (what image models expect before their own preprocessing)."""
        if self.pixel_stats is None:
            raise ConfigError("this dataset source does not declare the pixel statistics it normalised with "
                              "(DatasetSplits.pixel_stats); set them in the source to use guidance models on it")
        mean, std = (torch.as_tensor(v, dtype=x.dtype).reshape(1, -1, 1, 1) for v in self.pixel_stats)
        return (x * std + mean).clamp(0, 1)

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


DATASETS: Registry = Registry("dataset", plugins=("fedguide.data.sources",))

