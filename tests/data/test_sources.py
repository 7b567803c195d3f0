"""Dataset sources: Fashion-MNIST from (tiny, hand-written) IDX files, and scikit-learn digits."""
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedguide.data.sources import DATASETS, SourceParams, _files
from fedguide.data.sources import fmnist as fm
from fedguide.data.sources.digits import load_digits
from fedguide.data.sources.fmnist import CLASS_NAMES, MEAN, STD, load_fmnist, read_idx
from fedguide.registry import ConfigError

N_TRAIN, N_TEST = 20, 5


def idx_bytes(array: np.ndarray) -> bytes:
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    data = idx_bytes(array)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "train_x": rng.integers(0, 256, size=(N_TRAIN, 28, 28), dtype=np.uint8),
        "train_y": (np.arange(N_TRAIN) % 10).astype(np.uint8),
        "test_x": rng.integers(0, 256, size=(N_TEST, 28, 28), dtype=np.uint8),
        "test_y": np.array([9, 0, 3, 3, 7], dtype=np.uint8),
    }


def write_dataset(folder: Path, arrays, gz: bool) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    return {k: write_idx(folder / fm.FILES[k], arrays[k], gz) for k in fm.FILES}


@pytest.fixture
def no_other_sources(monkeypatch, tmp_path):
    """Only what a test writes is found: no FEDGUIDE_DATA, no system or download folder, no downloads."""
    monkeypatch.delenv("FEDGUIDE_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the download folder, searched too, lies under it
    monkeypatch.setenv("FEDGUIDE_OFFLINE", "1")
    monkeypatch.setattr(fm, "SYSTEM_DIR", str(tmp_path / "no-such-system-dir"))


def expected_images(raw: np.ndarray) -> torch.Tensor:
    return ((torch.from_numpy(raw.astype(np.float32)) / 255.0 - MEAN) / STD).unsqueeze(1)


# ---- IDX parsing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
def test_read_idx(tmp_path, gz):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / "x-idx3-ubyte", a, gz)
    out = read_idx(path)
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
    assert np.array_equal(out, a)


def test_read_idx_rank1(tmp_path):
    path = write_idx(tmp_path / "y", np.array([1, 2, 3]), gz=False)
    assert np.array_equal(read_idx(path), [1, 2, 3])


def test_read_idx_rejects_wrong_type_code(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 1) + b"\0\0\0\0")  # float IDX
    with pytest.raises(ConfigError, match="not an unsigned-byte IDX file") as exc:
        read_idx(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_body_raises_config_error_with_path(tmp_path, gz):
    data = idx_bytes(np.zeros((N_TRAIN, 28, 28)))[:-100]
    path = tmp_path / ("train-images-idx3-ubyte" + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(ConfigError, match="truncated") as exc:
        read_idx(path)
    assert str(path) in str(exc.value)


def test_truncated_loads_through_load_fmnist(tmp_path, no_other_sources):
    files = write_dataset(tmp_path / "d", make_arrays(), gz=False)
    files["test_x"].write_bytes(files["test_x"].read_bytes()[:-1])
    with pytest.raises(ConfigError) as exc:
        load_fmnist(SourceParams(root=str(tmp_path / "d")))
    assert str(files["test_x"]) in str(exc.value)


def test_truncated_inside_header_raises_config_error(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(idx_bytes(np.zeros((2, 28, 28)))[:6])  # stops inside the dimension words
    try:
        read_idx(path)
    except ConfigError as err:
        assert str(path) in str(err)
    except Exception as err:  # noqa: BLE001
        pytest.fail(
            "BUG (data/sources/fmnist.py read_idx): a file cut inside its header raises "
            f"{type(err).__name__}({err}) instead of a ConfigError naming the path; check "
            "len(data) >= 4 + 4*rank before parsing the dims"
        )
    else:
        pytest.fail("a file cut inside its header was accepted")


def test_truncated_gzip_stream_raises_config_error(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.arange(N_TRAIN * 28 * 28).reshape(N_TRAIN, 28, 28) % 251))[:200])
    try:
        read_idx(path)
    except ConfigError as err:
        assert str(path) in str(err)
    except Exception as err:  # noqa: BLE001
        pytest.fail(
            "BUG (data/sources/fmnist.py read_idx): a truncated/corrupt .gz raises "
            f"{type(err).__name__}({err}) instead of a ConfigError naming the path; catch "
            "(EOFError, OSError, zlib.error) around the read and re-raise as ConfigError"
        )
    else:
        pytest.fail("a truncated gzip file was accepted")


# ---- load_fmnist ---------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
def test_load_fmnist_from_root(tmp_path, no_other_sources, gz):
    arrays = make_arrays()
    write_dataset(tmp_path / "d", arrays, gz)
    splits = load_fmnist(SourceParams(root=str(tmp_path / "d")))

    assert splits.train_x.shape == (N_TRAIN, 1, 28, 28) and splits.test_x.shape == (N_TEST, 1, 28, 28)
    assert splits.train_x.dtype == torch.float32 and splits.test_x.dtype == torch.float32
    assert splits.train_y.dtype == torch.int64 and splits.test_y.dtype == torch.int64
    assert splits.train_x.is_contiguous()
    assert torch.equal(splits.train_y, torch.from_numpy(arrays["train_y"].astype(np.int64)))
    assert torch.equal(splits.test_y, torch.tensor([9, 0, 3, 3, 7]))
    assert torch.allclose(splits.train_x, expected_images(arrays["train_x"]), atol=1e-6)
    assert torch.allclose(splits.test_x, expected_images(arrays["test_x"]), atol=1e-6)
    # Black and white pixels map to (0 - mean)/std and (1 - mean)/std.
    assert splits.train_x.min().item() >= -MEAN / STD - 1e-5
    assert splits.train_x.max().item() <= (1 - MEAN) / STD + 1e-5
    assert splits.class_names == CLASS_NAMES and len(splits.class_names) == 10
    assert splits.num_classes == 10 and splits.input_shape == (1, 28, 28)


def test_load_fmnist_through_registry(tmp_path, no_other_sources):
    write_dataset(tmp_path / "d", make_arrays(), gz=True)
    entry = DATASETS.get("fmnist")
    splits = entry.obj(entry.params.model_validate({"root": str(tmp_path / "d")}))
    assert len(splits.train_y) == N_TRAIN


def test_fedguide_data_env_and_subfolder_layout(tmp_path, monkeypatch, no_other_sources):
    # Files in <FEDGUIDE_DATA>/fashion-mnist/ are found, with no data.root given.
    write_dataset(tmp_path / "env" / "fashion-mnist", make_arrays(), gz=True)
    monkeypatch.setenv("FEDGUIDE_DATA", str(tmp_path / "env"))
    splits = load_fmnist(SourceParams())
    assert splits.train_x.shape == (N_TRAIN, 1, 28, 28)


def test_data_root_wins_over_env(tmp_path, monkeypatch, no_other_sources):
    write_dataset(tmp_path / "root", make_arrays(seed=1), gz=False)
    other = make_arrays(seed=2)
    other["test_y"] = np.array([1, 1, 1, 1, 1], dtype=np.uint8)
    write_dataset(tmp_path / "env", other, gz=False)
    monkeypatch.setenv("FEDGUIDE_DATA", str(tmp_path / "env"))
    splits = load_fmnist(SourceParams(root=str(tmp_path / "root")))
    assert torch.equal(splits.test_y, torch.tensor([9, 0, 3, 3, 7]))


def test_mismatched_lengths(tmp_path, no_other_sources):
    arrays = make_arrays()
    arrays["train_y"] = arrays["train_y"][:-1]
    write_dataset(tmp_path / "d", arrays, gz=False)
    with pytest.raises(ConfigError, match="differ in length"):
        load_fmnist(SourceParams(root=str(tmp_path / "d")))


def test_missing_everywhere_offline(tmp_path, monkeypatch):
    root = tmp_path / "root"
    env = tmp_path / "env"
    root.mkdir()
    env.mkdir()
    monkeypatch.setenv("FEDGUIDE_DATA", str(env))
    monkeypatch.setenv("FEDGUIDE_OFFLINE", "1")
    monkeypatch.setattr(fm, "SYSTEM_DIR", str(tmp_path / "hidden-system-dir"))

    def no_download(*a, **k):  # belt and braces: the test must never touch the network
        raise AssertionError("download attempted although FEDGUIDE_OFFLINE=1")

    monkeypatch.setattr(_files, "download_file", no_download)
    with pytest.raises(ConfigError) as exc:
        load_fmnist(SourceParams(root=str(root)))
    msg = str(exc.value)
    assert "dataset-fashion-mnist" in msg
    assert "FEDGUIDE_DATA" in msg
    assert str(root) in msg and str(env) in msg, "the message lists where it looked"
    assert "FEDGUIDE_OFFLINE" in msg
    assert not (env / "fashion-mnist").exists() or not any((env / "fashion-mnist").iterdir())


def test_incomplete_folder_is_not_used(tmp_path, no_other_sources):
    files = write_dataset(tmp_path / "d", make_arrays(), gz=False)
    files["test_y"].unlink()
    with pytest.raises(ConfigError, match="dataset-fashion-mnist"):
        load_fmnist(SourceParams(root=str(tmp_path / "d")))


# ---- digits --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    return load_digits(SourceParams())


def test_digits_split_and_shapes(digits):
    assert digits.train_x.shape == (1437, 1, 8, 8)
    assert digits.test_x.shape == (360, 1, 8, 8)
    assert digits.train_y.shape == (1437,) and digits.test_y.shape == (360,)
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert digits.class_names == [str(d) for d in range(10)]
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10


def test_digits_labels_and_stratification(digits):
    assert set(digits.train_y.tolist()) == set(range(10))
    assert set(digits.test_y.tolist()) == set(range(10))
    counts = torch.bincount(digits.test_y, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # stratified: ~36 of each class


def test_digits_normalised(digits):
    allx = torch.cat([digits.train_x, digits.test_x])
    assert abs(allx.mean().item()) < 1e-4
    assert allx.std().item() == pytest.approx(1.0, abs=1e-3)


def test_digits_deterministic(digits):
    again = DATASETS.get("digits").obj(SourceParams())
    assert torch.equal(digits.train_x, again.train_x)
    assert torch.equal(digits.train_y, again.train_y)
    assert torch.equal(digits.test_x, again.test_x)
    assert torch.equal(digits.test_y, again.test_y)
