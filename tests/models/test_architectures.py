"""The standard architectures: reference parameter counts, forward shapes, head options, taps, bad input."""
import pytest
import torch
from torch import nn

from fedguide.models import MODELS, ModelSpec, build_model
from fedguide.models.taps import FeatureTap, encoder_stages
from fedguide.registry import ConfigError

# Parameter counts of the well-known reference implementations (torchvision) at 224x224x3, 1000 classes.
REFERENCE_COUNTS = {
    ("resnet18", ()): 11_689_512,
    ("resnet34", ()): 21_797_672,
    ("resnet50", ()): 25_557_032,
    ("mobilenetv2", ()): 3_504_872,
    ("mobilenetv3_small", ()): 2_542_856,
    ("shufflenetv2", ()): 2_278_604,
    ("shufflenetv2", (("width", 0.5),)): 1_366_792,
    ("shufflenetv2", (("width", 1.5),)): 3_503_624,
    ("shufflenetv2", (("width", 2.0),)): 7_393_996,
    ("vgg16_bn", ()): 138_365_992,
}

# Small settings that keep the forward passes fast, with the z width they give.
SMALL = {
    "resnet18": ({"width": 8}, 64),
    "resnet34": ({"width": 8}, 64),
    "resnet50": ({"width": 8}, 256),
    "mobilenetv2": ({"width": 0.25}, 1280),
    "mobilenetv3_small": ({"width": 0.25}, 256),
    "shufflenetv2": ({"width": 0.5}, 1024),
    "vgg16_bn": ({}, 512),
}
CONVNETS = sorted(SMALL)


def params(name, **overrides):
    return MODELS.get(name).params(**overrides)


def on_meta(name, spec, **overrides):
    """Built on the meta device: shapes and counts without allocating (VGG-16 has 138 M parameters)."""
    with torch.device("meta"):
        return build_model(name, params(name, **overrides), spec)


def count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,extra", sorted(REFERENCE_COUNTS))
def test_parameter_count_matches_reference_at_224(name, extra):
    model = on_meta(name, ModelSpec((3, 224, 224), 1000), stem="imagenet", **dict(extra))
    assert count(model) == REFERENCE_COUNTS[(name, extra)]
    with torch.device("meta"):
        assert model.eval()(torch.empty(2, 3, 224, 224)).shape == (2, 1000)


@pytest.mark.parametrize("name", CONVNETS)
def test_auto_stem_follows_input_size(name):
    at_224 = on_meta(name, ModelSpec((3, 224, 224), 1000))
    forced = on_meta(name, ModelSpec((3, 224, 224), 1000), stem="imagenet")
    assert count(at_224) == count(forced)
    small_auto = on_meta(name, ModelSpec((3, 32, 32), 10), **SMALL[name][0])
    small_forced = on_meta(name, ModelSpec((3, 32, 32), 10), stem="cifar", **SMALL[name][0])
    assert str(small_auto) == str(small_forced)


def test_resnet_stems():
    first = lambda m: m.encoder[0]  # noqa: E731
    assert first(on_meta("resnet18", ModelSpec((3, 224, 224), 10))).kernel_size == (7, 7)
    assert isinstance(on_meta("resnet18", ModelSpec((3, 224, 224), 10)).encoder[3], nn.MaxPool2d)
    small = on_meta("resnet18", ModelSpec((3, 32, 32), 10))
    assert first(small).kernel_size == (3, 3) and first(small).stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in small.modules())
    assert first(on_meta("resnet18", ModelSpec((3, 32, 32), 10), stem="imagenet")).kernel_size == (7, 7)


@pytest.mark.parametrize("name", CONVNETS)
def test_last_feature_map_size(name):
    """Total stride 32 with the ImageNet stem (7x7 at 224), 8 with the small-image one (4x4 at 32; VGG: 16)."""
    def last_map(side, stem):
        model = on_meta(name, ModelSpec((3, side, side), 10), stem=stem, **SMALL[name][0])
        pool = next(m for m in model.encoder.modules() if isinstance(m, nn.AdaptiveAvgPool2d))
        seen = []
        pool.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape[2:])))
        with torch.device("meta"):
            model.eval()(torch.empty(2, 3, side, side))
        return seen[0]

    assert last_map(224, "imagenet") == (7, 7)
    assert last_map(32, "cifar") == ((2, 2) if name == "vgg16_bn" else (4, 4))


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)], ids=["32x32x3", "28x28x1"])
@pytest.mark.parametrize("name", CONVNETS)
def test_forward_on_small_images(name, shape):
    torch.manual_seed(0)
    overrides, dim = SMALL[name]
    model = build_model(name, params(name, **overrides), ModelSpec(shape, 10))
    assert model.feature_dim == dim
    x = torch.randn(2, *shape)
    z, logits = model.forward_features(x)
    assert z.shape == (2, dim) and logits.shape == (2, 10)
    assert torch.isfinite(logits).all()
    model.eval()
    z_eval, logits_eval = model.forward_features(x)
    assert torch.allclose(logits_eval, model(x)) and torch.allclose(model.head(z_eval), logits_eval)


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv2", "shufflenetv2"])
def test_imagenet_stem_runs_on_a_small_width(name):
    overrides, dim = SMALL[name]
    model = build_model(name, params(name, stem="imagenet", **overrides), ModelSpec((3, 64, 64), 5)).eval()
    z, logits = model.forward_features(torch.randn(2, 3, 64, 64))
    assert z.shape == (2, dim) and logits.shape == (2, 5)


@pytest.mark.parametrize("name", CONVNETS + ["bilstm"])
def test_mapping_layers_and_bias_free_head(name):
    if name == "bilstm":
        spec, (overrides, dim) = ModelSpec((12,), 4, vocab_size=30), ({"hidden": 16}, 32)
        x = torch.randint(1, 30, (2, 12))
    else:
        spec, (overrides, dim), x = ModelSpec((3, 32, 32), 4), SMALL[name], torch.randn(2, 3, 32, 32)
    model = build_model(name, params(name, mapping=[128, 128], head_bias=False, **overrides), spec).eval()
    assert model.feature_dim == 128 and model.head.in_features == 128 and model.head.bias is None
    mapping = [m for m in model.encoder if isinstance(m, nn.Linear)][-2:]
    assert [(m.in_features, m.out_features) for m in mapping] == [(dim, 128), (128, 128)]
    z, logits = model.forward_features(x)
    assert z.shape == (2, 128) and logits.shape == (2, 4)
    assert (z >= 0).all(), "z is the last mapping layer's ReLU output"
    assert torch.allclose(logits, z @ model.head.weight.T, atol=1e-6)


# ---- levels for models/taps.py ------------------------------------------------------------------------

@pytest.mark.parametrize("name,shape,levels", [
    ("resnet18", (3, 16, 16), [8, 8, 16, 32, 64]),
    ("resnet50", (3, 128, 128), [8, 32, 64, 128, 256]),  # ImageNet stem
    ("mobilenetv2", (3, 16, 16), [8, 8, 8, 8, 16, 24, 40, 80, 1280]),
    ("mobilenetv3_small", (1, 16, 16), [8, 8, 8, 16, 16, 24, 144, 256]),
    ("shufflenetv2", (3, 16, 16), [24, 24, 48, 96, 1024]),  # half a stage: its right branch
    ("vgg16_bn", (3, 16, 16), [64, 128, 256, 512, 512]),
    ("vgg16_bn", (3, 224, 224), [64, 128, 256, 512, 512, 4096, 4096]),
])
def test_encoder_stages_give_one_level_per_stage(name, shape, levels):
    meta = on_meta(name, ModelSpec(shape, 10), **SMALL[name][0])
    assert len(encoder_stages(meta.encoder)) == len(levels)
    if name == "vgg16_bn" and shape[1] == 224:
        return  # 138 M parameters: the stage count above is the check
    torch.manual_seed(0)
    model = build_model(name, params(name, **SMALL[name][0]), ModelSpec(shape, 10)).eval()
    tap = FeatureTap()
    tap.attach(model.encoder, encoder_stages(model.encoder))
    model(torch.randn(2, *shape))
    assert [level.shape[1] for level in tap.collect()] == levels
    tap.detach()


def test_mobilenet_stage_levels_are_the_stage_outputs():
    # A linear-bottleneck stage ends without an activation: its pre-activation level is its output.
    torch.manual_seed(0)
    model = build_model("mobilenetv2", params("mobilenetv2", width=0.25), ModelSpec((3, 16, 16), 10)).eval()
    stages = encoder_stages(model.encoder)
    tap = FeatureTap()
    tap.attach(model.encoder, stages, preactivation=True)
    x = torch.randn(2, 3, 16, 16)
    model(x)
    pre = tap.collect()
    tap.attach(model.encoder, stages, preactivation=False)
    model(x)
    post = tap.collect()
    tap.detach()
    for level in range(1, 8):  # the seven inverted-residual stages
        assert torch.allclose(pre[level], post[level], atol=1e-6)
    assert not torch.allclose(pre[0], post[0]), "the stem's level is taken before its ReLU6"


# ---- bilstm ---------------------------------------------------------------------------------------------

def small_bilstm(vocab=50, length=10, **overrides):
    torch.manual_seed(0)
    settings = {"embed_dim": 16, "hidden": 12, **overrides}
    return build_model("bilstm", params("bilstm", **settings), ModelSpec((length,), 3, vocab_size=vocab)).eval()


def test_bilstm_forward_shape_and_defaults():
    model = build_model("bilstm", params("bilstm"), ModelSpec((20,), 5, vocab_size=100))
    assert model.feature_dim == 256
    ids = torch.randint(1, 100, (2, 20), dtype=torch.int64)
    ids[1, 12:] = 0
    z, logits = model.forward_features(ids)
    assert z.shape == (2, 256) and logits.shape == (2, 5)


def test_bilstm_ignores_padding():
    model = small_bilstm(layers=2)
    ids = torch.tensor([[5, 7, 9, 11, 0, 0], [3, 4, 0, 0, 0, 0]])
    with torch.no_grad():
        base = model(ids)
        padded = model(torch.cat([ids, torch.zeros(2, 7, dtype=torch.int64)], dim=1))
        left = model(torch.tensor([[0, 0, 5, 7, 9, 11], [0, 3, 0, 0, 4, 0]]))
        alone = model(ids[1:, :2])
        reordered = model(torch.tensor([[11, 9, 7, 5, 0, 0]]))
    assert torch.allclose(base, padded, atol=1e-6)
    assert torch.allclose(base, left, atol=1e-6)
    assert torch.allclose(base[1:], alone, atol=1e-6), "a row does not depend on the batch's longest row"
    assert not torch.allclose(base[:1], reordered, atol=1e-4), "token order matters"


def test_bilstm_all_padding_row_has_zero_features():
    model = small_bilstm()
    z, _ = model.forward_features(torch.tensor([[0, 0, 0], [4, 5, 0]]))
    assert torch.equal(z[0], torch.zeros(24)) and z[1].abs().sum() > 0


def test_bilstm_without_vocabulary_names_the_fix():
    with pytest.raises(ConfigError, match="vocab_size 0.*text dataset"):
        build_model("bilstm", params("bilstm"), ModelSpec((3, 32, 32), 10))


def test_bilstm_refuses_bad_token_ids():
    model = small_bilstm(vocab=10)
    with pytest.raises(ConfigError, match="token id 10 is outside the vocabulary"):
        model(torch.tensor([[1, 10, 0]]))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.rand(2, 5))


# ---- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONVNETS)
def test_convnets_refuse_token_ids(name):
    with pytest.raises(ConfigError, match="bilstm"):
        build_model(name, params(name), ModelSpec((20,), 2, vocab_size=100))


def test_vgg_refuses_images_too_small():
    with pytest.raises(ConfigError, match="at least 32x32.*stem: cifar"):
        on_meta("vgg16_bn", ModelSpec((1, 28, 28), 10), stem="imagenet")
    with pytest.raises(ConfigError, match="at least 16x16.*another model"):
        on_meta("vgg16_bn", ModelSpec((3, 12, 12), 10))


def test_bad_params_are_refused():
    with pytest.raises(ConfigError, match="width"):
        MODELS.parse_params("shufflenetv2", {"width": 0.75}, "model")
    with pytest.raises(ConfigError, match="stem"):
        MODELS.parse_params("resnet18", {"stem": "big"}, "model")
