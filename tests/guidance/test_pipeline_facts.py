"""The input size of the diffusion features: what a pipeline's configs say (VAE factor, own size, unCLIP,
fedguide's own models), the sizes a VAE can take, each ``image_size`` setting, and the VAE at those sizes."""
import pytest
import torch

from fedguide.config import GuidanceConfig
from fedguide.guidance.features import DiffusionFeatures, FeatureSpec
from fedguide.guidance.pipeline_facts import PipelineFacts, pipeline_facts, read_facts
from fedguide.registry import ConfigError

SD15 = PipelineFacts(vae_factor=8, pipeline_size=512, unclip=False, single_resolution=False)
OWN = PipelineFacts(vae_factor=4, pipeline_size=32, unclip=False, single_resolution=True)


def test_facts_read_from_the_configs(tiny_sd, tiny_unclip):
    # the tiny pipelines: VAE blocks (16, 32, 32) -> factor 2² = 4, UNet sample_size 8 -> 32 px
    assert read_facts(tiny_sd) == PipelineFacts(4, 32, unclip=False, single_resolution=False)
    assert read_facts(tiny_unclip).unclip
    # the embedded models: fedguide's own (fedguide.json), 32 px
    assert pipeline_facts(GuidanceConfig(model="embedded")) == PipelineFacts(4, 32, False, True)
    assert pipeline_facts(GuidanceConfig(model=None)) is None
    # a hub id outside the local cache with downloads off: no facts, nothing fetched
    assert pipeline_facts(GuidanceConfig(model="nobody/not-a-cached-pipeline")) is None


def test_sizes_the_vae_takes_and_the_nearest_ones_named():
    assert SD15.check_image_size(224) == 224 and SD15.check_image_size(32) == 32
    with pytest.raises(ConfigError, match=r"multiples of 8 .*use 24 or 32"):
        SD15.check_image_size(28)  # Fashion-MNIST's own size on SD
    with pytest.raises(ConfigError, match=r"at least 8\); use 8$"):
        SD15.check_image_size(4)
    with pytest.raises(ConfigError, match=r"use 4 or 8$"):
        OWN.check_image_size(6)


def test_each_image_size_setting():
    # paper: the paper's size (FedDifRC 224) on a paper-scale pipeline, the data's for SemanticFL (paper=data)
    assert SD15.resolve_image_size("paper", 224, 32) == 224
    assert SD15.resolve_image_size("paper", 32, 32) == 32
    assert SD15.resolve_image_size("native", 224, 32) == 32
    assert SD15.resolve_image_size("pipeline", 224, 32) == 512
    assert SD15.resolve_image_size(96, 224, 32) == 96
    # fedguide's own models were trained at 32 px only: paper means their size, native stays the data's
    assert OWN.resolve_image_size("paper", 224, 28) == 32
    assert OWN.resolve_image_size("native", 224, 28) == 28
    with pytest.raises(ConfigError, match=r"image_size=native \(28 px\).*use 24 or 32"):
        SD15.resolve_image_size("native", 32, 28)


def test_encode_image_takes_a_size(sd_model):
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    assert sd_model.encode_image(x).shape == (2, 4, 8, 8)  # the pipeline's 32 px
    assert sd_model.encode_image(x, size=64).shape == (2, 4, 16, 16)
    assert sd_model.encode_image(x[:, :1, :28, :28], size=28).shape == (2, 4, 7, 7)  # the data's own size
    with pytest.raises(ConfigError, match="multiples of 4"):
        sd_model.encode_image(x, size=30)


def test_decoder_maps_at_the_papers_latent_size(sd_model):
    # FedDifRC Sec. 4.1: 224-px images on SD's factor 8 = 28x28 latents, decoder maps {7, 14, 28, 28}.
    # The tiny pipeline (factor 4, the same four UNet levels) reaches 28x28 latents at 112 px.
    spec = FeatureSpec(("up.0", "up.1", "up.2", "up.3"), t=0, image_size=112)
    maps = DiffusionFeatures(sd_model, spec).maps(torch.zeros(1, 3, 32, 32), ["a photo of a 1"], [0])
    assert [maps[f"up.{i}"].shape[-1] for i in range(4)] == [7, 14, 28, 28]


def test_the_size_is_in_the_feature_key():
    assert FeatureSpec(("mid",), image_size=224).as_dict()["image_size"] == 224
    assert FeatureSpec(("mid",), image_size=224).as_dict() != FeatureSpec(("mid",), image_size=512).as_dict()
