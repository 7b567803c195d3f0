"""align_features with FedDifRC Table 8's self-supervised encoders: MAE (ViTMAE) and DINO (ViT), read by hub id
or folder; tiny random ones are built from a config and saved to a folder."""
import json

import pytest
import torch

from fedguide.guidance.sources import GuidanceLoadError
from fedguide.guidance.vit_encoder import load_vit_encoder
from tests.tiny import run_tiny, tiny_config

CPU = torch.device("cpu")
TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, image_size=16,
            patch_size=8)


@pytest.fixture(scope="module")
def vit_folders(tmp_path_factory):
    from transformers import ViTConfig, ViTMAEConfig, ViTMAEModel, ViTModel

    root = tmp_path_factory.mktemp("vit")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ViTMAEModel(ViTMAEConfig(**TINY, decoder_hidden_size=8, decoder_num_hidden_layers=1,
                                 decoder_num_attention_heads=2, decoder_intermediate_size=12)).save_pretrained(root / "mae")
        ViTModel(ViTConfig(**TINY), add_pooling_layer=False).save_pretrained(root / "dino")
    return {"mae": root / "mae", "dino": root / "dino"}


def images(n=3):
    return torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1


@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_embedding_is_the_class_token_of_the_whole_image(vit_folders, kind):
    encoder = load_vit_encoder(str(vit_folders[kind]), None, CPU, torch.float32)
    assert encoder.kind == {"mae": "vit_mae", "dino": "vit"}[kind] and encoder.dim == 16
    x = images()
    state = torch.random.get_rng_state()
    emb = encoder.embed(x)
    assert torch.equal(torch.random.get_rng_state(), state)  # MAE's patch shuffle draws nothing
    assert torch.equal(encoder.embed(x), emb)  # deterministic
    with torch.no_grad():
        kwargs = {"noise": torch.arange(4.0).expand(3, -1)} if kind == "mae" else {}
        hidden = encoder.model(pixel_values=encoder.preprocess(x), **kwargs).last_hidden_state
    assert hidden.shape == (3, 1 + 4, 16)  # every 8x8 patch of the 16-px image: nothing masked
    assert torch.allclose(emb, hidden[:, 0])
    encoder.pooling = "mean"
    assert torch.allclose(encoder.embed(x), hidden[:, 1:].mean(1))


def test_an_uncached_hub_id_is_refused_offline_with_the_download_command():
    with pytest.raises(GuidanceLoadError, match=r"huggingface-cli download facebook/vit-mae-base .*method\.encoder=DIR"):
        load_vit_encoder("facebook/vit-mae-base", None, CPU, torch.float32)


def test_a_model_that_is_not_a_vit_is_refused(tiny_clip):
    with pytest.raises(GuidanceLoadError, match="is a clip model; pass a ViTMAE"):
        load_vit_encoder(str(tiny_clip), None, CPU, torch.float32)


@pytest.mark.parametrize("kind", ["mae", "dino"])
def test_align_features_runs_on_a_vit_encoder(tmp_path, vit_folders, fmnist_root, kind):
    cfg = tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)},
                       "guidance": {"feature_cache": str(tmp_path / "cache")}, "train": {"rounds": 2}},
                      method={"name": "align_features", "encoder": str(vit_folders[kind])})
    summary, _, run_dir = run_tiny(tmp_path, cfg)
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    record = json.loads((run_dir / "guidance" / "align_features.json").read_text())
    assert record["image_features"]["shape"] == [60, 16]  # every training image, the ViT's hidden size
    assert record["encoder"].startswith(str(vit_folders[kind]))
