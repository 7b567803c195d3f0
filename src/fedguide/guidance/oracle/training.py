"""The oracle's seeded fit on its pool: a tenth held out (stratified), AdamW with a cosine schedule over
``steps`` mini-batches, random translations of a few pixels, then accuracies and class prototypes.

Deterministic on the CPU: the weights are drawn from a forked, seeded torch stream (the caller's global
stream is left as it was), batches and shifts from a seeded generator, and training always runs on the
CPU whatever device the oracle then serves on, on one thread: reductions split over threads round
differently, so a run of another thread count would train other weights under the same cache key, and a
second thread bought little on a shared machine (measured on two busy cores: Fashion-MNIST's pool in 31 s
on one thread, 222 s on two). Steps: ``epochs`` passes over the training part, at least
``min_steps`` (a pool of a few hundred images still gets a few hundred steps).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.guidance.oracle.network import OracleNet
from fedguide.registry import ConfigError

EVAL_BATCH = 512
# The oracle's own streams, apart from the run's (core/seeding.py): each a SeedSequence of (seed, tag).
HOLDOUT, WEIGHTS, BATCHES = 0x0A01, 0x0A02, 0x0A03


def stream_seed(seed: int, tag: int) -> int:
    return int(np.random.SeedSequence([seed, tag]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class OracleSettings:
    seed: int = 0
    width: int = 512  # penultimate units: at least half of z's dims, so FedDifRC's first fused layer fits
    channels: tuple[int, ...] = (16, 32, 64)
    epochs: int = 8
    min_steps: int = 300
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-4
    shift: int = 2  # pixels of random translation, per batch
    holdout_fraction: float = 0.1

    def as_dict(self) -> dict:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d


@dataclass
class TrainedOracle:
    net: OracleNet  # eval mode, frozen, on the CPU
    prototypes: torch.Tensor  # [C, width] mean features of each class over the whole pool (zeros: no image)
    report: dict  # steps, images, accuracies, seconds


def holdout_positions(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Positions (into the pool) held out from training: round-half-up(fraction x count) of each class, a class
    keeping at least one training image."""
    from fedguide.data.federated import validation_part

    if fraction <= 0:
        return np.empty(0, np.int64)
    return validation_part(labels, fraction, np.random.default_rng(stream_seed(seed, HOLDOUT)))


@torch.no_grad()
def pool_features(net: OracleNet, images: torch.Tensor) -> torch.Tensor:
    """Penultimate features [N, width] of images in ``oracle_input`` form (eval mode)."""
    net.eval()
    parts = [net.features(images[s: s + EVAL_BATCH]) for s in range(0, len(images), EVAL_BATCH)]
    return torch.cat(parts) if parts else torch.empty(0, net.width)


def _accuracy(net: OracleNet, features: torch.Tensor, labels: torch.Tensor) -> Optional[float]:
    if len(labels) == 0:
        return None
    with torch.no_grad():
        return round(float((net.head(features).argmax(1) == labels).float().mean()), 4)


def _shifted(x: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    if shift <= 0:
        return x
    dy, dx = (int(v) for v in torch.randint(0, 2 * shift + 1, (2,), generator=generator))
    padded = F.pad(x, (shift, shift, shift, shift), mode="replicate")
    return padded[..., dy: dy + x.shape[-2], dx: dx + x.shape[-1]]


def train_oracle(images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                 settings: OracleSettings = OracleSettings()) -> TrainedOracle:
    """The oracle fitted on ``images`` ([N, 3, 32, 32], ``oracle_input`` form) and ``labels`` [N], on one CPU
    thread (the caller's thread count is restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(images, labels, num_classes, settings)
    finally:
        torch.set_num_threads(threads)


def _train(images: torch.Tensor, labels: torch.Tensor, num_classes: int, settings: OracleSettings) -> TrainedOracle:
    if len(images) != len(labels) or len(images) < 2:
        raise ConfigError(f"the oracle needs at least 2 labeled pool images, got {len(images)} images and "
                          f"{len(labels)} labels")
    t0 = time.perf_counter()
    images, labels = images.float().cpu(), labels.long().cpu()
    held = holdout_positions(labels.numpy(), settings.holdout_fraction, settings.seed)
    fit = np.setdiff1d(np.arange(len(labels)), held)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(settings.seed, WEIGHTS))
        net = OracleNet(num_classes, settings.width, tuple(settings.channels))
    generator = torch.Generator().manual_seed(stream_seed(settings.seed, BATCHES))
    batch = min(settings.batch_size, len(fit))
    steps = max(settings.min_steps, math.ceil(settings.epochs * len(fit) / batch))
    optimizer = torch.optim.AdamW(net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    fit_t = torch.from_numpy(fit)
    order, used = fit_t[:0], 0
    net.train()
    for _ in range(steps):
        if used + batch > len(order):  # a fresh pass in a seeded order
            order, used = fit_t[torch.randperm(len(fit_t), generator=generator)], 0
        idx = order[used: used + batch]
        used += batch
        loss = F.cross_entropy(net(_shifted(images[idx], settings.shift, generator)), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    net.eval().requires_grad_(False)
    features = pool_features(net, images)
    sums = torch.zeros(num_classes, net.width, dtype=torch.float64).index_add_(0, labels, features.double())
    counts = torch.bincount(labels, minlength=num_classes).clamp_min(1).unsqueeze(1)
    held_t = torch.from_numpy(held)
    report = {"steps": steps, "train_images": int(len(fit)), "holdout_images": int(len(held)),
              "pool_accuracy": _accuracy(net, features[fit_t], labels[fit_t]),
              "holdout_accuracy": _accuracy(net, features[held_t], labels[held_t]),
              "final_loss": round(float(loss.detach()), 5), "train_seconds": round(time.perf_counter() - t0, 3)}
    return TrainedOracle(net, (sums / counts).float(), report)
