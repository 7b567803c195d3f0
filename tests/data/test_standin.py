"""The stand-in source: the paper datasets' shapes, sizes, classes and domains; seeded, 8-bit, learnable."""
import numpy as np
import pytest
import torch

from fedguide.data.sources import DATASETS
from fedguide.data.sources._images import normalise
from fedguide.data.sources.standin import SHAPES, StandinParams, draw, load_standin, plan, standin_section
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError
from tests.tiny import tiny_config


def load(**params):
    return DATASETS.get("standin").obj(DATASETS.parse_params("standin", params, "data"))


@pytest.mark.parametrize("like, channels, side, train, test, classes", [
    ("cifar10", 3, 32, 50000, 10000, 10), ("cifar100", 3, 32, 50000, 10000, 100),
    ("tinyimagenet", 3, 64, 100000, 10000, 200), ("fmnist", 1, 28, 60000, 10000, 10),
    ("mnist", 1, 28, 60000, 10000, 10), ("svhn", 3, 32, 73257, 26032, 10), ("eurosat", 3, 64, 21600, 5400, 10),
    ("domainnet", 3, 32, 409832, 176743, 345), ("office_caltech", 3, 32, 2026, 507, 10),
    ("digits5", 3, 32, 678949, 56593, 10), ("imdb", 0, 256, 25000, 25000, 2),
])
def test_full_size_plan_is_the_datasets(like, channels, side, train, test, classes):
    p = plan(StandinParams(like=like))
    assert (p.channels, p.size, sum(p.train), sum(p.test), p.classes) == (channels, side, train, test, classes)


@pytest.mark.parametrize("like, shape, classes, domains", [
    ("cifar100", (3, 32, 32), 100, None), ("tinyimagenet", (3, 64, 64), 200, None), ("fmnist", (1, 28, 28), 10, None),
    ("office_caltech10", (3, 32, 32), 10, ["amazon", "caltech", "dslr", "webcam"]), ("imdb", (256,), 2, None),
])
def test_drawn_splits_have_the_shape_classes_and_domains(like, shape, classes, domains):
    n_train = 400 if domains else 2 * classes  # enough for every class in dslr's share (6 %) of 400
    s = load(like=like, train_size=n_train, test_size=n_train)
    assert s.input_shape == shape and s.num_classes == classes and s.domain_names == domains
    assert len(s.train_y) == len(s.test_y) == n_train
    assert set(s.train_y.tolist()) == set(range(classes)) and s.train_y.dtype == torch.int64
    if domains:  # every domain holds every class, in both splits
        for split_y, split_d in ((s.train_y, s.train_domains), (s.test_y, s.test_domains)):
            for d in range(len(domains)):
                assert set(split_y[split_d == d].tolist()) == set(range(classes))
    if like == "imdb":
        assert s.train_x.dtype == torch.int64 and s.vocab_size == 20000 and (s.train_x[:, -1] == 0).any()
    else:
        assert s.pixel_stats is not None and torch.allclose(s.unit_images(s.test_x[:4]).clamp(0, 1),
                                                            s.unit_images(s.test_x[:4]))


def test_images_are_8_bit_and_normalised_with_the_sources_statistics():
    params = StandinParams(like="cifar10", train_size=40, test_size=20)
    _, raw = draw(params)
    assert raw["train_x"].dtype == torch.uint8 and raw["test_x"].dtype == torch.uint8
    s = load_standin(params)
    mean, std = SHAPES["cifar10"].stats
    assert s.pixel_stats == (mean, std)
    assert torch.equal(s.train_x, normalise(raw["train_x"], mean, std))
    assert raw["train_x"].float().std() > 20  # not a flat image: noise and patterns span the 8-bit range


def test_same_parameters_same_data_and_the_seed_changes_it():
    a, b = load(like="cifar10", scale=0.002), load(like="cifar10", scale=0.002)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    c = load(like="cifar10", scale=0.002, generation_seed=1)
    assert not torch.equal(a.train_x, c.train_x)
    # The training images do not depend on the test split's size.
    d = load(like="cifar10", scale=0.002, test_size=50)
    assert torch.equal(a.train_x, d.train_x) and len(d.test_y) == 10  # 50 * 0.002 -> at least one per class


def test_a_domain_draws_the_same_images_in_any_subset():
    both = load(like="office_caltech10", scale=0.2, domains=["amazon", "dslr"])
    alone = load(like="office_caltech10", scale=0.2, domains=["dslr"])
    assert alone.domain_names == ["dslr"] and torch.equal(alone.train_x, both.train_x[both.train_domains == 1])
    assert not torch.equal(alone.train_x[:10], both.train_x[:10])  # amazon's images are others


def test_sizes_follow_classes_caps_and_totals():
    p = plan(StandinParams(like="domainnet", num_classes=90, domains=["clipart", "real"], max_train_per_class=30))
    assert p.train == [2700, 2700]  # 30 per class of 90, both domains larger than that
    assert p.test == [round(14604 * 90 / 345), round(52041 * 90 / 345)]
    q = plan(StandinParams(like="ham10000", train_size=1000))  # rosendahl, vidir_modern, vidir_molemax, vienna_dias
    assert q.train == [225, 336, 395, 44]  # shared out in proportion to 1807, 2690, 3163 and 351 images
    r = plan(StandinParams(like="cifar100", scale=0.001))
    assert r.train == [100] and r.test == [100]  # at least one image of every class


def test_image_size_and_channel_overrides():
    s = load(like="cifar10", image_size=16, channels=1, train_size=20, test_size=10)
    assert s.input_shape == (1, 16, 16) and s.pixel_stats == ((0.5,), (0.5,))


def test_classes_can_be_told_apart():
    s = load(like="cifar10", train_size=600, test_size=200)
    means = torch.stack([s.train_x[s.train_y == c].flatten(1).mean(0) for c in range(10)])
    accuracy = (torch.cdist(s.test_x.flatten(1), means).argmin(1) == s.test_y).float().mean()
    assert accuracy > 0.5  # nearest class mean; chance is 0.1


@pytest.mark.parametrize("params, words", [
    ({"like": "cifar11"}, "cifar10, cifar100"), ({"like": "imdb", "image_size": 32}, "token data"),
    ({"like": "cifar10", "vocab_size": 100}, "images"), ({"like": "cifar10", "domains": ["a"]}, "has no domains"),
    ({"like": "domainnet", "domains": ["clipart", "nowhere"]}, "choose from"),
])
def test_bad_parameters_are_sentences(params, words):
    with pytest.raises(ConfigError, match=words):
        load(**params)


def test_data_fraction_is_honoured():
    cfg = tiny_config(data={"name": "standin", "like": "cifar10", "train_size": 400, "test_size": 50,
                            "fraction": 0.25}, model={"name": "cnn"})
    prepared = prepare(cfg)
    used = np.concatenate(prepared.data.client_indices)
    assert len(used) == 100 and len(prepared.data.splits.train_y) == 400
    assert np.bincount(prepared.data.splits.train_y.numpy()[used], minlength=10).tolist() == [10] * 10


def test_a_real_sources_section_becomes_its_standin():
    assert standin_section("domainnet", {"domains": ["clipart"], "num_classes": 90, "max_train_per_class": 30,
                                         "image_size": 224, "root": "/data"}) == {
        "name": "standin", "like": "domainnet", "image_size": 224, "domains": ["clipart"], "num_classes": 90,
        "max_train_per_class": 30}
    assert standin_section("cifar100", {"label": "coarse"})["num_classes"] == 20
    assert standin_section("domainnet", {"subset": "ten"})["num_classes"] == 10
    assert standin_section("office_caltech10", {"test_fraction": 0.2})["like"] == "office_caltech10"
    assert standin_section("imdb", {"vocab_size": 5000, "max_len": 64}) == {
        "name": "standin", "like": "imdb", "vocab_size": 5000, "max_len": 64}
    with pytest.raises(ConfigError, match="no stand-in equivalent"):
        standin_section("cifar10", {"colour": "blue"})
    with pytest.raises(ConfigError, match="not a dataset the stand-in knows"):
        standin_section("imagefolder", {})
