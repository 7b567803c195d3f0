"""The run's training and test tensors where it computes (``data.on_device``), and batches gathered there.

On a GPU the tensors are moved once per process, so a round copies no data from the host, only each
epoch's index order (8 bytes a sample). Images of an 8-bit source travel as uint8 (a quarter of the
float32 size: CIFAR-10's 50 000 training images are 150 MB) and are standardised per batch with the
source's own function, so a batch holds the same float values as the host tensors; a source whose
floats do not come back exactly from 8 bits (or has no declared pixel statistics) stays float32.

On the CPU the host tensors are the device tensors: nothing is copied or re-encoded, and batches are
the plain gathers they always were.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from fedguide.core.device import computes_on_host
from fedguide.data.sources._images import normalise
from fedguide.data.sources.base import DatasetSplits
from fedguide.registry import ConfigError

# Memory held back on a GPU for the model, activations and the allocator's slack when data.on_device: auto
# decides whether the tensors fit.
HEADROOM = 0.5


def as_uint8(x: torch.Tensor, pixel_stats) -> Optional[torch.Tensor]:
    """``x`` as the uint8 images it was standardised from, or None when that does not give back ``x``
    exactly (a source that is not 8-bit, or that standardised otherwise)."""
    if pixel_stats is None or not x.dtype.is_floating_point or x.dim() != 4:
        return None
    mean, std = (torch.as_tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in pixel_stats)
    out = torch.empty(x.shape, dtype=torch.uint8)
    for start in range(0, len(x), 4096):  # in slices: no float copy of the whole set beside the original
        part = x[start:start + 4096]
        u = (part * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        if not torch.equal(normalise(u, *pixel_stats), part):
            return None
        out[start:start + 4096] = u
    return out


@dataclass
class Stored:
    """One split as kept (uint8 images where that is exact, else the source's tensor)."""

    values: torch.Tensor
    uint8: bool = False

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


def _store(x: torch.Tensor, pixel_stats, device: torch.device, encode: bool) -> Stored:
    if not encode:
        return Stored(x.to(device))
    u = as_uint8(x, pixel_stats)
    return Stored(x.to(device)) if u is None else Stored(u.to(device), uint8=True)


def bytes_needed(splits: DatasetSplits) -> int:
    """Device bytes the training and test tensors take, uint8 where the source is 8-bit."""
    def size(x: torch.Tensor) -> int:
        per = 1 if (splits.pixel_stats is not None and x.dtype.is_floating_point and x.dim() == 4) else x.element_size()
        return x.numel() * per
    return size(splits.train_x) + size(splits.test_x) + 8 * (len(splits.train_y) + len(splits.test_y))


# A client-side process (a pool worker, a Flower actor) keeps the data where the server process decided, for all
# of them at once: "1" on the device, "0" on the host (fl/engine.py sets it while the run's processes start).
SHARED_DECISION = "FEDGUIDE_DATA_ON_DEVICE"


def decide_on_device(need: int, free: Optional[int], on_device: Union[str, bool], device: torch.device,
                     copies: int = 1) -> bool:
    """Whether ``copies`` processes each keep ``need`` bytes of data on ``device`` with ``free`` bytes there
    (None: not measured, e.g. the host), per ``data.on_device``; true that cannot fit is a sentence."""
    total = need * copies
    held = f" for {copies} processes" if copies > 1 else ""
    if on_device is True and free is not None and total > free:
        raise ConfigError(f"data.on_device: true needs {total / 2**30:.2f} GiB on {device}{held} for the training "
                          f"and test tensors, but {free / 2**30:.2f} GiB are free; write data.on_device: auto (kept "
                          "on the host when it does not fit) or false, lower data.fraction"
                          + (", or run fewer processes (runtime.workers)" if copies > 1 else ""))
    return on_device is True or (on_device == "auto" and (free is None or total <= HEADROOM * free))


class DeviceData:
    """The training and test inputs and labels on ``device`` (or on the host, gathered there), and the
    batches the training loop and the evaluation take from them."""

    def __init__(self, splits: DatasetSplits, device: torch.device, on_device: Union[str, bool] = "auto",
                 free_bytes: Optional[Callable[[torch.device], Optional[int]]] = None,
                 augment: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, encode: Optional[bool] = None):
        """``encode``: keep 8-bit images as uint8 (None: where the tensors are moved off the host)."""
        self.device, self.augment = device, augment
        free = free_bytes(device) if free_bytes is not None and not computes_on_host(device) else None
        self.on_device = computes_on_host(device) or decide_on_device(bytes_needed(splits), free, on_device, device)
        where = device if self.on_device else torch.device("cpu")
        encode = not computes_on_host(device) if encode is None else encode
        self.train = _store(splits.train_x, splits.pixel_stats, where, encode)
        self.test = _store(splits.test_x, splits.pixel_stats, where, encode)
        # Data too large for a GPU stays on the host as uint8, and each batch is gathered into page-locked memory,
        # from which the copy to the device runs asynchronously (the pinned block is reused once it is done).
        self.staged = not self.on_device and device.type == "cuda"
        self.train_y = splits.train_y.to(where)
        self.test_y = splits.test_y.to(where)
        if splits.pixel_stats is not None:  # the source's statistics as float32 on the computing device
            self._mean, self._std = (torch.as_tensor(v, dtype=torch.float32).view(-1, 1, 1).to(device)
                                     for v in splits.pixel_stats)

    def _standardise(self, unit: torch.Tensor) -> torch.Tensor:
        return unit.sub_(self._mean).div_(self._std)

    def _input(self, raw: torch.Tensor, uint8: bool, augment) -> torch.Tensor:
        """Stored values (already on the device) -> standardised model input, augmented if asked."""
        if augment is None:
            # The steps of the sources' ``normalise``, in its order: the same float32 values, bit for bit.
            return self._standardise(raw.to(torch.float32).div_(255.0)) if uint8 else raw
        unit = raw.to(torch.float32).div_(255.0) if uint8 else raw * self._std + self._mean
        return self._standardise(augment(unit))

    def indices(self, idx: torch.Tensor) -> torch.Tensor:
        """Host indices where the tensors are kept (one copy per epoch, not per batch)."""
        return idx.to(self.train_y.device, non_blocking=True)

    def train_batch(self, idx: torch.Tensor, augment: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the training samples ``idx`` (indices where the tensors are kept), on the
        run's device, augmented with ``train.augment`` unless ``augment=False``."""
        raw = self._gather(self.train.values, idx).to(self.device, non_blocking=True)
        return (self._input(raw, self.train.uint8, self.augment if augment else None),
                self.train_y[idx].to(self.device, non_blocking=True))

    def _gather(self, values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if not self.staged:
            return values[idx]
        out = torch.empty((len(idx), *values.shape[1:]), dtype=values.dtype, pin_memory=True)
        return torch.index_select(values, 0, idx, out=out)

    def test_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = self.test.values[start:stop].to(self.device, non_blocking=True)
        return self._input(raw, self.test.uint8, None), self.test_y[start:stop].to(self.device, non_blocking=True)

    def test_batch_at(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the test samples ``idx`` (host indices), e.g. one client's test split."""
        idx = idx.to(self.test_y.device, non_blocking=True)
        raw = self.test.values[idx].to(self.device, non_blocking=True)
        return self._input(raw, self.test.uint8, None), self.test_y[idx].to(self.device, non_blocking=True)
