"""Fixtures shared by the guided methods' tests: the session's tiny pipelines (tests/conftest.py),
the guidance models as the methods load them, tiny Fashion-MNIST files (FedDifRC, SemanticFL), a UNet pass
counter, and semi-supervised digits_domains runs with their dataset loaded once (FedDISC and its baselines)."""
import dataclasses
import functools
import json

import numpy as np
import pytest

from fedguide.config import GuidanceConfig, build_config
from fedguide.data.sources import DATASETS
from fedguide.guidance.shared import guidance_model
from tests.tiny import tiny_raw

CLASSES = 10


# ---- guidance models -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def sd_model(tiny_sd):
    """The tiny SD pipeline as the methods load it (guidance_model: one instance per process), so that a hook
    on it sees the methods' UNet passes."""
    return guidance_model(GuidanceConfig(model=str(tiny_sd)))


@pytest.fixture(scope="session")
def unclip_model(tiny_unclip):
    """The tiny unCLIP pipeline as the methods load it (see sd_model)."""
    return guidance_model(GuidanceConfig(model=str(tiny_unclip)))


class UNetCalls:
    """Counts UNet forward passes and the images they process (a forward pre-hook) until the block exits."""

    def __init__(self, unet):
        self.calls, self.images = 0, 0
        self.handle = unet.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1
        self.images += int(args[0].shape[0])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture
def unet_calls(sd_model):
    """``with unet_calls() as counted:`` counts the passes of the tiny SD UNet the methods share."""
    return lambda: UNetCalls(sd_model.unet)


# ---- tiny Fashion-MNIST IDX files ------------------------------------------------------------------------
def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_fmnist(folder, n_train=60, n_test=30, seed=0, vertical=False):
    """Each class is a bright band at its own height (at its own place across with ``vertical``) over dim
    noise: learnable in a round."""
    rng = np.random.default_rng(seed)
    for images_name, labels_name, n in (("train-images-idx3-ubyte", "train-labels-idx1-ubyte", n_train),
                                        ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", n_test)):
        labels = np.arange(n) % CLASSES
        images = rng.integers(0, 40, (n, 28, 28))
        for i, c in enumerate(labels):
            band, span = slice(2 * c + 3, 2 * c + 7), slice(4, 24)
            images[(i, span, band) if vertical else (i, band, span)] = 230
        (folder / images_name).write_bytes(idx_bytes(images))
        (folder / labels_name).write_bytes(idx_bytes(labels))
    return folder


@pytest.fixture(scope="module")
def fmnist_root(request, tmp_path_factory):
    """The module's Fashion-MNIST folder; a module may set ``FMNIST = {...}``, keywords of write_fmnist."""
    return write_fmnist(tmp_path_factory.mktemp("fmnist"), **getattr(request.module, "FMNIST", {}))


# ---- semi-supervised digits_domains (FedDISC and its baselines) ----------------------------------------------
@pytest.fixture(scope="module")
def cached_digits():
    """digits_domains renders its images on every load; a module's runs share one load per parameters.
    Modules opt in: ``pytestmark = pytest.mark.usefixtures("cached_digits")``."""
    entry = DATASETS.get("digits_domains")

    @functools.lru_cache(maxsize=4)
    def load(key):
        return entry.obj(entry.params.model_validate(json.loads(key)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DATASETS._entries, "digits_domains",
                   dataclasses.replace(entry, obj=lambda p: load(p.model_dump_json())))
        yield


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    """One feature cache per module: its runs share the fitted bases and features."""
    return tmp_path_factory.mktemp("features")


SEMI = {"name": "semi_supervised", "server_domain": "uci", "clients": "feature_skew"}


@pytest.fixture(scope="module")
def digits_config(tiny_unclip, feature_cache):
    """``digits_config(method, rounds=1, image_encoder=None, **over)``: the config of ``method`` on 16-pixel
    digits_domains split semi-supervised (labels on the server's uci domain, feature-skewed clients) over two
    clients, guided by the tiny unCLIP pipeline (``image_encoder``: another image encoder's folder), with the
    module's feature cache; ``over`` as tiny_raw's."""
    def make(method: dict, rounds: int = 1, image_encoder=None, **over):
        guidance = {"model": str(tiny_unclip), "feature_cache": str(feature_cache)}
        if image_encoder is not None:
            guidance["image_encoder"] = str(image_encoder)
        base = {"data": {"name": "digits_domains", "image_size": 16, "per_class": 20, "fraction": 0.5},
                "clients": {"num": 2, "per_round": 2}, "train": {"rounds": rounds}, "guidance": guidance}
        raw = tiny_raw(base, method=method, **over)
        raw["partition"] = dict(SEMI)
        return build_config(raw)
    return make


# ---- threads ---------------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Torch on one thread, as the tiny runs' runtime (threads_per_worker 1) puts it: tests that open a run
    in-process and train or generate there would otherwise run on every core the test machine shares."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
