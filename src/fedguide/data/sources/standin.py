"""Stand-in data of a paper dataset's shape: its channels, image size, split sizes, classes and domains,
with drawn images instead of the real ones, for cost projections where the data is not at hand.

``data: {name: standin, like: cifar100}`` gives 50 000 + 10 000 RGB 32x32 images of 100 classes; every
key of SHAPES below can be named, and each number overridden (train_size, test_size, num_classes,
image_size, channels, domains, max_train_per_class, vocab_size, max_len); ``scale`` shrinks both splits
at once, so a CPU can time a few rounds of a paper config at a fraction of its size.

Decisions:
- Images are procedurally drawn, cheap and class-dependent: every class owns a random 4x4 colour grid,
  a sample is its class's grid blended with up to half of another class's (a seeded random share),
  upsampled (bicubic) to the image size, tinted by its domain (a per-channel gain and offset), plus
  uniform per-pixel noise (``noise``), and quantised to uint8 like the real 8-bit sources. A model learns
  the classes (nearest class mean is far above chance), the task is not solved by one pixel, and
  generating CIFAR-10's 60 000 images takes a few seconds on two cores.
- Normalised with the real source's mean and std (``pixel_stats`` declared), so the data looks to the
  model, the device layer (uint8 on a GPU) and the guidance models exactly as a real source's does.
- Sizes: the table's split sizes, scaled by the share of classes kept (num_classes) and summed over the
  chosen domains; ``max_train_per_class`` caps a domain's training images at cap x classes;
  ``train_size`` / ``test_size`` set the totals, shared out over the domains in proportion; ``scale``
  multiplies last. Every domain keeps at least one image of every class in each split, and labels are
  balanced within a domain (the real datasets are roughly balanced; HAM10000 is not).
- Token data (``like: imdb``): reviews of seeded random lengths (half to all of ``max_len``) of log-uniform
  word ids (frequent words first, as a frequency-ranked vocabulary has them), a share of them swapped for
  the class's own words, padded with 0. The last id occurs at least once, so a model sizes its embedding
  table from the data as it does for the real vocabulary.
- Everything is drawn from generators seeded by (generation_seed, split, domain): the same parameters
  give the same tensors, and the training images do not change with test_size.
- Where the table's numbers come from is noted per entry. NICO++, OpenImage and SynthDigits sizes are
  approximate (see their notes); the rest are the datasets' official sizes or fedguide's split of them
  (test_fraction 0.2 where there is no official split).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedguide.data.sources._images import RawImages, to_splits
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams
from fedguide.registry import ConfigError

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
DIGITS = [str(d) for d in range(10)]
GRID = 4  # side of a class's colour grid before upsampling
CHUNK_ELEMENTS = 1 << 24  # floats drawn at a time: bounds the float copy beside the uint8 result


@dataclass(frozen=True)
class Shape:
    """One dataset as fedguide loads it: ``domains`` maps a domain (None: the dataset has none) to its
    (train, test) sizes; ``channels`` 0 marks token data, whose ``size`` is max_len."""

    channels: int
    size: int
    classes: int
    domains: dict[Optional[str], tuple[int, int]]
    stats: tuple[Any, Any] = HALF
    note: str = ""
    vocab_size: int = 0
    class_names: Optional[tuple[str, ...]] = None

    @property
    def has_domains(self) -> bool:
        return None not in self.domains


def one(train: int, test: int) -> dict[Optional[str], tuple[int, int]]:
    return {None: (train, test)}


def split(total: int, fraction: float = 0.2) -> tuple[int, int]:
    """(train, test) of fedguide's seeded split of a dataset without an official one."""
    test = round(total * fraction)
    return total - test, test


DIGIT_DOMAINS = {"mnist": (60000, 10000), "usps": (7291, 2007), "svhn": (73257, 26032),
                 "synthdigits": (479400, 9553), "mnistm": (59001, 9001)}
OPENIMAGE_TEST = (6856, 8025, 6761, 6179, 6397, 7318)  # FedCADO Table 6, client0..client5
SHAPES: dict[str, Shape] = {
    "mnist": Shape(1, 28, 10, one(60000, 10000), ((0.1307,), (0.3081,)), "official split",
                   class_names=tuple(DIGITS)),
    "fmnist": Shape(1, 28, 10, one(60000, 10000), (0.2860, 0.3530), "official split"),
    "usps": Shape(1, 16, 10, one(7291, 2007), ((0.2473,), (0.2665,)), "official split", class_names=tuple(DIGITS)),
    "digits": Shape(1, 8, 10, one(1437, 360), HALF, "scikit-learn's 1797 digits, fedguide's 80/20 split",
                    class_names=tuple(DIGITS)),
    "svhn": Shape(3, 32, 10, one(73257, 26032), ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
                  "official split (extra not used)", class_names=tuple(DIGITS)),
    "cifar10": Shape(3, 32, 10, one(50000, 10000), ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
                     "official split"),
    "cifar100": Shape(3, 32, 100, one(50000, 10000), ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
                      "official split (fine labels)"),
    "tinyimagenet": Shape(3, 64, 200, one(100000, 10000), ((0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)),
                          "official train; val as test"),
    "eurosat": Shape(3, 64, 10, one(*split(27000)), IMAGENET, "27 000 RGB images, fedguide's 80/20 split"),
    "mnistm": Shape(3, 28, 10, one(59001, 9001), HALF, "the MNIST-M release", class_names=tuple(DIGITS)),
    "synthdigits": Shape(3, 32, 10, one(479400, 9553), HALF,
                         "Ganin & Lempitsky's release; FedBN's partition files hold fewer", class_names=tuple(DIGITS)),
    "digit_benchmark": Shape(3, 32, 10, {d: DIGIT_DOMAINS[d] for d in ("mnist", "usps", "svhn", "synthdigits")},
                             HALF, "FedDifRC's Digits: each domain's own split (SynthDigits as above)",
                             class_names=tuple(DIGITS)),
    "digits5": Shape(3, 32, 10, dict(DIGIT_DOMAINS), HALF, "Digits-Five: digit_benchmark with MNIST-M",
                     class_names=tuple(DIGITS)),
    "digits_domains": Shape(3, 32, 10, {"uci": (1438, 359), "fonts": (1440, 360), "mnistm_like": (1440, 360)},
                            (0.3508, 0.3062), "fedguide's offline digits at their defaults", class_names=tuple(DIGITS)),
    "office_caltech10": Shape(3, 32, 10, {"amazon": split(958), "caltech": split(1123), "dslr": split(157),
                                          "webcam": split(295)}, IMAGENET, "2 533 images, fedguide's 80/20 split"),
    "domainnet": Shape(3, 32, 345, {"clipart": (33525, 14604), "infograph": (36023, 15582),
                                    "painting": (50416, 21850), "quickdraw": (120750, 51750),
                                    "real": (120906, 52041), "sketch": (48212, 20916)}, IMAGENET,
                       "the official split lists"),
    "nicopp": Shape(3, 32, 60, {d: (2600, 950) for d in ("autumn", "dim", "grass", "outdoor", "rock", "water")},
                    IMAGENET, "approximate: FedDISC gives 3k-4k images per domain, FedCADO Table 6 0.85k-1.06k "
                              "test images per domain"),
    "nicopp_unique": Shape(3, 32, 60, {f"unique{k}": (7000, 3000) for k in range(6)}, IMAGENET,
                           "approximate: FedDISC gives 7k-16k images per domain, FedCADO Table 6 1.8k-4.1k test "
                           "images per domain"),
    "openimage_fedcado": Shape(3, 32, 20, {f"client{k}": (8000, t) for k, t in enumerate(OPENIMAGE_TEST)},
                               IMAGENET, "test sizes: FedCADO Table 6; train approximate (FedDISC: 300-500 images "
                                         "per subcategory)"),
    "openimage_feddisc": Shape(3, 32, 20, {f"client{k}": (8000, t) for k, t in enumerate(OPENIMAGE_TEST)},
                               IMAGENET, "as openimage_fedcado"),
    "ham10000": Shape(3, 32, 7, {"rosendahl": split(2259), "vidir_modern": split(3363),
                                 "vidir_molemax": split(3954), "vienna_dias": split(439)}, IMAGENET,
                      "10 015 images by source, fedguide's 80/20 split (balanced classes here, unlike the real "
                      "data)"),
    "imdb": Shape(0, 256, 2, one(25000, 25000), note="official split; max_len and vocab_size as fedguide's imdb",
                  vocab_size=20000, class_names=("negative", "positive")),
}
ALIASES = {"office_caltech": "office_caltech10", "nico": "nicopp", "fashion_mnist": "fmnist",
           "tiny_imagenet": "tinyimagenet"}


class StandinParams(SourceParams):
    like: str = Field("cifar10", description="the dataset whose shape is copied: " + ", ".join(SHAPES))
    train_size: Optional[int] = Field(None, ge=1, description="training images in total (default: the dataset's)")
    test_size: Optional[int] = Field(None, ge=1, description="test images in total (default: the dataset's)")
    scale: float = Field(1.0, gt=0.0, le=1.0, description="multiplies both split sizes (after the other keys)")
    num_classes: Optional[int] = Field(None, ge=2, description="classes (default: the dataset's); sizes follow")
    image_size: Optional[int] = Field(None, ge=4, le=1024, description="side of the square images")
    channels: Optional[Literal[1, 3]] = Field(None, description="1 (grey) or 3 (RGB)")
    domains: Optional[list[str]] = Field(None, description="the dataset's domains to draw, in this order")
    max_train_per_class: Optional[int] = Field(None, ge=1, description="caps a domain's training images at "
                                                                       "this many per class")
    vocab_size: Optional[int] = Field(None, ge=3, description="token data: ids incl. 0 = padding, 1 = unknown")
    max_len: Optional[int] = Field(None, ge=1, description="token data: tokens per sample")
    noise: float = Field(0.35, ge=0.0, le=1.0, description="amplitude of the uniform per-pixel noise (0..1 of "
                                                           "the pixel range)")
    generation_seed: int = Field(0, ge=0, description="seeds the drawn data, apart from the run seed")


def shape_of(like: str) -> Shape:
    name = ALIASES.get(like, like)
    if name not in SHAPES:
        raise ConfigError(f"data.like: {like!r} is not a dataset the stand-in knows; write one of "
                          f"{', '.join(SHAPES)}")
    return SHAPES[name]


def largest_remainder(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` shared out in proportion to ``weights`` (integers summing to ``total``)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - out), kind="stable")[: total - int(out.sum())]:
        out[i] += 1
    return out.tolist()


@dataclass(frozen=True)
class Plan:
    """What will be drawn: per domain (None: no domains) its train and test sizes."""

    shape: Shape
    domains: list[Optional[str]]
    domain_ids: list[int]  # positions in the dataset's own domain list: a domain draws the same images in any subset
    train: list[int]
    test: list[int]
    classes: int
    channels: int
    size: int
    vocab_size: int


def plan(params: StandinParams) -> Plan:
    shape = shape_of(params.like)
    text = shape.channels == 0
    wrong = ([k for k in ("image_size", "channels") if getattr(params, k) is not None] if text else
             [k for k in ("vocab_size", "max_len") if getattr(params, k) is not None])
    if wrong:
        kind = "token data (write vocab_size / max_len)" if text else "images (write image_size / channels)"
        raise ConfigError(f"data.{wrong[0]} does not apply to like: {params.like}, which is {kind}")
    known = list(shape.domains)
    if params.domains is not None:
        if not shape.has_domains:
            raise ConfigError(f"data.domains: {params.like} has no domains; leave the key out")
        unknown = [d for d in params.domains if d not in known]
        if unknown or not params.domains or len(set(params.domains)) != len(params.domains):
            raise ConfigError(f"data.domains: {params.domains} is not a list of distinct domains of "
                              f"{params.like}; choose from {known}")
    domains = list(params.domains) if params.domains is not None else known
    classes = params.num_classes or shape.classes
    share = classes / shape.classes
    train = [max(1, round(shape.domains[d][0] * share)) for d in domains]
    test = [max(1, round(shape.domains[d][1] * share)) for d in domains]
    if params.max_train_per_class is not None:
        train = [min(n, params.max_train_per_class * classes) for n in train]
    if params.train_size is not None:
        train = largest_remainder(params.train_size, train)
    if params.test_size is not None:
        test = largest_remainder(params.test_size, test)
    train = [max(classes, round(n * params.scale)) for n in train]
    test = [max(classes, round(n * params.scale)) for n in test]
    return Plan(shape, domains, [known.index(d) for d in domains], train, test, classes,
                channels=0 if text else (params.channels or shape.channels),
                size=(params.max_len or shape.size) if text else (params.image_size or shape.size),
                vocab_size=(params.vocab_size or shape.vocab_size) if text else 0)


def generator(seed: int, *keys: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def balanced_labels(n: int, classes: int, gen: torch.Generator) -> torch.Tensor:
    """n labels, every class count within one of the others, in a seeded random order."""
    return (torch.arange(n) % classes)[torch.randperm(n, generator=gen)]


def domain_tint(seed: int, domain: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A domain's per-channel (gain, offset), the same in both splits; pixels stay in [0, 1]."""
    style = generator(seed, 0, domain + 1)
    gain = 0.6 + 0.4 * torch.rand(1, channels, 1, 1, generator=style)
    return gain, (1 - gain) * torch.rand(1, channels, 1, 1, generator=style)


def draw_images(labels: torch.Tensor, grids: torch.Tensor, size: int, tint: tuple[torch.Tensor, torch.Tensor],
                noise: float, gen: torch.Generator) -> torch.Tensor:
    """uint8 [N, C, size, size]: each label's grid blended with another class's, upsampled, tinted by the
    domain, plus noise (see the module docstring)."""
    n, (k, c) = len(labels), grids.shape[:2]
    gain, offset = tint
    out = torch.empty((n, c, size, size), dtype=torch.uint8)
    step = max(1, CHUNK_ELEMENTS // (c * size * size))
    for start in range(0, n, step):
        y = labels[start:start + step]
        other = torch.randint(0, k, (len(y),), generator=gen)
        mix = 0.5 * torch.rand(len(y), 1, 1, 1, generator=gen)
        grid = (1 - mix) * grids[y] + mix * grids[other]
        x = F.interpolate(grid, size=(size, size), mode="bicubic", align_corners=False)
        x = x.mul_(gain).add_(offset).add_(torch.rand(x.shape, generator=gen).sub_(0.5).mul_(noise))
        out[start:start + len(y)] = x.clamp_(0, 1).mul_(255).round_().to(torch.uint8)
    return out


def draw_tokens(labels: torch.Tensor, vocab_size: int, max_len: int, class_words: torch.Tensor,
                gen: torch.Generator) -> torch.Tensor:
    """int64 [N, max_len] token ids, 0-padded (see the module docstring)."""
    n = len(labels)
    words = vocab_size - 2  # ids 2 .. vocab_size - 1; 0 pads, 1 is the unknown word
    ranks = torch.exp(torch.rand((n, max_len), generator=gen) * float(np.log(words))).long().clamp_(1, words)
    x = ranks + 1
    own = torch.rand((n, max_len), generator=gen) < 0.1
    pick = torch.randint(0, class_words.shape[1], (n, max_len), generator=gen)
    x = torch.where(own, class_words[labels.unsqueeze(1), pick], x)
    lengths = torch.randint(max(1, max_len // 2), max_len + 1, (n, 1), generator=gen)
    return x.masked_fill_(torch.arange(max_len).unsqueeze(0) >= lengths, 0)


def draw(params: StandinParams) -> tuple[Plan, dict[str, torch.Tensor]]:
    """The plan and its raw tensors: train/test x (uint8 images or int64 tokens), y and domain ids."""
    p = plan(params)
    seed = params.generation_seed
    text = p.channels == 0
    if text:
        words = torch.randperm(p.vocab_size - 2, generator=generator(seed, 0)) + 2
        per_class = max(1, min(32, (p.vocab_size - 2) // p.classes))
        class_words = words[: per_class * p.classes].reshape(p.classes, per_class)
    else:
        grids = torch.rand((p.classes, p.channels, GRID, GRID), generator=generator(seed, 0))
    out: dict[str, torch.Tensor] = {}
    for side_id, (side, sizes) in enumerate((("train", p.train), ("test", p.test)), start=1):
        xs, ys, ds = [], [], []
        for d, (own_id, n) in enumerate(zip(p.domain_ids, sizes)):
            gen = generator(seed, side_id, own_id)
            y = balanced_labels(n, p.classes, gen)
            xs.append(draw_tokens(y, p.vocab_size, p.size, class_words, gen) if text
                      else draw_images(y, grids, p.size, domain_tint(seed, own_id, p.channels), params.noise, gen))
            ys.append(y)
            ds.append(torch.full((n,), d, dtype=torch.int64))
        out[f"{side}_x"], out[f"{side}_y"], out[f"{side}_domains"] = torch.cat(xs), torch.cat(ys), torch.cat(ds)
    if text:
        out["train_x"][0, 0] = p.vocab_size - 1
    return p, out


@DATASETS.register("standin", params=StandinParams,
                   summary="drawn data of a paper dataset's shape, size, classes and domains (like: cifar10, ...)")
def load_standin(params: StandinParams) -> DatasetSplits:
    p, t = draw(params)
    names = list(p.shape.class_names or ())[: p.classes]
    names += [f"class {i}" for i in range(len(names), p.classes)]
    domain_keys = {}
    if p.shape.has_domains:
        domain_keys = dict(train_domains=t["train_domains"], test_domains=t["test_domains"],
                           domain_names=[str(d) for d in p.domains])
    if p.channels == 0:
        return DatasetSplits(t["train_x"], t["train_y"], t["test_x"], t["test_y"], names, **domain_keys)
    mean, std = p.shape.stats
    if p.channels != (len(mean) if isinstance(mean, (tuple, list)) else p.channels):
        mean, std = HALF if p.channels == 3 else ((0.5,), (0.5,))  # channels overridden: the generic statistics
    splits = to_splits(RawImages(t["train_x"], t["train_y"], t["test_x"], t["test_y"], names), mean, std)
    return dataclasses.replace(splits, pixel_stats=(mean, std), **domain_keys)


# ---- the stand-in of a config's real data section --------------------------------------------------

# Keys of the real sources that only say where or how files are read: nothing to copy.
FILE_KEYS = ("root", "test_fraction", "split_seed", "mean", "std", "truncation", "per_class", "num_groups",
             "generation_seed")


def standin_section(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` section of a stand-in for ``{name: <source>, **params}``: the same shape, domains,
    classes, image size and caps (sizes from the table)."""
    shape = shape_of(name)
    out: dict[str, Any] = {"name": "standin", "like": ALIASES.get(name, name)}
    for key in ("image_size", "domains", "num_classes", "max_train_per_class", "vocab_size", "max_len"):
        if params.get(key) is not None:
            out[key] = params[key]
    if params.get("label") == "coarse":
        out["num_classes"] = 20  # CIFAR-100's superclasses
    if params.get("subset") == "ten":
        out["num_classes"] = 10  # FedBN's ten DomainNet classes
    if params.get("classes") is not None:
        out["num_classes"] = len(params["classes"])
    if shape.channels == 0:
        out.pop("image_size", None)
    unknown = set(params) - set(out) - set(FILE_KEYS) - {"name", "label", "subset", "classes"}
    if unknown:
        raise ConfigError(f"data keys {sorted(unknown)} of {name} have no stand-in equivalent; remove them or "
                          "write the standin section by hand")
    return out
