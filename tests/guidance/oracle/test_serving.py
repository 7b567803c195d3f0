"""The oracle behind the guidance interfaces: prompts name classes, block features are f(x) plus the prompt's
prototype at every block and timestep, the image encoder's zero-shot is the nearest class mean, and whatever
would sample is refused with the fix."""
import pytest
import torch
import torch.nn.functional as F

from fedguide.guidance.condition import ConditionMap, inject
from fedguide.guidance.hooks import unet_features
from fedguide.guidance.oracle.network import OracleNet, oracle_input
from fedguide.guidance.oracle.serving import OracleGuidance, prompt_class
from fedguide.guidance.oracle.training import TrainedOracle
from fedguide.guidance.shared import class_prompts
from fedguide.registry import ConfigError

NAMES = ["T-shirt/top", "Trouser", "Shirt", "man", "woman"]
WIDTH = 16


@pytest.fixture(scope="module")
def oracle():
    torch.manual_seed(0)
    net = OracleNet(len(NAMES), WIDTH, (4, 8, 8)).eval().requires_grad_(False)
    prototypes = torch.randn(len(NAMES), WIDTH)
    return OracleGuidance(TrainedOracle(net, prototypes, {}), NAMES, "oracle@test", {"model": "oracle"})


def images(n, seed=0):
    return torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_prompts_name_classes_by_whole_words_longest_first():
    names = [n.lower() for n in NAMES]
    assert [prompt_class(p, names) for p in class_prompts(NAMES)] == [0, 1, 2, 3, 4]
    assert prompt_class("a photo of a woman", names) == 4  # not "man"
    assert prompt_class("Shirt", names) == 2
    assert prompt_class("", names) is None and prompt_class("a photo of a similar object", names) is None


def test_text_embeddings_are_class_prototypes_and_zeros_for_no_class(oracle):
    text = oracle.encode_text(["a photo of a trouser", "", "a photo of a visual object"])
    assert text.tokens.shape == (3, 1, WIDTH) and oracle.context_dim == WIDTH
    torch.testing.assert_close(text.pooled[0], oracle.prototypes[1])
    assert not text.pooled[1:].any()


def test_block_features_are_f_plus_the_prompts_prototype_at_every_block_and_timestep(oracle):
    x = images(3)
    latents = oracle.encode_image(x)
    assert latents.shape == (3, 3, 32, 32)
    noisy, _ = oracle.add_noise(latents, 150)
    assert torch.equal(noisy, latents)  # nothing is noised
    f = oracle.net.features(oracle_input(x))
    prompts = oracle.encode_text(["", "a photo of a shirt", "a photo of a man"]).tokens
    layers = ["up.1", "up.2", "up.3", "mid", "down.0"]
    maps = unet_features(oracle, latents, 150, prompts, layers)
    assert list(maps) == layers and all(m.shape == (3, WIDTH, 1, 1) for m in maps.values())
    want = f + torch.stack([torch.zeros(WIDTH), oracle.prototypes[2], oracle.prototypes[3]])
    for m in maps.values():
        torch.testing.assert_close(m[:, :, 0, 0], want)
    torch.testing.assert_close(unet_features(oracle, latents, 0, prompts, ["up.1"])["up.1"], maps["up.1"])
    # FedDifRC's client condition appended as a further token is not read
    cmap = ConditionMap(7, oracle.context_dim, seed=0)
    appended = inject(prompts, torch.randn(3, 7), "append", cmap)
    torch.testing.assert_close(unet_features(oracle, latents, 0, appended, ["up.1"])["up.1"], maps["up.1"])


def test_layer_names_are_checked(oracle):
    latents, context = oracle.encode_image(images(1)), oracle.encode_text([""]).tokens
    with pytest.raises(ConfigError, match="4 up blocks"):
        unet_features(oracle, latents, 0, context, ["up.4"])
    with pytest.raises(ConfigError, match="unknown UNet layer"):
        unet_features(oracle, latents, 0, context, ["decoder"])


def test_image_encoder_embeds_f_and_zero_shot_is_the_nearest_class_mean(oracle):
    enc, x = oracle.image_encoder, images(4, seed=1)
    torch.testing.assert_close(enc.embed(x), oracle.net.features(oracle_input(x)))
    assert enc.dim == WIDTH and enc.can_zero_shot
    prompts = class_prompts(NAMES)
    scores = enc.zero_shot(x, prompts)
    torch.testing.assert_close(scores, F.normalize(enc.embed(x), dim=1) @ F.normalize(oracle.prototypes, dim=1).T)
    with pytest.raises(ConfigError, match="names none"):
        enc.embed_text(["a photo of a similar object"])


def test_sampling_and_other_sizes_are_refused_with_the_fix(oracle):
    latents, context = oracle.encode_image(images(1)), oracle.encode_text([""]).tokens
    for call in (lambda: oracle.eps(latents, 10, context), lambda: oracle.decode(latents),
                 lambda: oracle.predict_x0(latents, 10, latents)):
        with pytest.raises(ConfigError, match="serves features only.*guidance.model=embedded"):
            call()
    with pytest.raises(ConfigError, match="32 px only.*method.image_size=paper"):
        oracle.encode_image(images(1), size=28)
    with pytest.raises(ConfigError, match="no image-embedding conditioning"):
        oracle.condition_inputs(context, image_embeds=torch.zeros(1, 4))
