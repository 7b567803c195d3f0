"""Benchmark sources (CIFAR, MNIST, SVHN, USPS, Tiny ImageNet, SynthDigits, MNIST-M, the Digits benchmark),
each read from tiny files written here in the dataset's own distribution format."""
import bz2
import gzip
import io
import pickle
import struct
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from fedguide.data.sources import DATASETS
from fedguide.data.sources import _files
from fedguide.registry import ConfigError


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Only what a test writes is found: empty $FEDGUIDE_DATA and home, and no network."""
    (tmp_path / "env").mkdir()
    monkeypatch.setenv("FEDGUIDE_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FEDGUIDE_OFFLINE", "1")

    def no_download(*args, **kwargs):
        raise AssertionError("download attempted although FEDGUIDE_OFFLINE=1")

    monkeypatch.setattr(_files, "download_file", no_download)


def load(name, root, **params):
    entry = DATASETS.get(name)
    return entry.obj(entry.params.model_validate({"root": str(root), **params}))


def assert_splits(splits, n_train, n_test, shape):
    assert splits.train_x.shape == (n_train, *shape) and splits.test_x.shape == (n_test, *shape)
    assert splits.train_x.dtype == torch.float32 and splits.test_x.dtype == torch.float32
    assert splits.train_y.dtype == torch.int64 and splits.test_y.dtype == torch.int64
    assert splits.train_y.shape == (n_train,) and splits.test_y.shape == (n_test,)
    assert splits.train_x.is_contiguous()


def expect_config_error(name, root, *fragments, **params):
    with pytest.raises(ConfigError) as exc:
        load(name, root, **params)
    for fragment in fragments:
        assert fragment in str(exc.value), f"{fragment!r} missing from: {exc.value}"
    return str(exc.value)


def rng_images(n, *shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


# ---- CIFAR ---------------------------------------------------------------------------------------

def write_pickle(path, obj, old_numpy=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = pickle.dumps(obj, protocol=2)  # the protocol of the official (Python 2) files
    if old_numpy:  # files written by numpy < 2 name numpy.core where numpy >= 2 writes numpy._core
        data = data.replace(b"numpy._core", b"numpy.core")
    path.write_bytes(data)


def write_cifar10(base):
    folder = base / "cifar-10-batches-py"
    images = rng_images(6, 3072)
    labels = [3, 1, 4, 1, 5, 9]
    for i in range(5):  # batches of 2, 1, 1, 1, 1 images
        lo, hi = (0, 2) if i == 0 else (i + 1, i + 2)
        write_pickle(folder / f"data_batch_{i + 1}", {b"data": images[lo:hi], b"labels": labels[lo:hi]},
                     old_numpy=i == 0)
    write_pickle(folder / "test_batch", {b"data": rng_images(3, 3072, seed=1), b"labels": [0, 2, 7]})
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    write_pickle(folder / "batches.meta", {b"label_names": names, b"num_cases_per_batch": 10000})
    return folder, images, labels


def test_cifar10(tmp_path):
    _, images, labels = write_cifar10(tmp_path / "data")
    splits = load("cifar10", tmp_path / "data")
    assert_splits(splits, 6, 3, (3, 32, 32))
    assert splits.train_y.tolist() == labels and splits.test_y.tolist() == [0, 2, 7]
    assert splits.class_names[:3] == ["airplane", "automobile", "bird"] and len(splits.class_names) == 10
    # 1024 red values, then green, then blue; each channel standardised with its own statistics.
    from fedguide.data.sources.cifar import MEAN_10, STD_10
    raw = torch.from_numpy(images[0].reshape(3, 32, 32).astype(np.float32)) / 255
    expected = (raw - torch.tensor(MEAN_10).view(3, 1, 1)) / torch.tensor(STD_10).view(3, 1, 1)
    assert torch.allclose(splits.train_x[0], expected, atol=1e-5)


def write_cifar100(base):
    folder = base / "cifar-100-python"
    train = {"data": rng_images(4, 3072), "fine_labels": [0, 99, 50, 7], "coarse_labels": [4, 19, 0, 1]}
    write_pickle(folder / "train", train)  # str keys: files re-pickled by Python 3 tools
    write_pickle(folder / "test", {"data": rng_images(2, 3072, seed=2), "fine_labels": [1, 2],
                                   "coarse_labels": [3, 3]})
    write_pickle(folder / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)],
                                   "coarse_label_names": [f"coarse{i}" for i in range(20)]})
    return folder


@pytest.mark.parametrize("label,train_y,n_classes", [("fine", [0, 99, 50, 7], 100), ("coarse", [4, 19, 0, 1], 20)])
def test_cifar100_fine_and_coarse(tmp_path, label, train_y, n_classes):
    write_cifar100(tmp_path / "data" / "cifar100")  # the cifar100/ sub-folder layout
    splits = load("cifar100", tmp_path / "data", label=label)
    assert_splits(splits, 4, 2, (3, 32, 32))
    assert splits.train_y.tolist() == train_y
    assert splits.num_classes == n_classes and splits.class_names[1] == f"{label}1"


def test_cifar_missing_names_layout_and_url(tmp_path):
    msg = expect_config_error("cifar10", tmp_path, "cifar-10-batches-py", "data_batch_1", "cifar-10-python.tar.gz",
                              "FEDGUIDE_OFFLINE", str(tmp_path))
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in msg
    expect_config_error("cifar100", tmp_path, "cifar-100-python", "meta")


def test_cifar_corrupt_batch(tmp_path):
    folder, _, _ = write_cifar10(tmp_path)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    expect_config_error("cifar10", tmp_path, str(folder / "data_batch_3"), "cifar-10-batches-py")


def test_cifar_wrong_shape_and_label_range(tmp_path):
    folder = write_cifar100(tmp_path)
    write_pickle(folder / "test", {"data": rng_images(2, 1000), "fine_labels": [1, 2], "coarse_labels": [3, 3]})
    expect_config_error("cifar100", tmp_path, "uint8 [N, 3072]")
    write_pickle(folder / "test", {"data": rng_images(2, 3072), "fine_labels": [1, 100], "coarse_labels": [3, 3]})
    expect_config_error("cifar100", tmp_path, "expected 0..99")


def test_pickle_with_foreign_global_is_refused(tmp_path):
    folder, _, _ = write_cifar10(tmp_path)
    write_pickle(folder / "test_batch", {b"data": print, b"labels": []})  # a global other than numpy's
    expect_config_error("cifar10", tmp_path, ".print", "only data", str(folder / "test_batch"))


# ---- downloads, without a network ----------------------------------------------------------------

def cifar10_archive(tmp_path) -> bytes:
    write_cifar10(tmp_path / "src")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return buf.getvalue()


def test_download_unpacks_into_download_dir_and_is_found_offline_afterwards(tmp_path, monkeypatch):
    archive = cifar10_archive(tmp_path)
    urls = []

    def fake_download(url, dest, timeout=30.0):
        urls.append(url)
        dest.write_bytes(archive)
        return dest

    monkeypatch.setenv("FEDGUIDE_OFFLINE", "0")
    monkeypatch.setattr(_files, "download_file", fake_download)
    splits = load("cifar10", tmp_path / "empty")
    assert urls == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    assert len(splits.train_y) == 6
    target = tmp_path / "env" / "cifar10"
    assert (target / "cifar-10-batches-py" / "test_batch").is_file()
    assert not (target / "cifar-10-python.tar.gz").exists(), "the archive is removed once unpacked"
    assert not [p for p in target.iterdir() if p.name.startswith(".unpack")]

    monkeypatch.setenv("FEDGUIDE_OFFLINE", "1")
    assert len(load("cifar10", tmp_path / "empty").test_y) == 3  # found in the download folder


def test_failed_download_is_a_config_error(tmp_path, monkeypatch):
    def failing(url, dest, timeout=30.0):
        raise OSError("name resolution failed")

    monkeypatch.setenv("FEDGUIDE_OFFLINE", "0")
    monkeypatch.setattr(_files, "download_file", failing)
    expect_config_error("svhn", tmp_path, "name resolution failed", "train_32x32.mat", "ufldl.stanford.edu")


def test_unpack_refuses_paths_outside_the_target(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    (tmp_path / "a.tar.gz").write_bytes(buf.getvalue())
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match="unsafe path"):
        _files.unpack(tmp_path / "a.tar.gz", tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()
    assert list((tmp_path / "out").iterdir()) == []


# ---- MNIST ---------------------------------------------------------------------------------------

MNIST_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_bytes(array):
    array = np.asarray(array, dtype=np.uint8)
    return bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape) + array.tobytes()


def write_mnist(folder, gz=True, n_train=5, n_test=3):
    folder.mkdir(parents=True, exist_ok=True)
    arrays = [rng_images(n_train, 28, 28), np.arange(n_train) % 10, rng_images(n_test, 28, 28, seed=1),
              np.array([7, 2, 1][:n_test])]
    for stem, array in zip(MNIST_STEMS, arrays):
        data = idx_bytes(array)
        (folder / (stem + ".gz" if gz else stem)).write_bytes(gzip.compress(data) if gz else data)
    return arrays


@pytest.mark.parametrize("sub,gz", [("MNIST/raw", True), ("", False)])
def test_mnist(tmp_path, sub, gz):
    arrays = write_mnist(tmp_path / "data" / sub if sub else tmp_path / "data", gz)
    splits = load("mnist", tmp_path / "data")
    assert_splits(splits, 5, 3, (1, 28, 28))
    assert splits.train_y.tolist() == [0, 1, 2, 3, 4] and splits.test_y.tolist() == [7, 2, 1]
    assert splits.class_names == [str(d) for d in range(10)]
    expected = (torch.from_numpy(arrays[0].astype(np.float32)) / 255 - 0.1307) / 0.3081
    assert torch.allclose(splits.train_x[:, 0], expected, atol=1e-5)


def test_mnist_missing_and_corrupt(tmp_path):
    expect_config_error("mnist", tmp_path, "train-images-idx3-ubyte", "MNIST/raw", "ossci-datasets", "FEDGUIDE_OFFLINE")
    write_mnist(tmp_path / "mnist")
    (tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz").write_bytes(b"garbage")
    expect_config_error("mnist", tmp_path, str(tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz"))


# ---- SVHN ----------------------------------------------------------------------------------------

def write_svhn_mat(path, labels, seed=0):
    from scipy.io import savemat

    path.parent.mkdir(parents=True, exist_ok=True)
    x = rng_images(32, 32, 3, len(labels), seed=seed).reshape(32, 32, 3, len(labels))
    savemat(path, {"X": x, "y": np.array(labels, dtype=np.uint8).reshape(-1, 1)})
    return x


def write_svhn(folder):
    x = write_svhn_mat(folder / "train_32x32.mat", [10, 1, 5, 10])
    write_svhn_mat(folder / "test_32x32.mat", [3, 10], seed=1)
    return x


def test_svhn_maps_10_to_zero_and_transposes(tmp_path):
    x = write_svhn(tmp_path / "svhn")
    splits = load("svhn", tmp_path)
    assert_splits(splits, 4, 2, (3, 32, 32))
    assert splits.train_y.tolist() == [0, 1, 5, 0] and splits.test_y.tolist() == [3, 0]
    from fedguide.data.sources.svhn import MEAN, STD
    for n, c in ((0, 0), (2, 1), (3, 2)):  # image n, channel c is X[:, :, c, n]
        expected = (torch.from_numpy(x[:, :, c, n].astype(np.float32)) / 255 - MEAN[c]) / STD[c]
        assert torch.allclose(splits.train_x[n, c], expected, atol=1e-5)


def test_svhn_missing_corrupt_and_bad_labels(tmp_path):
    expect_config_error("svhn", tmp_path, "train_32x32.mat", "test_32x32.mat", "FEDGUIDE_OFFLINE")
    write_svhn(tmp_path / "svhn")
    (tmp_path / "svhn" / "test_32x32.mat").write_bytes(b"\x00" * 200)
    expect_config_error("svhn", tmp_path, str(tmp_path / "svhn" / "test_32x32.mat"), "train_32x32.mat")
    write_svhn_mat(tmp_path / "svhn" / "test_32x32.mat", [0, 3])
    expect_config_error("svhn", tmp_path, "label 0 found")


# ---- USPS ----------------------------------------------------------------------------------------

def libsvm_line(label, values):
    # LIBSVM leaves out zero-valued features.
    return " ".join([str(label)] + [f"{i + 1}:{v:g}" for i, v in enumerate(values) if v != 0])


def write_usps_bz2(folder, lines_train, lines_test):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "usps.bz2").write_bytes(bz2.compress(("\n".join(lines_train) + "\n").encode()))
    (folder / "usps.t.bz2").write_bytes(bz2.compress(("\n".join(lines_test) + "\n").encode()))


def test_usps_libsvm(tmp_path):
    first = np.full(256, -1.0)
    first[0], first[1], first[255] = 1.0, 0.0, 0.5  # white, omitted (mid grey), light grey
    write_usps_bz2(tmp_path / "usps", [libsvm_line(1, first), libsvm_line(10, np.ones(256))],
                   [libsvm_line(6, np.zeros(256))])
    splits = load("usps", tmp_path)
    assert_splits(splits, 2, 1, (1, 16, 16))
    assert splits.train_y.tolist() == [0, 9] and splits.test_y.tolist() == [5]  # digit = label - 1
    from fedguide.data.sources.usps import MEAN, STD
    pixels = splits.train_x[0, 0] * STD[0] + MEAN[0]
    assert pixels[0, 0].item() == pytest.approx(1.0, abs=1e-5)
    assert pixels[0, 1].item() == pytest.approx(128 / 255, abs=1e-5)
    assert pixels[0, 2].item() == pytest.approx(0.0, abs=1e-5)
    assert pixels[15, 15].item() == pytest.approx(191 / 255, abs=1e-5)


def test_usps_h5(tmp_path):
    h5py = pytest.importorskip("h5py")
    (tmp_path / "usps").mkdir()
    train = np.random.default_rng(0).random((3, 256))
    with h5py.File(tmp_path / "usps" / "usps.h5", "w") as fh:
        fh.create_group("train").create_dataset("data", data=train)
        fh["train"].create_dataset("target", data=np.array([0, 4, 9]))
        fh.create_group("test").create_dataset("data", data=np.zeros((2, 256)))
        fh["test"].create_dataset("target", data=np.array([1, 2]))
    splits = load("usps", tmp_path)
    assert_splits(splits, 3, 2, (1, 16, 16))
    assert splits.train_y.tolist() == [0, 4, 9] and splits.test_y.tolist() == [1, 2]
    from fedguide.data.sources.usps import MEAN, STD
    expected = torch.from_numpy(np.rint(train * 255).reshape(3, 16, 16).astype(np.float32)) / 255
    assert torch.allclose(splits.train_x[:, 0] * STD[0] + MEAN[0], expected, atol=1e-5)


def test_usps_h5_without_h5py_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "usps").mkdir()
    (tmp_path / "usps" / "usps.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py now raises ImportError
    expect_config_error("usps", tmp_path, "pip install h5py")


def test_usps_missing_and_corrupt(tmp_path):
    expect_config_error("usps", tmp_path, "usps.bz2", "usps.t.bz2", "usps.h5", "FEDGUIDE_OFFLINE")
    write_usps_bz2(tmp_path / "usps", [libsvm_line(1, np.ones(256))], [libsvm_line(2, np.ones(256))])
    (tmp_path / "usps" / "usps.t.bz2").write_bytes(b"BZh9 broken")
    expect_config_error("usps", tmp_path, str(tmp_path / "usps" / "usps.t.bz2"), "usps.bz2")
    write_usps_bz2(tmp_path / "usps", [libsvm_line(1, np.ones(256))], ["3 1:0.5 257:1"])
    expect_config_error("usps", tmp_path, "outside 1..256")
    write_usps_bz2(tmp_path / "usps", [libsvm_line(1, np.full(256, 3.0))], [libsvm_line(2, np.ones(256))])
    expect_config_error("usps", tmp_path, "expected -1.0..1")


# ---- Tiny ImageNet -------------------------------------------------------------------------------

def write_jpeg(path, colour, mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (64, 64), colour).save(path, "JPEG", quality=95)


def write_tinyimagenet(base):
    folder = base / "tiny-imagenet-200"
    wnids = ["n02124075", "n01443537"]  # not sorted, as in the official wnids.txt
    folder.mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (folder / "words.txt").write_text("n00001740\tentity\nn01443537\tgoldfish, Carassius auratus\n"
                                      "n02124075\tEgyptian cat\n")
    write_jpeg(folder / "train/n01443537/images/n01443537_0.JPEG", (250, 120, 0))
    write_jpeg(folder / "train/n01443537/images/n01443537_1.JPEG", (240, 130, 10))
    write_jpeg(folder / "train/n02124075/images/n02124075_0.JPEG", 100, mode="L")  # a greyscale one
    (folder / "train/n01443537/n01443537_boxes.txt").write_text("n01443537_0.JPEG\t0\t0\t63\t63\n")
    write_jpeg(folder / "val/images/val_0.JPEG", (0, 0, 255))
    write_jpeg(folder / "val/images/val_1.JPEG", (255, 255, 255))
    (folder / "val/val_annotations.txt").write_text("val_0.JPEG\tn02124075\t0\t0\t63\t63\n"
                                                     "val_1.JPEG\tn01443537\t1\t2\t60\t61\n")
    write_jpeg(folder / "test/images/test_0.JPEG", (1, 2, 3))  # unlabelled, unused
    return folder


def test_tinyimagenet(tmp_path):
    write_tinyimagenet(tmp_path)
    splits = load("tinyimagenet", tmp_path)
    assert_splits(splits, 3, 2, (3, 64, 64))
    assert splits.class_names == ["goldfish", "Egyptian cat"]  # sorted wnids, first synonym
    assert splits.train_y.tolist() == [0, 0, 1] and splits.test_y.tolist() == [1, 0]
    from fedguide.data.sources.tinyimagenet import MEAN, STD
    pixels = splits.train_x * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)
    assert pixels[0].mean(dim=(1, 2)).tolist() == pytest.approx([250 / 255, 120 / 255, 0], abs=0.02)
    assert torch.allclose(pixels[2, 0], pixels[2, 1]) and torch.allclose(pixels[2, 1], pixels[2, 2])  # grey
    small = load("tinyimagenet", tmp_path, image_size=32)
    assert small.train_x.shape == (3, 3, 32, 32)


def test_tinyimagenet_missing_corrupt_and_bad_annotation(tmp_path):
    expect_config_error("tinyimagenet", tmp_path, "tiny-imagenet-200", "wnids.txt", "val_annotations.txt",
                        "cs231n.stanford.edu")
    folder = write_tinyimagenet(tmp_path)
    (folder / "train/n02124075/images/n02124075_0.JPEG").write_bytes(b"not a jpeg")
    expect_config_error("tinyimagenet", tmp_path, str(folder / "train/n02124075/images/n02124075_0.JPEG"),
                        "tiny-imagenet-200")
    write_jpeg(folder / "train/n02124075/images/n02124075_0.JPEG", 100, mode="L")
    (folder / "val/val_annotations.txt").write_text("val_0.JPEG\tn99999999\t0\t0\t63\t63\n")
    expect_config_error("tinyimagenet", tmp_path, "no known wnid")


# ---- SynthDigits and MNIST-M ---------------------------------------------------------------------

def write_fedbn(folder, n_parts=3, shape=(32, 32, 3)):
    """FedBN's digit folder: partitions/train_part{k}.pkl and test.pkl, each a pickled (images, labels)."""
    (folder / "partitions").mkdir(parents=True)
    for k in range(n_parts):
        images = rng_images(2, *shape, seed=k)
        with open(folder / "partitions" / f"train_part{k}.pkl", "wb") as fh:
            pickle.dump((images, np.array([k, k + 1])), fh)
    with open(folder / "test.pkl", "wb") as fh:
        pickle.dump((rng_images(3, *shape, seed=9), np.array([[9], [8], [7]])), fh)


def test_synthdigits_fedbn_partitions(tmp_path):
    write_fedbn(tmp_path / "SynthDigits")
    splits = load("synthdigits", tmp_path)
    assert_splits(splits, 6, 3, (3, 32, 32))
    assert splits.train_y.tolist() == [0, 1, 1, 2, 2, 3] and splits.test_y.tolist() == [9, 8, 7]
    assert splits.class_names == [str(d) for d in range(10)]
    assert splits.train_x.min() >= -1.0 and splits.train_x.max() <= 1.0  # mean 0.5, std 0.5
    first = rng_images(2, 32, 32, 3, seed=0)[0].transpose(2, 0, 1).astype(np.float32) / 255
    assert torch.allclose(splits.train_x[0], (torch.from_numpy(first) - 0.5) / 0.5, atol=1e-5)


def test_digit_files_grey_pickles_and_npz(tmp_path):
    (tmp_path / "mnistm").mkdir()
    with open(tmp_path / "mnistm" / "train.pkl", "wb") as fh:
        pickle.dump((rng_images(4, 28, 28), np.array([1, 2, 3, 4])), fh)
    with open(tmp_path / "mnistm" / "test.pkl", "wb") as fh:
        pickle.dump((rng_images(1, 28, 28), [5]), fh)
    assert_splits(load("mnistm", tmp_path), 4, 1, (1, 28, 28))

    np.savez(tmp_path / "syn_train.npz", x=rng_images(2, 28, 28, 3), y=np.array([0, 1]))
    (tmp_path / "synthdigits").mkdir()
    (tmp_path / "syn_train.npz").rename(tmp_path / "synthdigits" / "train.npz")
    np.savez(tmp_path / "synthdigits" / "test.npz", images=rng_images(1, 28, 28, 3), labels=np.array([2]))
    splits = load("synthdigits", tmp_path)
    assert_splits(splits, 2, 1, (3, 28, 28))
    assert splits.test_y.tolist() == [2]


def write_png(path, colour, size=28):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), colour).save(path)


def test_mnistm_image_folders_and_first_release(tmp_path):
    for split, digits in (("train", (3, 3, 8)), ("test", (0,))):
        for i, d in enumerate(digits):
            write_png(tmp_path / "a" / "MNIST_M" / split / str(d) / f"{i}.png", (d * 20, 0, 255))
    splits = load("mnistm", tmp_path / "a")
    assert_splits(splits, 3, 1, (3, 28, 28))
    assert splits.train_y.tolist() == [3, 3, 8] and splits.test_y.tolist() == [0]
    assert splits.train_x[2, 0].mean().item() == pytest.approx((160 / 255 - 0.5) / 0.5, abs=1e-5)

    release = tmp_path / "b" / "mnist_m"
    for split, labels in (("train", [5, 6]), ("test", [7])):
        for i in range(len(labels)):
            write_png(release / f"mnist_m_{split}" / f"{i:08d}.png", (10, 20, 30))
        (release / f"mnist_m_{split}_labels.txt").write_text(
            "".join(f"{i:08d}.png {label}\n" for i, label in enumerate(labels)))
    splits = load("mnistm", release)  # the root being the dataset folder itself
    assert splits.train_y.tolist() == [5, 6] and splits.test_y.tolist() == [7]


def test_digit_files_missing_corrupt_and_not_taken_for_another_dataset(tmp_path):
    msg = expect_config_error("synthdigits", tmp_path, "no official download", "partitions/train_part0.pkl",
                              "synthdigits/{train,test}/<digit>/*.png", "SynthDigits")
    assert str(tmp_path) in msg
    write_fedbn(tmp_path / "MNIST_M")
    expect_config_error("synthdigits", tmp_path / "MNIST_M", "SynthDigits not found")  # not read as SynthDigits
    (tmp_path / "MNIST_M" / "test.pkl").write_bytes(b"\x80\x04garbage")
    expect_config_error("mnistm", tmp_path, str(tmp_path / "MNIST_M" / "test.pkl"), "mnistm/partitions/train_part0.pkl")
    with open(tmp_path / "MNIST_M" / "test.pkl", "wb") as fh:
        pickle.dump((rng_images(2, 32, 32, 3).astype(np.float32), np.array([1, 2])), fh)
    expect_config_error("mnistm", tmp_path, "expected uint8")


# ---- the Digits benchmark ------------------------------------------------------------------------

def write_digits_root(root):
    write_mnist(root / "mnist", n_train=5, n_test=3)
    write_usps_bz2(root / "usps", [libsvm_line(1, np.ones(256)), libsvm_line(3, -np.ones(256))],
                   [libsvm_line(10, np.zeros(256))])
    write_svhn(root / "svhn")
    write_fedbn(root / "SynthDigits", n_parts=1)
    write_fedbn(root / "MNIST_M", n_parts=2, shape=(28, 28, 3))


def test_digit_benchmark(tmp_path):
    write_digits_root(tmp_path)
    splits = load("digit_benchmark", tmp_path)
    assert_splits(splits, 5 + 2 + 4 + 2, 3 + 1 + 2 + 3, (3, 32, 32))
    assert splits.domain_names == ["mnist", "usps", "svhn", "synthdigits"]
    assert splits.class_names == [str(d) for d in range(10)]
    assert splits.train_domains.tolist() == [0] * 5 + [1] * 2 + [2] * 4 + [3] * 2
    assert splits.test_domains.tolist() == [0] * 3 + [1] + [2] * 2 + [3] * 3
    assert splits.train_domains.dtype == torch.int64
    assert splits.train_y.tolist() == [0, 1, 2, 3, 4] + [0, 2] + [0, 1, 5, 0] + [0, 1]
    assert splits.train_x.min() >= -1.0 - 1e-6 and splits.train_x.max() <= 1.0 + 1e-6
    mnist = splits.train_x[:5]
    assert torch.equal(mnist[:, 0], mnist[:, 1]) and torch.equal(mnist[:, 1], mnist[:, 2])  # grey replicated
    assert torch.allclose(splits.train_x[5], torch.ones(3, 32, 32))  # USPS all white: (1 - 0.5) / 0.5
    svhn_x = write_svhn(tmp_path / "again")  # the same seed: SVHN keeps its 32x32 pixels unresized
    expected = (torch.from_numpy(svhn_x[:, :, :, 1].transpose(2, 0, 1).astype(np.float32)) / 255 - 0.5) / 0.5
    assert torch.allclose(splits.train_x[8], expected, atol=1e-5)


def test_digit_benchmark_with_mnistm_and_size(tmp_path):
    write_digits_root(tmp_path)
    splits = load("digit_benchmark", tmp_path, domains=["svhn", "mnistm"], image_size=28)
    assert splits.domain_names == ["svhn", "mnistm"]
    assert splits.train_x.shape == (4 + 4, 3, 28, 28)
    assert splits.train_domains.tolist() == [0] * 4 + [1] * 4


def test_digit_benchmark_params_and_missing_domain(tmp_path):
    with pytest.raises(ConfigError, match="once"):
        DATASETS.parse_params("digit_benchmark", {"domains": ["mnist", "mnist"]}, "data")
    with pytest.raises(ConfigError, match="domains"):
        DATASETS.parse_params("digit_benchmark", {"domains": ["kmnist"]}, "data")
    with pytest.raises(ConfigError, match="domains"):
        DATASETS.parse_params("digit_benchmark", {"domains": []}, "data")
    write_mnist(tmp_path / "mnist")
    expect_config_error("digit_benchmark", tmp_path, "USPS not found", "usps.bz2")
