"""Renderers for the three domains of ``digits_domains``: uint8 RGB images [N, 3, S, S] from offline assets.

Every random draw comes from the numpy Generator passed in, and all resampling is torch's CPU
``grid_sample``/``interpolate`` (deterministic), so the same generator state gives the same bytes.
The ranges below are the ones the source's docstring documents; change both together.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from fedguide.registry import ConfigError

# ---- uci: scikit-learn's 8x8 handwritten digits ----------------------------------------------------

# MNIST centres a 20x20 digit in a 28x28 frame; the 8x8 digits, which fill their frame, get the same margin.
DIGIT_BOX_FRACTION = 20 / 28


def uci_images(size: int) -> tuple[torch.Tensor, np.ndarray]:
    """All 1797 UCI digits as white-on-black uint8 [N, 3, S, S], upscaled bilinearly into a centred box."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # values are 0..16
    box = max(1, round(size * DIGIT_BOX_FRACTION))
    big = F.interpolate(small, size=(box, box), mode="bilinear", align_corners=False)
    before = (size - box) // 2
    big = F.pad(big, (before, size - box - before, before, size - box - before))
    grey = big.mul_(255.0).round_().clamp_(0, 255).to(torch.uint8)
    return grey.expand(-1, 3, -1, -1).contiguous(), bunch.target.astype(np.int64)


# ---- fonts: SynthDigits-like renders ---------------------------------------------------------------

# Files shipped in matplotlib's mpl-data/fonts/ttf that draw all ten digits (the DejaVu "Display"
# subsets and the STIX size/non-unicode variants do not).
FONT_FILES = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
    "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-BoldItalic.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf",
    "STIXGeneralBolIta.ttf", "cmr10.ttf", "cmb10.ttf", "cmss10.ttf", "cmtt10.ttf", "cmti10.ttf",
)
GLYPH_PX = 64  # glyph canvas side; the digit's height fills it, so a scale s makes it s of the image tall
FONT_PX = 96  # rendering size before cropping to the glyph's ink
OUTLINE_PX = 5  # outline width at FONT_PX (about 7 % of the digit's height)

FONT_HEIGHT = (0.55, 0.85)  # digit height as a fraction of the image side
FONT_ROTATION_DEG = (-15.0, 15.0)
FONT_SHEAR = (-0.2, 0.2)
FONT_JITTER = 0.1  # centre offset, +- this fraction of the image side on each axis
FONT_OUTLINE_P = 0.3  # share of digits drawn with an outline in a third colour
FONT_MIN_CONTRAST = 80.0  # least |luma(ink) - luma(background)| on 0..255, so every digit is visible
FONT_BLUR_SIGMAS = (0.0, 0.5, 1.0)  # Gaussian blur in pixels, one drawn uniformly per image
FONT_NOISE_STD = (0.0, 8.0)  # additive Gaussian pixel noise on 0..255


def font_dir() -> str:
    import matplotlib

    return os.path.join(matplotlib.get_data_path(), "fonts", "ttf")


def _glyph_canvas(ink: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """Crop ``ink`` to ``box`` and fit it, height first, centred in a GLYPH_PX square (float 0..1)."""
    from PIL import Image

    left, top, right, bottom = box
    crop = Image.fromarray(ink[top:bottom, left:right])
    scale = GLYPH_PX / max(bottom - top, right - left)
    w, h = max(1, round((right - left) * scale)), max(1, round((bottom - top) * scale))
    resized = np.asarray(crop.resize((w, h), Image.LANCZOS), dtype=np.float32) / 255.0
    out = np.zeros((GLYPH_PX, GLYPH_PX), dtype=np.float32)
    y0, x0 = (GLYPH_PX - h) // 2, (GLYPH_PX - w) // 2
    out[y0:y0 + h, x0:x0 + w] = resized
    return out


def font_glyphs() -> tuple[torch.Tensor, torch.Tensor]:
    """Fill and outline masks, float [F, 10, GLYPH_PX, GLYPH_PX] each, for every font and digit.

    The outline mask is the digit drawn with a stroke OUTLINE_PX wide (it contains the fill); both are
    cropped to the stroked glyph's ink so they stay aligned.
    """
    from PIL import Image, ImageDraw, ImageFont

    folder = font_dir()
    missing = [f for f in FONT_FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ConfigError(
            f"matplotlib's bundled fonts {', '.join(missing)} are missing from {folder}; "
            "reinstall matplotlib (pip install --force-reinstall matplotlib)"
        )
    side = 2 * FONT_PX
    fills, outlines = [], []
    for name in FONT_FILES:
        font = ImageFont.truetype(os.path.join(folder, name), FONT_PX)
        for digit in "0123456789":
            layers = []
            for stroke in (0, OUTLINE_PX):
                canvas = Image.new("L", (side, side), 0)
                centre = (side // 2, side // 2)
                ImageDraw.Draw(canvas).text(
                    centre, digit, font=font, fill=255, anchor="mm", stroke_width=stroke, stroke_fill=255
                )
                layers.append(np.asarray(canvas))
            box = Image.fromarray(layers[1]).getbbox()
            if box is None or layers[0].max() == 0:
                raise ConfigError(f"font {name} in {folder} draws no ink for '{digit}'; reinstall matplotlib")
            fills.append(_glyph_canvas(layers[0], box))
            outlines.append(_glyph_canvas(layers[1], box))
    shape = (len(FONT_FILES), 10, GLYPH_PX, GLYPH_PX)
    return torch.from_numpy(np.stack(fills)).view(shape), torch.from_numpy(np.stack(outlines)).view(shape)


def _luma(rgb: np.ndarray) -> np.ndarray:
    return rgb @ np.array([0.299, 0.587, 0.114])


def _contrasting_colours(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Background and ink colours, uniform in RGB, ink redrawn until it differs enough in luma."""
    background = rng.uniform(0, 255, size=(n, 3))
    ink = rng.uniform(0, 255, size=(n, 3))
    for _ in range(1000):
        bad = np.abs(_luma(ink) - _luma(background)) < FONT_MIN_CONTRAST
        if not bad.any():
            return background, ink
        ink[bad] = rng.uniform(0, 255, size=(int(bad.sum()), 3))
    raise RuntimeError("could not draw contrasting colours")  # probability ~0 for these ranges


def _gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of float [N, C, H, W], edges replicated."""
    radius = max(1, math.ceil(3 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (t / sigma) ** 2)
    kernel /= kernel.sum()
    c = images.shape[1]
    x = F.pad(images, (radius, radius, radius, radius), mode="replicate")
    x = F.conv2d(x, kernel.view(1, 1, 1, -1).expand(c, 1, 1, -1).contiguous(), groups=c)
    return F.conv2d(x, kernel.view(1, 1, -1, 1).expand(c, 1, -1, 1).contiguous(), groups=c)


def render_fonts(labels: np.ndarray, size: int, rng: np.random.Generator, glyphs=None) -> torch.Tensor:
    """One SynthDigits-like uint8 [3, S, S] image per label: a random font's digit, scaled, rotated,
    sheared and shifted, in an ink colour over a plain background colour, optionally outlined, blurred
    and noisy."""
    fill, outline = glyphs if glyphs is not None else font_glyphs()
    n = len(labels)
    font = rng.integers(0, fill.shape[0], size=n)
    height = rng.uniform(*FONT_HEIGHT, size=n)
    angle = np.deg2rad(rng.uniform(*FONT_ROTATION_DEG, size=n))
    shear = rng.uniform(*FONT_SHEAR, size=n)
    centre = rng.uniform(-FONT_JITTER, FONT_JITTER, size=(n, 2)) * 2  # normalised coords span 2 per side
    background, ink = _contrasting_colours(rng, n)
    rim = np.where((rng.random(n) < FONT_OUTLINE_P)[:, None], rng.uniform(0, 255, size=(n, 3)), ink)
    blur = rng.choice(np.array(FONT_BLUR_SIGMAS), size=n)
    noise_std = rng.uniform(*FONT_NOISE_STD, size=n)
    noise = rng.standard_normal(size=(n, 3, size, size)).astype(np.float32)

    # grid_sample maps output coords to glyph coords: glyph = M (out - centre), M = (R S_h)^-1 / height.
    cos, sin = np.cos(angle), np.sin(angle)
    rot_inv = np.stack([np.stack([cos, sin], -1), np.stack([-sin, cos], -1)], -2)
    shear_inv = np.zeros((n, 2, 2))
    shear_inv[:, 0, 0] = shear_inv[:, 1, 1] = 1.0
    shear_inv[:, 0, 1] = -shear
    m = shear_inv @ rot_inv / height[:, None, None]
    theta = np.concatenate([m, -(m @ centre[:, :, None])], axis=2)
    grid = F.affine_grid(torch.from_numpy(theta).float(), [n, 2, size, size], align_corners=False)
    pick = torch.from_numpy(font), torch.from_numpy(labels)
    masks = torch.stack([fill[pick], outline[pick]], dim=1)  # [N, 2, G, G]
    masks = F.grid_sample(masks, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    fill_m, rim_m = masks[:, :1], (masks[:, 1:] - masks[:, :1]).clamp_(min=0.0)

    def col(c):
        return torch.from_numpy(c).float()[:, :, None, None]

    images = col(background) * (1 - fill_m - rim_m) + col(ink) * fill_m + col(rim) * rim_m
    for sigma in FONT_BLUR_SIGMAS:
        chosen = torch.from_numpy(np.flatnonzero(blur == sigma))
        if sigma > 0 and len(chosen):
            images[chosen] = _gaussian_blur(images[chosen], sigma)
    images += torch.from_numpy(noise) * torch.from_numpy(noise_std).float()[:, None, None, None]
    return images.round_().clamp_(0, 255).to(torch.uint8)


# ---- mnistm_like: digits blended over photo crops --------------------------------------------------

# Colour photos shipped inside the scikit-image wheel (the ones fetched from the network are left out).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "motorcycle")
CROP_PX = (1.0, 4.0)  # crop side in photo pixels, as a multiple of the image side, before resizing to it


def load_photos() -> list[torch.Tensor]:
    """The PHOTOS as float [3, H, W] on 0..255."""
    import skimage.data

    out = []
    for name in PHOTOS:
        try:
            rgb = skimage.data.stereo_motorcycle()[0] if name == "motorcycle" else getattr(skimage.data, name)()
        except Exception as err:  # noqa: BLE001  (a missing file surfaces as several error types)
            raise ConfigError(
                f"scikit-image's bundled photo '{name}' could not be loaded ({type(err).__name__}: {err}); "
                "reinstall scikit-image (pip install --force-reinstall 'scikit-image>=0.21')"
            ) from None
        out.append(torch.from_numpy(np.ascontiguousarray(rgb[..., :3])).permute(2, 0, 1).float())
    return out


def render_mnistm(digits: torch.Tensor, rng: np.random.Generator, photos=None) -> torch.Tensor:
    """MNIST-M recipe: |crop - digit| per channel, a random crop of a random photo under each white-on-
    black uint8 digit [N, 3, S, S]; crops are randomly sized, flipped left-right and up-down."""
    photos = photos if photos is not None else load_photos()
    n, _, size, _ = digits.shape
    which = rng.integers(0, len(photos), size=n)
    crop = rng.uniform(*CROP_PX, size=n) * size
    flips = rng.choice(np.array([-1.0, 1.0]), size=(n, 2))
    where = rng.random(size=(n, 2))  # crop centre, as a fraction of the room left by the crop
    backgrounds = torch.empty(n, 3, size, size)
    for p, photo in enumerate(photos):
        rows = np.flatnonzero(which == p)
        if len(rows) == 0:
            continue
        h, w = photo.shape[1:]
        side = np.minimum(crop[rows], min(h, w))  # large image sizes would otherwise crop past the photo
        half = np.stack([side / w, side / h], -1)  # crop half-extent in normalised coords
        centre = (1 - half) * (2 * where[rows] - 1)
        theta = np.zeros((len(rows), 2, 3))
        theta[:, 0, 0], theta[:, 1, 1] = half[:, 0] * flips[rows, 0], half[:, 1] * flips[rows, 1]
        theta[:, :, 2] = centre
        grid = F.affine_grid(torch.from_numpy(theta).float(), [len(rows), 3, size, size], align_corners=False)
        backgrounds[torch.from_numpy(rows)] = F.grid_sample(
            photo.expand(len(rows), -1, -1, -1), grid, mode="bilinear", align_corners=False
        )
    return (backgrounds - digits.float()).abs_().round_().clamp_(0, 255).to(torch.uint8)
