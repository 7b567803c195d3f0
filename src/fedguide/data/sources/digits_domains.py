"""Embedded multi-domain digits: an offline stand-in for the Digits domain-shift benchmark.

The Digits benchmark (MNIST, USPS, SVHN, SynthDigits, MNIST-M) needs downloads; this source builds three
domains with the same kinds of shift from assets installed with the project's dependencies, at load
time, in a couple of seconds, and caches nothing. Every image is RGB uint8 [3, S, S] (S = image_size)
before normalisation; classes are "0".."9"; each sample carries a domain id indexing
``DOMAIN_NAMES = ["uci", "fonts", "mnistm_like"]``.

uci (real handwriting, the MNIST/USPS role)
    scikit-learn's UCI handwritten digits (``load_digits``: 1797 images, 8x8, values 0..16), white on
    black, upscaled bilinearly into a centred box of round(S*20/28) pixels (MNIST's digit-to-frame
    ratio), grey copied to three channels. Its size is what it is; ``per_class`` does not apply.

fonts (printed digits, the SynthDigits role)
    ``per_class`` images per class. Each draws uniformly one of 21 TrueType fonts bundled with
    matplotlib (mpl-data/fonts/ttf: 12 DejaVu Sans/Sans Mono/Serif weights and slants, 4 STIX General,
    5 Computer Modern), rendered once per digit with PIL and cropped to its ink; then per image:
    digit height U(0.55, 0.85) of the side, rotation U(-15, 15) degrees, horizontal shear U(-0.2, 0.2),
    centre offset U(-0.1, 0.1) of the side on each axis; background colour uniform in RGB, ink colour
    uniform in RGB redrawn until its luma differs from the background's by at least 80/255; with
    probability 0.3 an outline (about 7 % of the digit's height wide) in a third uniform colour;
    Gaussian blur of sigma 0, 0.5 or 1 pixel (uniform); additive Gaussian noise of std U(0, 8)/255.
    SynthDigits' neighbouring distractor digits are left out: one centred digit per image.

mnistm_like (digits over photos, the MNIST-M role)
    ``per_class`` images per class, made by MNIST-M's recipe |crop - digit| per channel from the uci
    domain's images and random crops of the colour photos shipped inside the scikit-image wheel
    (astronaut, chelsea, coffee, rocket, immunohistochemistry, the left stereo_motorcycle view; none is
    fetched from the network). Photo uniform; square crop side U(1, 4) * S photo pixels (capped at the
    photo), uniformly placed, flipped left-right and up-down with probability 1/2 each, resized
    bilinearly to S. As in MNIST-M, train images use only uci-train digits and test images only uci-test
    digits, so no handwritten digit appears on both sides of a split; each class's digits are taken in
    a random order, cycled when more are needed than exist.

Split: per domain and per class, round(count * test_fraction) images go to test, the rest to train,
chosen by a seeded permutation (stratified, every class on both sides). Train and test are ordered
domain by domain, shuffled within each domain.

Seeds: every draw comes from ``generation_seed`` (default 0), independent of the run's seed, so every
run of every seed trains and evaluates on the same images; a different generation_seed gives different
synthetic images and a different uci split. Each domain's renderer and split use their own numpy
streams ``default_rng([generation_seed, stream])``, so changing one domain's recipe leaves the others'
images unchanged. Generating twice gives identical tensors (torch CPU resampling is deterministic; PIL
glyph rasters may differ by a grey level across FreeType versions).

Normalisation: one scalar mean and std over all domains and channels, fixed constants (MEAN, STD)
computed once from the train split at the default parameters and written below, so every image_size,
per_class and generation_seed shares one normalisation and no statistic is taken from test images.
Per-domain differences in brightness and colour are kept on purpose: they are the shift under study.
"""
from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedguide.data.sources import _digit_render as render
from fedguide.data.sources._images import normalise
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.registry import ConfigError

DOMAIN_NAMES = ["uci", "fonts", "mnistm_like"]
CLASS_NAMES = [str(d) for d in range(10)]
MEAN, STD = 0.3508, 0.3062  # see the module docstring: train split of the default parameters, all channels

# numpy stream ids under generation_seed: fixed, so one domain's draws never shift another's
UCI_SPLIT, FONTS_SPLIT, FONTS_RENDER, MNISTM_SPLIT, MNISTM_RENDER = range(5)


class DigitsDomainsParams(SourceParams):
    image_size: int = Field(32, ge=8, le=128, description="side S of every square RGB image, in pixels")
    per_class: int = Field(
        180, ge=2, description="images per class in each synthetic domain (fonts, mnistm_like); uci has its 1797"
    )
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of each class in each domain held out for test"
    )
    generation_seed: int = Field(
        0, ge=0, description="seed of the images and splits, apart from the run seed: every run sees the same data"
    )


def stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test), each shuffled: round(count * test_fraction) of every class go to test."""
    train, test = [], []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_test = round(len(members) * test_fraction)
        if n_test < 1 or n_test > len(members) - 1:
            raise ConfigError(
                f"test_fraction {test_fraction} leaves class {c} ({len(members)} images) without train or test "
                "images; choose a test_fraction nearer 0.5 or a larger per_class"
            )
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _cycled(pool: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n items of ``pool`` in a random order, each used once before any is used again."""
    return np.resize(rng.permutation(pool), n)


def build_domains(params: DigitsDomainsParams) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per domain (train uint8 images, train labels, test uint8 images, test labels), in DOMAIN_NAMES order."""
    size, seed = params.image_size, params.generation_seed
    synthetic_labels = np.repeat(np.arange(10), params.per_class)

    uci_x, uci_y = render.uci_images(size)
    uci_train, uci_test = stratified_split(uci_y, params.test_fraction, _rng(seed, UCI_SPLIT))

    fonts_x = render.render_fonts(synthetic_labels, size, _rng(seed, FONTS_RENDER))
    fonts_train, fonts_test = stratified_split(synthetic_labels, params.test_fraction, _rng(seed, FONTS_SPLIT))

    # mnistm_like's split is drawn first, then each side's digits come only from the same uci side.
    m_train, m_test = stratified_split(synthetic_labels, params.test_fraction, _rng(seed, MNISTM_SPLIT))
    draw = _rng(seed, MNISTM_RENDER)
    digit_of = np.empty(len(synthetic_labels), dtype=np.int64)
    for side, pool in ((m_train, uci_train), (m_test, uci_test)):
        for c in range(10):
            rows = side[synthetic_labels[side] == c]
            digit_of[rows] = _cycled(pool[uci_y[pool] == c], len(rows), draw)
    mnistm_x = render.render_mnistm(uci_x[torch.from_numpy(digit_of)], draw)

    def pick(x, y, idx_train, idx_test):
        tr, te = torch.from_numpy(idx_train), torch.from_numpy(idx_test)
        y = torch.from_numpy(np.asarray(y, dtype=np.int64))
        return x[tr], y[tr], x[te], y[te]

    return {
        "uci": pick(uci_x, uci_y, uci_train, uci_test),
        "fonts": pick(fonts_x, synthetic_labels, fonts_train, fonts_test),
        "mnistm_like": pick(mnistm_x, synthetic_labels, m_train, m_test),
    }


@DATASETS.register(
    "digits_domains",
    params=DigitsDomainsParams,
    summary="offline Digits domain shift: UCI handwriting, font renders, MNIST-M-like photo blends (RGB, 10 classes)",
)
def load_digits_domains(params: DigitsDomainsParams) -> DatasetSplits:
    domains = build_domains(params)
    parts = [domains[name] for name in DOMAIN_NAMES]

    def ids(position: int) -> torch.Tensor:
        return torch.cat([torch.full((len(p[position]),), d, dtype=torch.int64) for d, p in enumerate(parts)])

    return DatasetSplits(
        train_x=normalise(torch.cat([p[0] for p in parts]), MEAN, STD),
        train_y=torch.cat([p[1] for p in parts]),
        test_x=normalise(torch.cat([p[2] for p in parts]), MEAN, STD),
        test_y=torch.cat([p[3] for p in parts]),
        class_names=list(CLASS_NAMES),
        train_domains=ids(1),
        test_domains=ids(3),
        domain_names=list(DOMAIN_NAMES),
        pixel_stats=(MEAN, STD),
    )


def preview_grid(splits: DatasetSplits, path, per_class: int = 1, scale: int = 2, train: bool = False) -> None:
    """Write a PNG contact sheet: one row block per domain, one column per class, ``per_class`` rows each.

    For looking at the data; nothing calls it during training.
    """
    from PIL import Image

    if train:
        x, y, d = splits.train_x, splits.train_y, splits.train_domains
    else:
        x, y, d = splits.test_x, splits.test_y, splits.test_domains
    if d is None:
        raise ConfigError("preview_grid needs a source with domains")
    rows = []
    for domain in range(len(splits.domain_names)):
        for k in range(per_class):
            tiles = []
            for c in range(splits.num_classes):
                hits = torch.nonzero((y == c) & (d == domain)).flatten()
                tiles.append(x[hits[k]] if k < len(hits) else torch.full_like(x[0], -MEAN / STD))  # black
            rows.append(torch.cat(tiles, dim=2))
    sheet = torch.cat(rows, dim=1).mul(STD).add(MEAN).clamp(0, 1).mul(255).round().to(torch.uint8)
    image = Image.fromarray(sheet.permute(1, 2, 0).numpy())
    image.resize((image.width * scale, image.height * scale), Image.NEAREST).save(path)
