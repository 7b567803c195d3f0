"""The guidance tests' models: the session's tiny pipelines (tests/conftest.py) loaded as GuidanceModels."""
import pytest

from fedguide.config import GuidanceConfig
from fedguide.guidance.model import GuidanceModel


@pytest.fixture(scope="session")
def sd_model(tiny_sd):
    return GuidanceModel.from_config(GuidanceConfig(model=str(tiny_sd)))


@pytest.fixture(scope="session")
def unclip_model(tiny_unclip):
    return GuidanceModel.from_config(GuidanceConfig(model=str(tiny_unclip)))
