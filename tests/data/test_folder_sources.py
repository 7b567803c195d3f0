"""Image-folder sources, their dataset presets and IMDB, on tiny fixtures written in each real layout.

Every fixture image is one flat colour: red encodes the class, green the domain, blue the file, so a
test can tell from the loaded tensor which file landed where.
"""
import csv
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedguide.data.sources import DATASETS, _files
from fedguide.data.sources import folder_presets as fp
from fedguide.data.sources import imdb
from fedguide.data.sources._images import IMAGENET_MEAN, IMAGENET_STD
from fedguide.registry import ConfigError

SIZE = 8


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Only what a test writes is found, and nothing is ever downloaded."""
    monkeypatch.setenv("FEDGUIDE_DATA", str(tmp_path / "data-home"))
    monkeypatch.setenv("FEDGUIDE_OFFLINE", "1")

    def no_download(*a, **k):
        raise AssertionError("download attempted although FEDGUIDE_OFFLINE=1")

    monkeypatch.setattr(_files, "download_file", no_download)


def load(name, **params):
    entry = DATASETS.get(name)
    return entry.obj(entry.params.model_validate({"image_size": SIZE, **params} if name != "imdb" else params))


def write_image(path: Path, rgb, fmt=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (SIZE, SIZE), tuple(int(v) for v in rgb)).save(path, format=fmt)
    return path


def colour(label: int, domain: int, index: int):
    return (20 + 20 * label, 20 + 30 * domain, 10 + 12 * index)


def write_tree(root: Path, domains, classes, per_class=5, suffix=".png", sub=""):
    """root/<domain>[/sub]/<class>/img<i><suffix>; returns the written paths."""
    paths = []
    for d, domain in enumerate(domains):
        for c, cls in enumerate(classes):
            for i in range(per_class):
                base = root / domain / sub if domain else root / sub
                paths.append(write_image(base / cls / f"img{i}{suffix}", colour(c, d, i)))
    return paths


def rgb_of(x: torch.Tensor) -> np.ndarray:
    """[N, 3] mean pixel value (0..255) of every image, the normalisation undone."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x * std + mean).mul(255).mean(dim=(2, 3)).numpy()


def written(x: torch.Tensor) -> list[tuple[int, int, int]]:
    """(class, domain, file) indices each image was written with, read back from its colour."""
    rgb = rgb_of(x)
    return [(round((r - 20) / 20), round((g - 20) / 30), round((b - 10) / 12)) for r, g, b in rgb]


def corrupt(path: Path) -> Path:
    path.write_bytes(b"this is not an image")
    return path


def assert_layout_error(exc, *fragments):
    msg = str(exc.value)
    assert "Expected layout" in msg, msg
    for f in fragments:
        assert str(f) in msg, (f, msg)


# ---- imagefolder ---------------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "tree"
    write_tree(root, ["b_dom", "a_dom"], ["cat", "Dog"])  # name order on disk differs from sorted order
    return root


def test_imagefolder_shapes_names_and_pixels(tree):
    s = load("imagefolder", root=str(tree))
    assert s.train_x.shape == (16, 3, SIZE, SIZE) and s.test_x.shape == (4, 3, SIZE, SIZE)
    assert s.train_x.dtype == torch.float32 and s.train_x.is_contiguous()
    for t in (s.train_y, s.test_y, s.train_domains, s.test_domains):
        assert t.dtype == torch.int64
    assert s.class_names == ["cat", "Dog"]  # case-insensitive order
    assert s.domain_names == ["a_dom", "b_dom"]
    for x, y, dom in ((s.train_x, s.train_y, s.train_domains), (s.test_x, s.test_y, s.test_domains)):
        rgb = rgb_of(x)
        assert np.allclose(rgb[:, 0], 20 + 20 * y.numpy(), atol=1.5)
        written_domain = np.where(dom.numpy() == 0, 1, 0)  # a_dom (id 0) was written second
        assert np.allclose(rgb[:, 1], 20 + 30 * written_domain, atol=1.5)
    # Sorted by domain, then class.
    key = s.train_domains * 10 + s.train_y
    assert torch.equal(key, key.sort().values)
    assert torch.bincount(s.test_domains * 2 + s.test_y).tolist() == [1, 1, 1, 1]


def test_imagefolder_is_deterministic_and_seeded(tree):
    a, b = load("imagefolder", root=str(tree)), load("imagefolder", root=str(tree))
    for k in ("train_x", "train_y", "test_x", "test_domains"):
        assert torch.equal(getattr(a, k), getattr(b, k))
    c = load("imagefolder", root=str(tree), split_seed=7)
    assert not np.allclose(rgb_of(a.test_x)[:, 2], rgb_of(c.test_x)[:, 2]), "another seed, other test files"


def test_imagefolder_selects_and_orders_domains_and_classes(tree):
    s = load("imagefolder", root=str(tree), domains=["b_dom", "a_dom"], classes=["Dog"])
    assert s.domain_names == ["b_dom", "a_dom"] and s.class_names == ["Dog"]
    rgb = rgb_of(s.train_x)
    assert np.allclose(rgb[s.train_domains.numpy() == 0, 1], 20, atol=1.5)  # b_dom was written first
    assert np.allclose(rgb[:, 0], 40, atol=1.5)
    with pytest.raises(ConfigError, match="c_dom"):
        load("imagefolder", root=str(tree), domains=["c_dom"])


def test_imagefolder_class_missing_in_a_domain(tree):
    write_image(tree / "a_dom" / "bird" / "x.png", (1, 2, 3))
    s = load("imagefolder", root=str(tree), domains=["a_dom"], classes=["bird", "cat"], test_fraction=0.5)
    assert s.class_names == ["bird", "cat"]
    with pytest.raises(ConfigError, match="bird") as exc:
        load("imagefolder", root=str(tree), classes=["bird"])
    assert_layout_error(exc, "b_dom")


def test_imagefolder_explicit_split_layout(tmp_path):
    root = tmp_path / "split"
    write_tree(root, ["d1"], ["a", "b"], per_class=3, sub="train")
    write_tree(root, ["d1"], ["a", "b"], per_class=2, sub="test")
    write_tree(root, ["d2"], ["a", "b"], per_class=5)  # no own split: seeded fraction
    s = load("imagefolder", root=str(root), test_fraction=0.4)
    d1_train, d1_test = (s.train_domains == 0).sum().item(), (s.test_domains == 0).sum().item()
    assert (d1_train, d1_test) == (6, 4), "the folders' own split is kept, test_fraction ignored"
    assert (s.test_domains == 1).sum().item() == 4  # 2 of 5 per class


def test_imagefolder_without_domains(tmp_path):
    write_tree(tmp_path / "flat", [""], ["x", "y"], per_class=5)
    s = load("imagefolder", root=str(tmp_path / "flat"), domain_level=False)
    assert s.domain_names is None and s.train_domains is None
    assert s.class_names == ["x", "y"] and len(s.train_y) == 8
    split = tmp_path / "flat_split"
    write_tree(split, [""], ["x", "y"], per_class=2, sub="train")
    write_tree(split, [""], ["x", "y"], per_class=1, sub="test")
    s = load("imagefolder", root=str(split), domain_level=False)
    assert (len(s.train_y), len(s.test_y)) == (4, 2)
    with pytest.raises(ConfigError, match="domain_level: false"):
        load("imagefolder", root=str(split))


def test_seeded_split_is_stratified_and_per_group(tmp_path):
    root = tmp_path / "strat"
    for d, dom in enumerate(["d1", "d2"]):
        for c, (cls, n) in enumerate([("a", 10), ("b", 5), ("c", 2), ("d", 1)]):
            for i in range(n):
                write_image(root / dom / cls / f"{i:02d}.png", colour(c, d, i))
    s = load("imagefolder", root=str(root), test_fraction=0.3)
    counts = torch.bincount(s.test_domains * 4 + s.test_y, minlength=8).tolist()
    assert counts == [3, 2, 1, 0] * 2  # round(n * 0.3), >= 1 once a class has 2, never all of them
    # A domain's split does not depend on which other domains are loaded.
    only = load("imagefolder", root=str(root), test_fraction=0.3, domains=["d2"])
    both_d2 = rgb_of(s.test_x)[s.test_domains.numpy() == 1]
    assert np.allclose(np.sort(rgb_of(only.test_x), axis=0), np.sort(both_d2, axis=0))


def test_imagefolder_missing_root_and_corrupt_file(tmp_path, tree):
    with pytest.raises(ConfigError) as exc:
        load("imagefolder", root=str(tmp_path / "nowhere"))
    assert_layout_error(exc, "nowhere", "root/<domain>/<class>/")
    with pytest.raises(ConfigError, match="data.root"):
        load("imagefolder")
    bad = corrupt(tree / "a_dom" / "cat" / "img3.png")
    with pytest.raises(ConfigError) as exc:
        load("imagefolder", root=str(tree))
    assert_layout_error(exc, bad)
    for f in (tree / "a_dom" / "Dog").iterdir():
        f.rename(f.with_suffix(".gif"))
    with pytest.raises(ConfigError, match="no .jpg"):
        load("imagefolder", root=str(tree), domains=["a_dom"], classes=["Dog"])


# ---- max_train_per_class (every image source) -----------------------------------------------------

def counts(domains: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[int]:
    return torch.bincount(domains * num_classes + labels, minlength=2 * num_classes).tolist()


@pytest.fixture
def uneven(tmp_path):
    """Two domains; class a has 10 images, class b 3: the seeded split sends 2 and 1 to test."""
    root = tmp_path / "uneven"
    for d, dom in enumerate(["d1", "d2"]):
        for c, (cls, n) in enumerate([("a", 10), ("b", 3)]):
            for i in range(n):
                write_image(root / dom / cls / f"{i:02d}.png", colour(c, d, i))
    return root


def test_max_train_per_class_caps_training_only(uneven):
    full = load("imagefolder", root=str(uneven))
    capped = load("imagefolder", root=str(uneven), max_train_per_class=4)
    assert counts(full.train_domains, full.train_y, 2) == [8, 2, 8, 2]
    assert counts(capped.train_domains, capped.train_y, 2) == [4, 2, 4, 2], "a group under the cap keeps all"
    for k in ("test_x", "test_y", "test_domains"):
        assert torch.equal(getattr(full, k), getattr(capped, k)), "the test split is untouched by the cap"
    assert set(written(capped.train_x)) < set(written(full.train_x)), "kept images come from the training side"
    again = load("imagefolder", root=str(uneven), max_train_per_class=4)
    assert torch.equal(capped.train_x, again.train_x) and torch.equal(capped.train_y, again.train_y)
    # The draw of one (domain, class) does not depend on which other domains are loaded ...
    d2 = load("imagefolder", root=str(uneven), max_train_per_class=4, domains=["d2"])
    assert sorted(written(d2.train_x)) == sorted(f for f in written(capped.train_x) if f[1] == 1)
    # ... but moves with split_seed, the seed of the split, never the run's.
    other = load("imagefolder", root=str(uneven), max_train_per_class=4, split_seed=3)
    assert set(written(other.train_x)) != set(written(capped.train_x))
    assert DATASETS.get("imagefolder").params().max_train_per_class is None


def test_max_train_per_class_is_validated_and_offered_everywhere():
    entry = DATASETS.get("imagefolder")
    with pytest.raises(Exception, match="max_train_per_class"):
        entry.params.model_validate({"root": "x", "max_train_per_class": 0})
    for name in ("office_caltech10", "domainnet", "nicopp", "nicopp_unique", "openimage_feddisc", "ham10000",
                 "eurosat"):
        assert DATASETS.get(name).params().max_train_per_class is None, name
    assert DATASETS.get("openimage_fedcado").params().max_train_per_class == 30


def test_max_train_per_class_with_official_split_lists(tmp_path):
    root = tmp_path / "dn"
    write_tree(root, ["clipart"], ["zebra", "aircraft_carrier"], per_class=6, suffix=".jpg")
    for split, ids in (("train", range(5)), ("test", [5])):
        (root / f"clipart_{split}.txt").write_text("".join(
            f"clipart/{c}/img{i}.jpg 0\n" for c in ("zebra", "aircraft_carrier") for i in ids))
    s = load("domainnet", root=str(root), domains=["clipart"], max_train_per_class=2)
    assert torch.bincount(s.train_y).tolist() == [2, 2]
    assert sorted(i for _, _, i in written(s.test_x)) == [5, 5], "exactly the listed test images"
    assert {i for _, _, i in written(s.train_x)} <= {0, 1, 2, 3, 4}


def test_max_train_per_class_on_nicopp(tmp_path):
    images = tmp_path / "NICO_DG"
    write_tree(images, fp.NICO_DOMAINS, ["bear", "airplane"], per_class=5, suffix=".jpg")
    full = load("nicopp", root=str(images))
    capped = load("nicopp", root=str(images), max_train_per_class=3)
    assert (len(full.train_y), len(capped.train_y)) == (48, 36)
    assert torch.bincount(capped.train_domains * 2 + capped.train_y).tolist() == [3] * 12
    assert torch.equal(full.test_x, capped.test_x)


# ---- Office-Caltech-10 ---------------------------------------------------------------------------

@pytest.fixture
def office(tmp_path):
    root = tmp_path / "data-home" / "office_caltech_10"  # found through FEDGUIDE_DATA
    write_tree(root, fp.OFFICE_DOMAINS, fp.OFFICE_CLASSES, per_class=2, suffix=".jpg")
    return root


def test_office_caltech10(office):
    s = load("office_caltech10")
    assert s.domain_names == ["amazon", "caltech", "dslr", "webcam"]
    assert s.class_names == fp.OFFICE_CLASSES
    assert (len(s.train_y), len(s.test_y)) == (40, 40)
    two = load("office_caltech10", root=str(office), classes=["mug", "bike"], domains=["webcam", "dslr"])
    assert two.class_names == ["mug", "bike"] and two.domain_names == ["webcam", "dslr"]
    assert np.allclose(rgb_of(two.train_x)[:, 0], 20 + 20 * np.where(two.train_y.numpy() == 0, 8, 1), atol=3)
    with pytest.raises(ConfigError, match="bicycle"):
        load("office_caltech10", classes=["bicycle"])


def test_office_caltech10_missing_and_corrupt(tmp_path, office):
    with pytest.raises(ConfigError) as exc:
        load("office_caltech10", root=str(tmp_path / "empty"), domains=["amazon", "zzz"])
    assert "zzz" in str(exc.value)
    (office / "dslr").rename(tmp_path / "moved")
    with pytest.raises(ConfigError) as exc:
        load("office_caltech10")
    assert_layout_error(exc, "Office-Caltech-10 not found", "amazon,caltech,dslr,webcam", "back_pack")
    bad = corrupt(office / "amazon" / "mug" / "img0.jpg")
    with pytest.raises(ConfigError) as exc:
        load("office_caltech10", domains=["amazon"])
    assert_layout_error(exc, bad)


# ---- DomainNet -----------------------------------------------------------------------------------

DN_CLASSES = ["zebra", "The_Eiffel_Tower", "aircraft_carrier"]


@pytest.fixture
def domainnet(tmp_path):
    root = tmp_path / "domainnet"
    write_tree(root, fp.DOMAINNET_DOMAINS, DN_CLASSES, per_class=3, suffix=".jpg")
    return root


def test_domainnet_from_folders(domainnet):
    s = load("domainnet", root=str(domainnet))
    assert s.domain_names == fp.DOMAINNET_DOMAINS
    assert s.class_names == ["aircraft_carrier", "The_Eiffel_Tower", "zebra"]  # the official order
    assert (len(s.train_y), len(s.test_y)) == (36, 18)
    first2 = load("domainnet", root=str(domainnet), num_classes=2, domains=["real"])
    assert first2.class_names == ["aircraft_carrier", "The_Eiffel_Tower"] and first2.domain_names == ["real"]
    with pytest.raises(ConfigError, match="not several"):
        load("domainnet", root=str(domainnet), num_classes=2, subset="ten")


def test_domainnet_honours_split_lists(domainnet):
    (domainnet / "splits").mkdir()
    lines = {"train": ["clipart/zebra/img0.jpg 344", "clipart/zebra/img1.jpg 344",
                       "clipart/aircraft_carrier/img2.jpg 0"],
             "test": ["clipart/zebra/img2.jpg 344", "clipart/aircraft_carrier/img0.jpg 0",
                      "clipart/aircraft_carrier/img1.jpg 0", "clipart/The_Eiffel_Tower/img0.jpg 300"]}
    for split, rows in lines.items():
        (domainnet / "splits" / f"clipart_{split}.txt").write_text("\n".join(rows) + "\n")
    s = load("domainnet", root=str(domainnet), domains=["clipart", "real"], classes=["zebra", "aircraft_carrier"])
    # zebra was written as class 0, aircraft_carrier as class 2; clipart is written domain 0
    clip_train = [(c, i) for c, d, i in written(s.train_x) if d == 0]
    clip_test = [(c, i) for c, d, i in written(s.test_x) if d == 0]
    assert sorted(clip_train) == [(0, 0), (0, 1), (2, 2)]
    assert sorted(clip_test) == [(0, 2), (2, 0), (2, 1)]
    assert (s.train_domains == 1).sum().item() == 4  # 'real' has no lists: seeded split, 2 of 3 in train
    assert s.class_names == ["zebra", "aircraft_carrier"] and set(s.train_y[s.train_domains == 0].tolist()) == {0, 1}


def test_domainnet_split_list_errors(domainnet):
    (domainnet / "clipart_train.txt").write_text("clipart/zebra/img9.jpg 344\n")
    with pytest.raises(ConfigError, match="partner"):
        load("domainnet", root=str(domainnet), domains=["clipart"])
    (domainnet / "clipart_test.txt").write_text("clipart/zebra/img0.jpg 344\n")
    with pytest.raises(ConfigError) as exc:
        load("domainnet", root=str(domainnet), domains=["clipart"])
    assert_layout_error(exc, "img9.jpg", "clipart_train.txt")
    (domainnet / "clipart_train.txt").write_text("zebra_img0.jpg\n")
    with pytest.raises(ConfigError, match="line 1"):
        load("domainnet", root=str(domainnet), domains=["clipart"])


def test_domainnet_ten_subset(tmp_path):
    root = tmp_path / "dn10"
    write_tree(root, fp.DOMAINNET_DOMAINS, fp.DOMAINNET_TEN + ["zigzag"], per_class=2, suffix=".jpg")
    s = load("domainnet", root=str(root), subset="ten")
    assert s.class_names == fp.DOMAINNET_TEN and len(s.train_y) == 60
    assert not (rgb_of(s.train_x)[:, 0] > 20 + 20 * 9 + 3).any(), "zigzag is not in the subset"


def test_domainnet_missing_and_corrupt(tmp_path, domainnet):
    with pytest.raises(ConfigError) as exc:
        load("domainnet", root=str(tmp_path / "none"))
    assert_layout_error(exc, "DomainNet not found", "clipart_train.txt", fp.DOMAINNET_URLS["clipart"])
    bad = corrupt(domainnet / "sketch" / "zebra" / "img1.jpg")
    with pytest.raises(ConfigError) as exc:
        load("domainnet", root=str(domainnet))
    assert_layout_error(exc, bad)


# ---- NICO++ --------------------------------------------------------------------------------------

@pytest.fixture
def nico(tmp_path):
    images = tmp_path / "NICOpp" / "NICO_DG"
    write_tree(images, fp.NICO_DOMAINS, ["bear", "airplane"], per_class=2, suffix=".jpg")
    return images


def test_nicopp_from_folders_and_official_lists(nico):
    s = load("nicopp", root=str(nico.parent))  # finds NICO_DG below the root
    assert s.domain_names == fp.NICO_DOMAINS and s.class_names == ["airplane", "bear"]
    assert (len(s.train_y), len(s.test_y)) == (12, 12)
    lists = nico.parent / "NICO_DG_official"
    lists.mkdir()
    (lists / "rock_train.txt").write_text("".join(f"/data/NICO_DG/rock/{c}/img{i}.jpg {k}\n" for k, c in
                                                  enumerate(["airplane", "bear"]) for i in range(2)))
    (lists / "rock_test.txt").write_text("/data/NICO_DG/rock/bear/img1.jpg 1\n")
    s = load("nicopp", root=str(nico), domains=["rock", "dim"])
    assert ((s.train_domains == 0).sum().item(), (s.test_domains == 0).sum().item()) == (4, 1)


def test_nicopp_missing_and_corrupt(tmp_path, nico):
    with pytest.raises(ConfigError) as exc:
        load("nicopp", root=str(tmp_path / "none"))
    assert_layout_error(exc, "NICO++ not found", "autumn, dim, grass, outdoor, rock, water")
    bad = corrupt(nico / "water" / "bear" / "img0.jpg")
    with pytest.raises(ConfigError) as exc:
        load("nicopp", root=str(nico))
    assert_layout_error(exc, bad)


# ---- NICO++ unique contexts ----------------------------------------------------------------------

# Written in this (unsorted) order; sorted, bear's are black, in cage, lying, roaring, sitting, wombat.
NICO_UNIQUE = {"hot air balloon": ["in sky", "at night", "red", "above mountain", "with basket", "on ground"],
               "bear": ["wombat", "black", "roaring", "in cage", "lying", "sitting"]}


def write_unique(base: Path, per_context=5) -> Path:
    """base/NICO_unique/<class>/<context>/img<i>.jpg; green encodes the context's rank in name order."""
    root = base / "NICO_unique"
    for c, (cls, contexts) in enumerate(sorted(NICO_UNIQUE.items())):
        ranks = {ctx: k for k, ctx in enumerate(sorted(contexts))}
        for ctx in contexts:
            for i in range(per_context):
                write_image(root / cls / ctx / f"img{i}.jpg", colour(c, ranks[ctx], i))
    return root


def context_rank(x: torch.Tensor) -> np.ndarray:
    return np.array([d for _, d, _ in written(x)])


def test_group_contexts_sorts_and_deals_round_robin():
    contexts = NICO_UNIQUE["bear"]
    assert fp.group_contexts(contexts, 6) == [["black"], ["in cage"], ["lying"], ["roaring"], ["sitting"],
                                              ["wombat"]]
    assert fp.group_contexts(contexts, 4) == [["black", "sitting"], ["in cage", "wombat"], ["lying"], ["roaring"]]


def test_nicopp_unique_domains_are_the_kth_context_of_every_class(tmp_path):
    write_unique(tmp_path / "NICOpp")
    s = load("nicopp_unique", root=str(tmp_path / "NICOpp"))  # finds NICO_unique below the root
    assert s.domain_names == [f"unique{k}" for k in range(6)] and s.class_names == ["bear", "hot air balloon"]
    assert (len(s.train_y), len(s.test_y)) == (48, 12)  # 4 + 1 of 5 per (context, class)
    for x, dom, y in ((s.train_x, s.train_domains, s.train_y), (s.test_x, s.test_domains, s.test_y)):
        assert np.array_equal(context_rank(x), dom.numpy()), "unique<k> holds every class's k-th context"
        assert np.allclose(rgb_of(x)[:, 0], 20 + 20 * y.numpy(), atol=3)
    again = load("nicopp_unique", root=str(tmp_path / "NICOpp"))
    assert torch.equal(s.train_x, again.train_x) and torch.equal(s.test_x, again.test_x)
    two = load("nicopp_unique", root=str(tmp_path / "NICOpp" / "NICO_unique"), domains=["unique3", "unique0"],
               classes=["hot air balloon"])
    assert two.domain_names == ["unique3", "unique0"] and two.class_names == ["hot air balloon"]
    assert np.array_equal(context_rank(two.train_x), np.where(two.train_domains.numpy() == 0, 3, 0))
    three = load("nicopp_unique", root=str(tmp_path / "NICOpp"), num_groups=3)
    assert three.domain_names == ["unique0", "unique1", "unique2"]
    assert np.array_equal(context_rank(three.train_x) % 3, three.train_domains.numpy())
    assert torch.bincount(three.train_domains * 2 + three.train_y).tolist() == [8] * 6
    assert DATASETS.get("nicopp_unique").params().num_groups == 6


def test_nicopp_unique_cap_and_official_lists(tmp_path):
    root = write_unique(tmp_path / "NICOpp")
    capped = load("nicopp_unique", root=str(root), max_train_per_class=2)
    full = load("nicopp_unique", root=str(root))
    assert torch.bincount(capped.train_domains * 2 + capped.train_y).tolist() == [2] * 12
    assert torch.equal(full.test_x, capped.test_x) and torch.equal(full.test_domains, capped.test_domains)
    lists = tmp_path / "NICOpp" / "txtlist" / "NICO_unique_official"
    lists.mkdir(parents=True)
    (lists / "bear_in cage_train.txt").write_text(
        "".join(f"/data/NICOpp/NICO_unique/bear/in cage/img{i}.jpg 3\n" for i in range(3)))
    (lists / "bear_in cage_test.txt").write_text("/data/NICOpp/NICO_unique/bear/in cage/img3.jpg 3\n")
    s = load("nicopp_unique", root=str(tmp_path / "NICOpp"), domains=["unique1"], classes=["bear"])
    assert sorted(i for _, _, i in written(s.train_x)) == [0, 1, 2] and written(s.test_x) == [(0, 1, 3)]
    capped = load("nicopp_unique", root=str(tmp_path / "NICOpp"), domains=["unique1"], classes=["bear"],
                  max_train_per_class=1)
    assert len(capped.train_y) == 1 and written(capped.test_x) == [(0, 1, 3)]
    (lists / "bear_in cage_test.txt").write_text("/data/NICOpp/NICO_unique/bear/lying/img3.jpg 3\n")
    with pytest.raises(ConfigError, match="bear/lying, not bear/in cage"):
        load("nicopp_unique", root=str(tmp_path / "NICOpp"))
    (lists / "bear_in cage_test.txt").write_text("/data/NICOpp/NICO_unique/bear/in cage/img9.jpg 3\n")
    with pytest.raises(ConfigError) as exc:
        load("nicopp_unique", root=str(tmp_path / "NICOpp"))
    assert_layout_error(exc, "img9.jpg", "bear_in cage_test.txt")
    (lists / "bear_in cage_test.txt").write_text("/data/NICOpp/NICO_unique/bear/in cage/img3.jpg 3\n")
    (lists / "bear_in cage_train.txt").write_text("\n")
    with pytest.raises(ConfigError, match="lists no images"):
        load("nicopp_unique", root=str(tmp_path / "NICOpp"))
    (lists / "bear_in cage_test.txt").unlink()
    with pytest.raises(ConfigError, match="partner"):
        load("nicopp_unique", root=str(tmp_path / "NICOpp"))


def test_nicopp_unique_missing_and_corrupt(tmp_path, nico):
    with pytest.raises(ConfigError) as exc:
        load("nicopp_unique", root=str(tmp_path / "none"))
    assert_layout_error(exc, "NICO++ unique contexts not found", "<class>/<context>", "NICO_unique_official")
    with pytest.raises(ConfigError, match="not found"):
        load("nicopp_unique", root=str(nico))  # the common-context tree is not read as the unique one
    root = write_unique(tmp_path / "NICOpp")
    with pytest.raises(ConfigError, match="unique6"):
        load("nicopp_unique", root=str(root), domains=["unique6"])
    with pytest.raises(ConfigError, match="panda"):
        load("nicopp_unique", root=str(root), classes=["panda"])
    with pytest.raises(ConfigError) as exc:
        load("nicopp_unique", root=str(root), num_groups=7)
    assert_layout_error(exc, "fewer than num_groups", "bear")
    bad = corrupt(root / "bear" / "roaring" / "img2.jpg")
    with pytest.raises(ConfigError) as exc:
        load("nicopp_unique", root=str(root))
    assert_layout_error(exc, bad)
    for f in (root / "bear" / "roaring").iterdir():
        f.unlink()
    with pytest.raises(ConfigError) as exc:
        load("nicopp_unique", root=str(root))
    assert_layout_error(exc, "no .jpg", root / "bear" / "roaring")


# ---- OpenImage (FedCADO / FedDISC) -------------------------------------------------------------

OI_CLASSES = ["Kitchen utensil", "Weapon"]


def write_openimage(root: Path, per_sub=3):
    """FiftyOne layout for the subclasses of two super-categories; returns {(split, subclass): ids}."""
    subs = sorted({s for c in OI_CLASSES for s in fp.OPENIMAGE_TABLE[c]})
    mids = {s: f"/m/{i:03d}" for i, s in enumerate(subs)}
    written = {}
    for split, n in (("train", per_sub), ("test", 1)):
        folder = root / split
        (folder / "metadata").mkdir(parents=True)
        with open(folder / "metadata" / "classes.csv", "w", newline="") as fh:
            csv.writer(fh).writerows([["id", "label"], ["/m/999", "Cat"]] + [[m, s] for s, m in mids.items()])
        rows = []
        for s in subs:
            for i in range(n):
                image_id = f"{split[:2]}{mids[s][3:]}{i}"
                write_image(folder / "data" / f"{image_id}.jpg", (100, 100, 100))
                rows.append([image_id, "verification", mids[s], "1"])
                written.setdefault((split, s), []).append(image_id)
        rows += [["trneg", "verification", mids["Axe"], "0"],      # verified absent: ignored
                 ["tramb", "verification", mids["Spatula"], "1"],  # Spatula + client0's Knife: ambiguous there
                 ["tramb", "verification", mids["Knife"], "1"],
                 ["notdownloaded", "verification", mids["Sword"], "1"]]
        write_image(folder / "data" / "trneg.jpg", (0, 0, 0))
        write_image(folder / "data" / "tramb.jpg", (0, 0, 0))
        (folder / "labels").mkdir()
        with open(folder / "labels" / "classifications.csv", "w", newline="") as fh:
            csv.writer(fh).writerows([["ImageID", "Source", "LabelName", "Confidence"]] + rows)
    return written


def test_openimage_superclasses_and_clients(tmp_path):
    write_openimage(tmp_path / "oi")
    s = load("openimage_feddisc", root=str(tmp_path / "oi"), classes=OI_CLASSES)
    assert s.domain_names == [f"client{k}" for k in range(6)] and s.class_names == OI_CLASSES
    counts = torch.bincount(s.train_domains * 2 + s.train_y, minlength=12).view(6, 2)
    # 3 per subclass; 'tramb' (Spatula + Knife) is dropped by client0, kept by client3 (Knife = utensil)
    # where Spatula does not count; the Knife images serve client0 (weapon) and client3 (utensil).
    assert counts.tolist() == [[3, 3], [3, 3], [3, 3], [4, 3], [3, 3], [3, 3]]
    assert (len(s.test_y)) == 6 * 2 + 1  # + 'tramb' again, in client3
    capped = load("openimage_fedcado", root=str(tmp_path / "oi"), classes=OI_CLASSES, max_train_per_class=2)
    assert torch.bincount(capped.train_domains * 2 + capped.train_y).tolist() == [2] * 12
    assert DATASETS.get("openimage_fedcado").params().max_train_per_class == 30
    assert DATASETS.get("openimage_feddisc").params().max_train_per_class is None


def test_openimage_table_is_the_papers():
    assert len(fp.OPENIMAGE_TABLE) == 20 and all(len(v) == 6 for v in fp.OPENIMAGE_TABLE.values())
    assert [fp.OPENIMAGE_TABLE[c][0] for c in ("Bird", "Plant", "Weapon")] == ["Woodpecker", "Maple", "Knife"]
    assert fp.OPENIMAGE_TABLE["Sports equipment (Ball)"][5] == "Volleyball (Ball)"


def test_openimage_missing_and_corrupt(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load("openimage_fedcado", root=str(tmp_path / "none"))
    assert_layout_error(exc, "Open Images not found", "classifications.csv")
    written = write_openimage(tmp_path / "oi")
    with pytest.raises(ConfigError, match="Woodpecker"):
        load("openimage_fedcado", root=str(tmp_path / "oi"), classes=["Bird"])
    bad = corrupt(tmp_path / "oi" / "train" / "data" / f"{written[('train', 'Dagger')][1]}.jpg")
    with pytest.raises(ConfigError) as exc:
        load("openimage_fedcado", root=str(tmp_path / "oi"), classes=OI_CLASSES)
    assert_layout_error(exc, bad)


# ---- HAM10000 ------------------------------------------------------------------------------------

def write_ham(root: Path, lesions_per_class=3):
    rows, k = [], 0
    for d, source in enumerate(["vidir_modern", "rosendahl"]):
        for c, dx in enumerate(fp.HAM_CLASSES):
            for lesion in range(lesions_per_class):
                for shot in range(2):  # two images of every lesion
                    image_id = f"ISIC_{k:07d}"
                    part = fp.HAM_PARTS[k % 2]
                    write_image(root / part / f"{image_id}.jpg", colour(c, d, lesion * 2 + shot))
                    rows.append([f"HAM_{d}{c}{lesion}", image_id, dx, "histo", "50.0", "male", "back", source])
                    k += 1
    with open(root / "HAM10000_metadata.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization",
                                   "dataset"]] + rows)
    return rows


def test_ham10000_domains_labels_and_lesion_split(tmp_path):
    write_ham(tmp_path / "HAM10000")
    s = load("ham10000", root=str(tmp_path))
    assert s.class_names == fp.HAM_CLASSES and s.domain_names == ["rosendahl", "vidir_modern"]
    assert (len(s.train_y), len(s.test_y)) == (56, 28)
    rgb_train, rgb_test = rgb_of(s.train_x), rgb_of(s.test_x)
    assert np.allclose(rgb_train[:, 0], 20 + 20 * s.train_y.numpy(), atol=3)
    # Green encodes the written source (vidir_modern first), blue the lesion: no lesion on both sides.
    def lesions(rgb):
        return {(round(r), round(g), int(round((b - 10) / 12)) // 2) for r, g, b in rgb}
    assert not lesions(rgb_train) & lesions(rgb_test)
    assert torch.bincount(s.test_domains * 7 + s.test_y).tolist() == [2] * 14  # 1 lesion of 3, 2 images
    one = load("ham10000", root=str(tmp_path), domains=["vidir_modern"], classes=["mel", "nv"])
    assert one.domain_names == ["vidir_modern"] and one.class_names == ["mel", "nv"] and len(one.train_y) == 8


def test_ham10000_missing_and_corrupt(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load("ham10000", root=str(tmp_path / "none"))
    assert_layout_error(exc, "HAM10000 not found", "HAM10000_images_part_1", fp.HAM_PAGE)
    rows = write_ham(tmp_path / "h")
    bad = corrupt(tmp_path / "h" / "HAM10000_images_part_2" / f"{rows[5][1]}.jpg")
    with pytest.raises(ConfigError) as exc:
        load("ham10000", root=str(tmp_path / "h"))
    assert_layout_error(exc, bad)
    bad.unlink()
    with pytest.raises(ConfigError) as exc:
        load("ham10000", root=str(tmp_path / "h"))
    assert_layout_error(exc, rows[5][1])
    meta = tmp_path / "h" / "HAM10000_metadata.csv"
    meta.write_text("lesion_id,image_id,dx\nHAM_1,ISIC_0000000,mel\n")
    with pytest.raises(ConfigError, match="dataset"):
        load("ham10000", root=str(tmp_path / "h"))


# ---- EuroSAT -------------------------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["2750", "EuroSAT_RGB"])
def test_eurosat_folders(tmp_path, folder):
    write_tree(tmp_path / "es" / folder, [""], fp.EUROSAT_CLASSES, per_class=2, suffix=".jpg")
    s = load("eurosat", root=str(tmp_path / "es"))
    assert s.class_names == fp.EUROSAT_CLASSES and s.domain_names is None
    assert (len(s.train_y), len(s.test_y)) == (10, 10) and s.input_shape == (3, SIZE, SIZE)
    assert DATASETS.get("eurosat").params().image_size == 64


def test_eurosat_zip_is_unpacked_into_the_download_folder(tmp_path):
    src = write_tree(tmp_path / "src" / "2750", [""], fp.EUROSAT_CLASSES, per_class=2, suffix=".jpg")
    (tmp_path / "es").mkdir()
    with zipfile.ZipFile(tmp_path / "es" / "EuroSAT.zip", "w") as zf:
        for p in src:
            zf.write(p, p.relative_to(tmp_path / "src").as_posix())
    s = load("eurosat", root=str(tmp_path / "es"), classes=["River", "Forest"])
    assert s.class_names == ["River", "Forest"] and len(s.train_y) == 2
    assert (tmp_path / "data-home" / "eurosat" / "2750" / "River").is_dir()
    assert not (tmp_path / "es" / "2750").exists(), "the user's folder is left as it was"


def test_eurosat_missing_offline_and_corrupt(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load("eurosat", root=str(tmp_path / "none"))
    assert_layout_error(exc, "EuroSAT not found", fp.EUROSAT_URL, "FEDGUIDE_OFFLINE", "2750/<class>")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "EuroSAT.zip").write_bytes(b"PK not really")
    with pytest.raises(ConfigError, match="not a readable zip"):
        load("eurosat", root=str(tmp_path / "z"))
    paths = write_tree(tmp_path / "es" / "2750", [""], fp.EUROSAT_CLASSES, per_class=2, suffix=".jpg")
    corrupt(paths[7])
    with pytest.raises(ConfigError) as exc:
        load("eurosat", root=str(tmp_path / "es"))
    assert_layout_error(exc, paths[7])


# ---- IMDB ----------------------------------------------------------------------------------------

IMDB_FILES = {
    ("train", "neg"): ["Bad bad BAD film.<br /><br />Boring", "bad plot, bad acting"],
    ("train", "pos"): ["Great film! It's great.", "great acting<br/>great plot"],
    ("test", "neg"): ["bad and dull", "Awful."],
    ("test", "pos"): ["great great film", "an unseen masterpiece"],
}


def write_imdb(base: Path) -> Path:
    acl = base / "aclImdb"
    for (split, label), texts in IMDB_FILES.items():
        (acl / split / label).mkdir(parents=True)
        for i, text in enumerate(texts):
            (acl / split / label / f"{i}_{7 if label == 'pos' else 2}.txt").write_text(text, encoding="utf-8")
    (acl / "train" / "unsup").mkdir()
    (acl / "train" / "unsup" / "0_0.txt").write_text("unsup words everywhere")
    return acl


def test_imdb_tokeniser():
    assert imdb.tokenize("Bad bad BAD film.<br /><br />Boring") == ["bad", "bad", "bad", "film", "boring"]
    assert imdb.tokenize("It's great<br/>isn't it") == ["it's", "great", "isn't", "it"]


def test_imdb_vocab_from_train_padding_and_truncation(tmp_path):
    acl = write_imdb(tmp_path)
    s = load("imdb", root=str(acl), max_len=6)
    assert s.class_names == ["negative", "positive"]
    assert s.train_x.dtype == torch.int64 and s.train_x.shape == (4, 6) and s.test_x.shape == (4, 6)
    assert s.train_y.tolist() == [0, 0, 1, 1] and s.test_y.tolist() == [0, 0, 1, 1]
    # Training counts: bad 5, great 4, acting 2, film 2, plot 2, then boring, it's (1 each).
    bad, great, acting, film, plot, boring = 2, 3, 4, 5, 6, 7
    assert s.train_x[0].tolist() == [bad, bad, bad, film, boring, 0]
    assert s.train_x[3].tolist() == [great, acting, great, plot, 0, 0]
    assert s.test_x[0].tolist() == [bad, 1, 1, 0, 0, 0], "'and', 'dull' are unknown: only train builds the vocab"
    assert s.test_x[3].tolist() == [1, 1, 1, 0, 0, 0], "test-only words map to 1"
    assert s.vocab_size == 9 and s.input_shape == (6,)  # ids 0..8: pad, unknown, 7 training words
    short = load("imdb", root=str(tmp_path), max_len=2, vocab_size=4)  # parent of aclImdb works too
    assert short.train_x[0].tolist() == [bad, bad] and short.train_x[2].tolist() == [great, 1]
    tail = load("imdb", root=str(acl), max_len=2, truncation="end")
    assert tail.train_x[0].tolist() == [film, boring]


def test_imdb_missing_offline_and_corrupt(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load("imdb", root=str(tmp_path / "none"))
    assert_layout_error(exc, "aclImdb/{train,test}/{neg,pos}", imdb.URL, "FEDGUIDE_OFFLINE")
    acl = write_imdb(tmp_path)
    bad = acl / "test" / "pos" / "1_9.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8 \xc3")
    with pytest.raises(ConfigError) as exc:
        load("imdb", root=str(acl))
    assert_layout_error(exc, bad)
    bad.unlink()
    for f in (acl / "test" / "pos").iterdir():
        f.unlink()
    with pytest.raises(ConfigError) as exc:
        load("imdb", root=str(acl))
    assert_layout_error(exc, acl / "test" / "pos")


# ---- downloads (through the shared fetchers) -------------------------------------------------------

def fake_download(monkeypatch, payload: bytes, urls: list):
    def download(url, dest, timeout=30.0):
        urls.append(url)
        dest.write_bytes(payload)
        return dest

    monkeypatch.setenv("FEDGUIDE_OFFLINE", "0")
    monkeypatch.setattr(_files, "download_file", download)


def test_imdb_download_is_unpacked_into_the_download_folder_and_found_offline_afterwards(tmp_path, monkeypatch):
    import io
    import tarfile

    acl = write_imdb(tmp_path / "src")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(acl, arcname="aclImdb")
    urls = []
    fake_download(monkeypatch, buf.getvalue(), urls)
    s = load("imdb", root=str(tmp_path / "none"), max_len=4)
    assert urls == [imdb.URL] and s.train_y.tolist() == [0, 0, 1, 1]
    target = tmp_path / "data-home" / "imdb"
    assert (target / "aclImdb" / "test" / "pos").is_dir() and not (target / "aclImdb_v1.tar.gz").exists()
    monkeypatch.setenv("FEDGUIDE_OFFLINE", "1")
    assert load("imdb", root=str(tmp_path / "none"), max_len=4).test_y.tolist() == [0, 0, 1, 1]


def test_eurosat_download_is_unpacked_and_a_broken_one_names_the_url(tmp_path, monkeypatch):
    src = write_tree(tmp_path / "src" / "2750", [""], fp.EUROSAT_CLASSES, per_class=2, suffix=".jpg")
    archive = tmp_path / "EuroSAT.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for p in src:
            zf.write(p, p.relative_to(tmp_path / "src").as_posix())
    urls = []
    fake_download(monkeypatch, b"not a zip", urls)
    with pytest.raises(ConfigError) as exc:
        load("eurosat", root=str(tmp_path / "none"))
    assert_layout_error(exc, "EuroSAT not found", fp.EUROSAT_URL)
    assert not (tmp_path / "data-home" / "eurosat" / "EuroSAT.zip").exists(), "a broken download is not kept"
    fake_download(monkeypatch, archive.read_bytes(), urls)
    s = load("eurosat", root=str(tmp_path / "none"), classes=["Forest"])
    assert urls == [fp.EUROSAT_URL] * 2 and s.class_names == ["Forest"]
    assert (tmp_path / "data-home" / "eurosat" / "2750" / "Forest").is_dir()
