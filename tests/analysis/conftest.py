"""Tiny finished runs the analysis tests share, each made once per session (the figures only read them and
write into their analysis/ folders): FedAvg, MOON and FedDW on 8x8 digits, FedDifRC and SD_Gen on 8-pixel
digits_domains with the session's tiny Stable-Diffusion pipeline (tests/conftest.py)."""
from __future__ import annotations

import pytest

from fedguide.config import build_config
from tests.tiny import run_tiny, tiny_config, tiny_raw

# 8-pixel digits of 3 domains (about 1500 training and 380 test images); the runs keep a few % of the
# training images, every client a few of most classes.
DIGITS_DOMAINS = {"name": "digits_domains", "image_size": 8, "per_class": 3}


def finished(tmp_path_factory, cfg, name: str):
    _, _, run_dir = run_tiny(tmp_path_factory.mktemp("analysis"), cfg, name=name)
    return run_dir


@pytest.fixture(scope="session")
def fedavg_run(tmp_path_factory):
    return finished(tmp_path_factory, tiny_config(), "fedavg")


@pytest.fixture(scope="session")
def moon_run(tmp_path_factory):
    """Every client in both rounds, so every client's state holds its round-1 model (MOON's previous model)."""
    cfg = tiny_config(method={"name": "moon"}, clients={"num": 4, "per_round": 4}, train={"rounds": 2})
    return finished(tmp_path_factory, cfg, "moon")


@pytest.fixture(scope="session")
def feddifrc_run(tmp_path_factory, tiny_sd):
    """FedDifRC with NDCR alone (TDCL's features cost a UNet pass per class prompt and image): the denoising
    features of 2 % of the training images (about 30), encoded at 32 px (the paper's 224 px made the tiny
    UNet's attention over 12,544 latent positions take half a minute)."""
    cache = tmp_path_factory.mktemp("features")
    cfg = tiny_config({"data": {**DIGITS_DOMAINS, "fraction": 0.02},
                       "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)},
                       "clients": {"num": 3, "per_round": 3}, "train": {"rounds": 1}},
                      method={"name": "feddifrc", "tdcl": False, "fit_samples": 16, "extract_batch": 64,
                              "image_size": 32})
    return finished(tmp_path_factory, cfg, "feddifrc")


@pytest.fixture(scope="session")
def sd_gen_run(tmp_path_factory, tiny_sd):
    """SD_Gen on two clients of disjoint classes: 2 images per class a client holds (as tests/methods/one_shot/test_fedcado.py)."""
    cache = tmp_path_factory.mktemp("features")
    raw = tiny_raw({"data": {**DIGITS_DOMAINS, "fraction": 0.1, "public_fraction": 0.1},
                    "model": {"name": "resnet10", "width": 4},
                    "clients": {"num": 2, "per_round": 2}, "train": {"rounds": 1},
                    "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)}},
                   method={"name": "sd_gen", "images_per_class": 2, "steps": 2, "gen_batch_size": 4, "agg_epochs": 1,
                           "progress": False})
    raw["partition"] = {"name": "disjoint_classes", "k": 2}
    return finished(tmp_path_factory, build_config(raw), "sd_gen")


@pytest.fixture(scope="session")
def feddw_run(tmp_path_factory):
    """FedDW: its server keeps the aggregated soft-label matrix (dw state) in the checkpoint."""
    return finished(tmp_path_factory, tiny_config(method={"name": "feddw"}, train={"rounds": 2},
                                                    model={"head_bias": False}), "feddw")
