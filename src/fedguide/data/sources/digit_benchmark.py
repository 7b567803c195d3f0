"""The Digits multi-domain benchmark (MNIST, USPS, SVHN, SynthDigits, optionally MNIST-M) as one source.

Every domain is read by its own source's reader with the same data.root, so each is found in its own
sub-folder (``mnist/``, ``usps/``, ``svhn/``, ``SynthDigits/``, ``MNIST_M/``, ...) or wherever that
reader's search finds it; see those modules for the accepted files. Samples carry a domain id indexing
``domain_names`` (the domain names as configured, in the configured order).

Decisions:
- All domains become RGB (grey replicated to 3 channels) at ``image_size`` (32 by default: SVHN's and
  SynthDigits' native size), resized with bilinear interpolation, so one model sees one input shape.
- One common normalisation, mean 0.5 and std 0.5 per channel, as FedBN and its followers use: per-domain
  statistics would erase part of the feature shift the benchmark is about.
- Each domain keeps all of its train and test images; subsampling per client is the partition's job.
- Memory: 12 KB per image at 32x32 (float32), so ~2.2 GB for all of MNIST, USPS and SVHN alone.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator

from fedguide.data.sources._images import standardise_
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.data.sources.digit_files import read_mnistm, read_synthdigits
from fedguide.data.sources.mnist import read_mnist
from fedguide.data.sources.svhn import read_svhn
from fedguide.data.sources.usps import read_usps

READERS = {"mnist": read_mnist, "usps": read_usps, "svhn": read_svhn,
           "synthdigits": read_synthdigits, "mnistm": read_mnistm}
DEFAULT_DOMAINS = ("mnist", "usps", "svhn", "synthdigits")
MEAN, STD = 0.5, 0.5
CHUNK = 4096  # images converted at a time: bounds the float copy of the uint8 input
CLASS_NAMES = [str(d) for d in range(10)]


class DigitBenchmarkParams(SourceParams):
    domains: list[Literal["mnist", "usps", "svhn", "synthdigits", "mnistm"]] = Field(
        default_factory=lambda: list(DEFAULT_DOMAINS), min_length=1,
        description="which digit datasets form the domains, in domain-id order")
    image_size: int = Field(32, ge=8, le=256, description="side of the square RGB images every domain is resized to")

    @field_validator("domains")
    @classmethod
    def _each_once(cls, domains: list[str]) -> list[str]:
        if len(set(domains)) != len(domains):
            raise ValueError(f"each domain may appear once, got {domains}")
        return domains


def to_rgb_unit(images_uint8: torch.Tensor, size: int, out: torch.Tensor) -> None:
    """Write uint8 [N, 1 or 3, H, W] into ``out`` [N, 3, size, size] as float in [0, 1]."""
    for start in range(0, len(images_uint8), CHUNK):
        chunk = images_uint8[start:start + CHUNK].to(torch.float32).div_(255.0)
        if chunk.shape[-2:] != (size, size):
            chunk = F.interpolate(chunk, size=(size, size), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
        out[start:start + len(chunk)] = chunk.expand(-1, 3, -1, -1)  # grey: one channel broadcast to three


def combine(parts: list[torch.Tensor], size: int) -> torch.Tensor:
    """Per-domain uint8 images -> one normalised float32 [sum N, 3, size, size], filled in place."""
    out = torch.empty((sum(len(p) for p in parts), 3, size, size), dtype=torch.float32)
    start = 0
    for part in parts:
        to_rgb_unit(part, size, out[start:start + len(part)])
        start += len(part)
    return standardise_(out, MEAN, STD)


def domain_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])


@DATASETS.register("digit_benchmark", params=DigitBenchmarkParams,
                   summary="Digits domains (MNIST, USPS, SVHN, SynthDigits[, MNIST-M]) as RGB 32x32, with domain ids")
def load_digit_benchmark(params: DigitBenchmarkParams) -> DatasetSplits:
    raws = [READERS[name](params.root) for name in params.domains]
    return DatasetSplits(
        train_x=combine([r.train_x for r in raws], params.image_size),
        train_y=torch.cat([r.train_y for r in raws]),
        test_x=combine([r.test_x for r in raws], params.image_size),
        test_y=torch.cat([r.test_y for r in raws]),
        class_names=list(CLASS_NAMES),
        train_domains=domain_ids([len(r.train_y) for r in raws]),
        test_domains=domain_ids([len(r.test_y) for r in raws]),
        domain_names=list(params.domains),
        pixel_stats=(MEAN, STD),
    )
