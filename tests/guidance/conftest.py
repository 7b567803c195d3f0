"""Tiny random Stable-Diffusion-layout pipelines, built once per test session."""
import pytest

from fedguide.guidance.config import GuidanceConfig
from fedguide.guidance.model import GuidanceModel
from fedguide.guidance.tiny import build_tiny_clip, build_tiny_pipeline


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny-sd"), seed=0)


@pytest.fixture(scope="session")
def tiny_unclip(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny-unclip"), seed=1, unclip=True)


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), seed=2)


@pytest.fixture(scope="session")
def sd_model(tiny_sd):
    return GuidanceModel.from_config(GuidanceConfig(model=str(tiny_sd)))


@pytest.fixture(scope="session")
def unclip_model(tiny_unclip):
    return GuidanceModel.from_config(GuidanceConfig(model=str(tiny_unclip)))
