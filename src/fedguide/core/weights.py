"""Models as flat float32 vectors: aggregation, communication and checkpoints all work on these."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightLayout:
    """Names, shapes and dtypes of a model's state (parameters and buffers), in state_dict order."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "WeightLayout":
        sd = model.state_dict()
        return cls(tuple(sd), tuple(t.shape for t in sd.values()), tuple(t.dtype for t in sd.values()))

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    def flatten(self, model: nn.Module) -> torch.Tensor:
        sd = model.state_dict()
        return torch.cat([sd[n].detach().reshape(-1).to(torch.float32) for n in self.names])

    def load(self, model: nn.Module, vector: torch.Tensor) -> None:
        """Copy a flat vector into the model in place (integer buffers are rounded back)."""
        if vector.numel() != self.numel:
            raise ValueError(f"weight vector has {vector.numel()} values, the model needs {self.numel}")
        sd = model.state_dict()
        offset = 0
        with torch.no_grad():
            for name, shape, dtype in zip(self.names, self.shapes, self.dtypes):
                n = int(torch.Size(shape).numel())
                chunk = vector[offset: offset + n].view(shape)
                sd[name].copy_(chunk if dtype.is_floating_point else chunk.round().to(dtype))
                offset += n

    def parameter_mask(self, model: nn.Module) -> torch.Tensor:
        """True where the flat vector holds a trainable parameter (not a buffer such as BN statistics)."""
        params = {n for n, _ in model.named_parameters()}
        return torch.cat([
            torch.full((int(torch.Size(s).numel()),), n in params, dtype=torch.bool)
            for n, s in zip(self.names, self.shapes)
        ])

    def span(self, prefix: str) -> slice:
        """The contiguous range of the flat vector holding the entries under ``prefix`` (e.g. 'head.')."""
        offset, start, stop = 0, None, None
        for name, shape in zip(self.names, self.shapes):
            n = int(torch.Size(shape).numel())
            if name.startswith(prefix):
                if stop is not None and start is not None and offset != stop:
                    raise ValueError(f"entries under '{prefix}' are not contiguous in the weight vector")
                start = offset if start is None else start
                stop = offset + n
            offset += n
        if start is None:
            raise ValueError(f"no weights under '{prefix}'; names start with {sorted({n.split('.')[0] for n in self.names})}")
        return slice(start, stop)
