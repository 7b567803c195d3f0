"""digits_domains: three generated digit domains (UCI handwriting, font renders, MNIST-M-like blends)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedguide.data.sources import DATASETS
from fedguide.data.sources.digits_domains import (
    DOMAIN_NAMES,
    MEAN,
    STD,
    DigitsDomainsParams,
    load_digits_domains,
    preview_grid,
    stratified_split,
)
from fedguide.registry import ConfigError

UCI_TOTAL = 1797


@pytest.fixture(scope="module")
def default():
    return load_digits_domains(DigitsDomainsParams())


@pytest.fixture(scope="module")
def small():
    return load_digits_domains(DigitsDomainsParams(per_class=20))


def domain_part(splits, name, test=False):
    if test:
        x, y, d = splits.test_x, splits.test_y, splits.test_domains
    else:
        x, y, d = splits.train_x, splits.train_y, splits.train_domains
    keep = d == DOMAIN_NAMES.index(name)
    return x[keep], y[keep]


def pixels(x):
    """Back to 0..1 pixel values."""
    return x * STD + MEAN


def test_shapes_dtypes_and_sizes(default):
    s = default
    assert s.train_x.dtype == torch.float32 and s.test_x.dtype == torch.float32
    assert s.train_y.dtype == torch.int64 and s.train_domains.dtype == torch.int64
    assert s.train_x.shape[1:] == (3, 32, 32) and s.input_shape == (3, 32, 32)
    assert s.train_x.is_contiguous() and s.test_x.is_contiguous()
    assert len(s.train_y) == len(s.train_x) == len(s.train_domains)
    assert len(s.test_y) == len(s.test_x) == len(s.test_domains)
    assert s.class_names == [str(d) for d in range(10)] and s.num_classes == 10
    assert s.domain_names == ["uci", "fonts", "mnistm_like"]
    counts = {n: (len(domain_part(s, n)[1]), len(domain_part(s, n, test=True)[1])) for n in DOMAIN_NAMES}
    assert sum(counts["uci"]) == UCI_TOTAL
    assert counts["fonts"] == counts["mnistm_like"] == (1440, 360)  # 180 per class, 20 % held out


def test_every_class_in_every_domain_and_split(small):
    for name in DOMAIN_NAMES:
        for test in (False, True):
            _, y = domain_part(small, name, test)
            counts = torch.bincount(y, minlength=10)
            assert counts.min() >= 1, (name, test, counts)
            if name != "uci":
                assert len(set(counts.tolist())) == 1  # stratified: equal per class in synthetic domains
    assert len(domain_part(small, "fonts", test=True)[1]) == 40  # round(20 * 0.2) per class


def test_normalised_with_the_fixed_constants(default):
    # MEAN/STD were computed from this very train split; a change to a renderer that shifts them shows here.
    assert abs(default.train_x.mean().item()) < 0.01
    assert default.train_x.std().item() == pytest.approx(1.0, abs=0.01)
    assert pixels(default.train_x).min() >= -1e-5 and pixels(default.train_x).max() <= 1 + 1e-5


def test_generation_is_deterministic(small):
    again = load_digits_domains(DigitsDomainsParams(per_class=20))
    for field in ("train_x", "train_y", "test_x", "test_y", "train_domains", "test_domains"):
        assert torch.equal(getattr(small, field), getattr(again, field)), field


def test_uci_domain_does_not_depend_on_per_class(default, small):
    # Each domain draws from its own stream, so the synthetic domains' size leaves the uci images alone.
    for test in (False, True):
        assert torch.equal(domain_part(default, "uci", test)[0], domain_part(small, "uci", test)[0])


def test_other_generation_seed_gives_other_images(small):
    other = load_digits_domains(DigitsDomainsParams(per_class=20, generation_seed=1))
    for name in ("fonts", "mnistm_like"):
        a, b = domain_part(small, name)[0], domain_part(other, name)[0]
        assert a.shape == b.shape
        assert (a - b).abs().mean() > 0.3  # not a shuffle of the same images: the pixels differ broadly
    assert not torch.equal(domain_part(small, "uci")[1], domain_part(other, "uci")[1])  # another split


def test_image_size_param():
    s = load_digits_domains(DigitsDomainsParams(image_size=28, per_class=10))
    assert s.train_x.shape[1:] == (3, 28, 28) and s.test_x.shape[1:] == (3, 28, 28)
    # The uci digit sits in a centred 20x20 box, MNIST's layout: the outer 4-pixel frame is black.
    uci = pixels(domain_part(s, "uci")[0])
    assert uci[..., :4, :].abs().max() < 1e-5 and uci[..., 24:, :].abs().max() < 1e-5
    assert uci[..., 4:24, 4:24].amax(dim=(1, 2, 3)).min() > 0.5


def test_domains_differ_in_distribution(default):
    stats = {}
    for name in DOMAIN_NAMES:
        x = pixels(domain_part(default, name)[0])
        stats[name] = {
            "brightness": x.mean().item(),
            "channel_spread": x.std(dim=1).mean().item(),  # colour: how far the channels of a pixel differ
            "dark_share": (x.amax(dim=1) < 0.05).float().mean().item(),
        }
    uci, fonts, mnistm = stats["uci"], stats["fonts"], stats["mnistm_like"]
    assert uci["channel_spread"] < 1e-6  # grey
    assert fonts["channel_spread"] > 0.05 and mnistm["channel_spread"] > 0.05
    assert uci["dark_share"] > 0.5  # mostly black background
    assert fonts["dark_share"] < 0.1 and mnistm["dark_share"] < 0.2
    for a, b in (("uci", "fonts"), ("uci", "mnistm_like"), ("fonts", "mnistm_like")):
        assert abs(stats[a]["brightness"] - stats[b]["brightness"]) > 0.05, (a, b, stats)
    # The fonts' background is one colour; the photo crops are textured.
    def border_spread(name):
        x = pixels(domain_part(default, name)[0])
        return x[:, :, :3, :].std(dim=(2, 3)).mean().item()

    assert border_spread("mnistm_like") > 2 * border_spread("fonts")


def ink_map(x):
    """Distance of each pixel from the image's border colour, 16x16: colour and contrast polarity removed,
    shape kept. Linear models cannot undo the fonts' random ink/background colours on raw pixels."""
    border = torch.cat([x[:, :, 0, :], x[:, :, -1, :], x[:, :, :, 0], x[:, :, :, -1]], dim=2)
    background = border.median(dim=2).values[:, :, None, None]
    ink = (x - background).abs().amax(dim=1, keepdim=True)
    ink = ink / ink.flatten(1).amax(dim=1).clamp(min=1e-6)[:, None, None, None]
    return F.avg_pool2d(ink, 2).flatten(1).numpy()


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # an early stop suffices here
def test_each_domain_is_learnable(default):
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # BLAS threads only add contention on a busy machine at this size
        for name in DOMAIN_NAMES:
            x, y = domain_part(default, name)
            tx, ty = domain_part(default, name, test=True)
            clf = LogisticRegression(max_iter=100, C=0.1).fit(ink_map(x), y.numpy())
            accuracy = clf.score(ink_map(tx), ty.numpy())
            assert accuracy > 0.5, (name, accuracy)  # chance is 0.1


def test_stratified_split_properties():
    labels = np.repeat(np.arange(3), [10, 5, 7])
    train, test = stratified_split(labels, 0.2, np.random.default_rng(0))
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(labels)))
    assert np.bincount(labels[test]).tolist() == [2, 1, 1]
    with pytest.raises(ConfigError, match="test_fraction"):
        stratified_split(labels, 0.05, np.random.default_rng(0))


def test_bad_params_are_config_errors():
    with pytest.raises(ConfigError, match="per_class"):
        load_digits_domains(DigitsDomainsParams(per_class=2, test_fraction=0.1))  # no test image per class
    with pytest.raises(ConfigError, match="valid keys"):
        DATASETS.parse_params("digits_domains", {"per_clas": 10}, "data")
    with pytest.raises(ConfigError, match="image_size"):
        DATASETS.parse_params("digits_domains", {"image_size": 4}, "data")


def test_registered_and_preview(small, tmp_path):
    from PIL import Image

    entry = DATASETS.get("digits_domains")
    assert entry.params is DigitsDomainsParams
    path = tmp_path / "preview.png"
    preview_grid(small, path, per_class=2, scale=1)
    image = np.asarray(Image.open(path))
    assert image.shape == (3 * 2 * 32, 10 * 32, 3)
    # The first uci tile is the test split's first uci "0", so the sheet shows the data, not a blank.
    first_zero = pixels(small.test_x[(small.test_y == 0) & (small.test_domains == 0)][0])
    expected = (first_zero.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.abs(image[:32, :32].astype(int) - expected.astype(int)).max() <= 1
