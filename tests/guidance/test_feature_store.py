"""FeatureStore: compute once, reuse, validate on open, rebuild, atomic writes."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedguide.core.checksums import file_sha256
from fedguide.guidance.store import FeatureCacheError, FeatureKey, FeatureStore
from fedguide.registry import ConfigError

MODEL = "example/unet@abc123"


def make_key(**overrides) -> FeatureKey:
    fields = dict(model=MODEL, dataset="fmnist", split="train", fraction=1.0,
                  recipe={"layer": "mid", "t": 200}, seed=0)
    fields.update(overrides)
    return FeatureKey(**fields)


class CountingCompute:
    """Features [i, i + 0.5, i + 0.25] per index; records every batch it is asked for."""

    def __init__(self, fail_at_batch: int | None = None):
        self.batches: list[np.ndarray] = []
        self.fail_at_batch = fail_at_batch

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        if self.fail_at_batch is not None and len(self.batches) == self.fail_at_batch:
            raise RuntimeError("GPU fell over")
        self.batches.append(indices.copy())
        i = indices.astype(np.float64)[:, None]
        return np.concatenate([i, i + 0.5, i + 0.25], axis=1)


def expected_features(n: int) -> np.ndarray:
    i = np.arange(n, dtype=np.float32)[:, None]
    return np.concatenate([i, i + 0.5, i + 0.25], axis=1)


def build(store: FeatureStore, key: FeatureKey, n: int = 10, compute=None, **kw) -> np.ndarray:
    return store.get_or_compute(key, n, compute or CountingCompute(), batch_size=4, progress=False, **kw)


def test_computes_once_then_reuses(tmp_path):
    store, key, compute = FeatureStore(tmp_path), make_key(), CountingCompute()
    first = build(store, key, compute=compute)
    calls = len(compute.batches)
    again = build(FeatureStore(tmp_path), key, compute=compute)
    assert calls == 3  # ceil(10 / 4)
    assert len(compute.batches) == calls
    np.testing.assert_array_equal(first, again)


def test_result_shape_dtype_and_values(tmp_path):
    features = build(FeatureStore(tmp_path), make_key(), n=10)
    assert features.shape == (10, 3)
    assert features.dtype == np.float32
    assert isinstance(features, np.memmap)
    np.testing.assert_array_equal(features, expected_features(10))


def test_batches_cover_all_indices_in_order_once(tmp_path):
    compute = CountingCompute()
    build(FeatureStore(tmp_path), make_key(), n=11, compute=compute)
    assert [len(b) for b in compute.batches] == [4, 4, 3]
    np.testing.assert_array_equal(np.concatenate(compute.batches), np.arange(11))


def test_returned_array_is_read_only(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    for features in (build(store, key), store.open(key)):
        assert not features.flags.writeable
        with pytest.raises(ValueError):
            features[0, 0] = 1.0


def test_digest_is_stable_and_sensitive_to_every_field():
    key = make_key()
    assert key.digest() == make_key().digest()
    assert len(key.digest()) == 16 and int(key.digest(), 16) >= 0
    # Mapping order and tuple-vs-list do not change what the recipe means.
    assert make_key(recipe={"t": 200, "layer": "mid"}).digest() == key.digest()
    assert make_key(recipe={"size": (8, 8)}).digest() == make_key(recipe={"size": [8, 8]}).digest()
    variants = [make_key(model="example/unet@def456"), make_key(dataset="cifar10"), make_key(split="test"),
                make_key(fraction=0.5), make_key(recipe={"layer": "mid", "t": 400}), make_key(seed=1)]
    digests = {v.digest() for v in variants}
    assert key.digest() not in digests and len(digests) == len(variants)
    assert hash(key) == hash(make_key()) and key == make_key()


def test_key_rejects_bad_fields():
    with pytest.raises(ConfigError, match="revision"):
        make_key(model="example/unet")
    with pytest.raises(ConfigError, match="fraction"):
        make_key(fraction=0.0)
    with pytest.raises(ConfigError, match="recipe.bad"):
        make_key(recipe={"bad": object()})
    with pytest.raises(ConfigError, match="finite"):
        make_key(recipe={"t": float("nan")})


def test_different_keys_live_side_by_side(tmp_path):
    store = FeatureStore(tmp_path)
    train, test = make_key(), make_key(split="test")
    a = build(store, train, n=10)
    b = build(store, test, n=6, compute=lambda idx: np.full((len(idx), 2), 7.0))
    assert store.path(train) != store.path(test)
    assert store.path(train).name.startswith("fmnist-train-")
    assert a.shape == (10, 3) and b.shape == (6, 2)
    np.testing.assert_array_equal(store.open(train), expected_features(10))
    np.testing.assert_array_equal(store.open(test), np.full((6, 2), 7.0, dtype=np.float32))


def test_layout_and_meta(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    folder = store.path(key)
    assert sorted(p.name for p in folder.iterdir()) == ["features.npy", "meta.json"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["key"] == key.as_dict()
    assert meta["shape"] == [10, 3] and meta["num_items"] == 10
    assert np.dtype(meta["dtype"]) == np.float32
    assert meta["sha256"] == file_sha256(folder / "features.npy")
    assert meta["fedguide_version"] and meta["created"]


def test_open_absent_is_none(tmp_path):
    store = FeatureStore(tmp_path / "nowhere")
    assert store.open(make_key()) is None
    assert not store.exists(make_key())


def test_key_mismatch_in_meta_names_the_file(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    meta_path = store.path(key) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["key"]["seed"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(FeatureCacheError, match="key mismatch") as err:
        store.open(key)
    assert str(meta_path) in str(err.value) and "seed" in str(err.value)


def test_flipped_byte_fails_checksum(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    data = store.path(key) / "features.npy"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(FeatureCacheError, match="checksum") as err:
        store.open(key)
    assert str(data) in str(err.value) and "--rebuild" in str(err.value)
    # get_or_compute does not silently use it either.
    with pytest.raises(FeatureCacheError, match="checksum"):
        build(store, key)


def test_truncated_npy_is_caught_even_without_checksum(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    data = store.path(key) / "features.npy"
    data.write_bytes(data.read_bytes()[:-7])
    for verify in ("checksum", "header"):
        with pytest.raises(FeatureCacheError, match="truncated") as err:
            FeatureStore(tmp_path, verify=verify).open(key)
        assert str(data) in str(err.value)
    data.write_bytes(b"\x93NUM")  # not even a whole header
    with pytest.raises(FeatureCacheError, match="header"):
        store.open(key)


def test_missing_or_unreadable_meta(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    meta_path = store.path(key) / "meta.json"
    meta_path.write_text("{not json")
    with pytest.raises(FeatureCacheError, match="unreadable JSON"):
        store.open(key)
    meta_path.unlink()
    with pytest.raises(FeatureCacheError, match="missing") as err:
        store.open(key)
    assert str(meta_path) in str(err.value)


def test_header_mode_skips_checksum_but_catches_shape_mismatch(tmp_path):
    key = make_key()
    build(FeatureStore(tmp_path), key)
    header_store = FeatureStore(tmp_path, verify="header")
    data = header_store.path(key) / "features.npy"
    # Same shape and size, other values: only a checksum can tell.
    np.save(data, np.zeros((10, 3), dtype=np.float32))
    np.testing.assert_array_equal(header_store.open(key), np.zeros((10, 3)))
    with pytest.raises(FeatureCacheError, match="checksum"):
        FeatureStore(tmp_path).open(key)
    # Other shape with the same byte count: the header check catches it.
    np.save(data, np.zeros((15, 2), dtype=np.float32))
    with pytest.raises(FeatureCacheError, match="shape") as err:
        header_store.open(key)
    assert str(data) in str(err.value)


def test_rebuild_replaces_a_corrupt_cache(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    data = store.path(key) / "features.npy"
    data.write_bytes(data.read_bytes()[:-7])
    compute = CountingCompute()
    features = build(store, key, compute=compute, rebuild=True)
    assert len(compute.batches) == 3
    np.testing.assert_array_equal(features, expected_features(10))
    np.testing.assert_array_equal(store.open(key), expected_features(10))
    assert [p.name for p in tmp_path.iterdir()] == [store.path(key).name]


def test_rebuild_recomputes_a_valid_cache(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    features = build(store, key, rebuild=True, compute=lambda idx: np.ones((len(idx), 3)))
    np.testing.assert_array_equal(features, np.ones((10, 3)))
    np.testing.assert_array_equal(store.open(key), np.ones((10, 3)))


def test_failing_compute_keeps_previous_cache_and_leaves_no_temp(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    before = (store.path(key) / "features.npy").read_bytes()
    with pytest.raises(RuntimeError, match="GPU fell over"):
        build(store, key, compute=CountingCompute(fail_at_batch=2), rebuild=True)
    assert [p.name for p in tmp_path.iterdir()] == [store.path(key).name]
    assert (store.path(key) / "features.npy").read_bytes() == before
    np.testing.assert_array_equal(store.open(key), expected_features(10))


def test_failing_first_build_leaves_nothing(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    with pytest.raises(RuntimeError):
        build(store, key, compute=CountingCompute(fail_at_batch=1))
    assert list(tmp_path.iterdir()) == []
    assert store.open(key) is None


def test_nothing_at_final_path_while_computing(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    seen = []

    def compute(indices):
        seen.append(store.exists(key))
        return np.zeros((len(indices), 2))

    build(store, key, compute=compute)
    assert seen == [False, False, False]
    assert store.exists(key)


def test_torch_tensor_outputs_accepted(tmp_path):
    weight = torch.ones(3, requires_grad=True)

    def compute(indices):
        return torch.as_tensor(indices, dtype=torch.float32)[:, None] * weight

    features = build(FeatureStore(tmp_path), make_key(), n=9, compute=compute)
    assert features.dtype == np.float32
    np.testing.assert_array_equal(features, np.repeat(np.arange(9, dtype=np.float32)[:, None], 3, axis=1))


def test_inconsistent_batch_shape_raises_naming_the_batch(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()

    def grows(indices):
        return np.zeros((len(indices), 3 if indices[0] == 0 else 4))

    with pytest.raises(ValueError, match="batch 1"):
        build(store, key, compute=grows)

    def short(indices):
        return np.zeros((2, 3))

    with pytest.raises(ValueError, match="batch 0.*expected 4 rows"):
        build(store, key, compute=short)
    assert list(tmp_path.iterdir()) == []


def test_unsafe_cast_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cast"):
        build(FeatureStore(tmp_path), make_key(), dtype="int32")


def test_cached_item_count_mismatch_is_an_error(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key, n=10)
    with pytest.raises(FeatureCacheError, match="12"):
        build(store, key, n=12)


def test_clear_removes_the_cache(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    build(store, key)
    store.clear(key)
    assert not store.exists(key) and store.open(key) is None
    store.clear(key)  # clearing an absent cache is fine


def test_progress_bar_path_runs(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    features = store.get_or_compute(key, 5, CountingCompute(), batch_size=2, progress=True, description="unet")
    np.testing.assert_array_equal(features, expected_features(5))


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="verify"):
        FeatureStore(tmp_path, verify="fast")
    with pytest.raises(ConfigError, match="num_items"):
        FeatureStore(tmp_path).get_or_compute(make_key(), 0, CountingCompute(), progress=False)
    assert replace(make_key(), seed=3).seed == 3


# ---- chunks: an interrupted extraction resumes where it stopped ----------------------------------------
def chunked(store: FeatureStore, key: FeatureKey, compute, n: int = 10, **kw) -> np.ndarray:
    # Batches of 2, chunks of 4 items: chunks [0, 4), [4, 8), [8, 10).
    return store.get_or_compute(key, n, compute, batch_size=2, chunk_size=4, progress=False, **kw)


def interrupted(store: FeatureStore, key: FeatureKey, fail_at_batch: int = 3) -> None:
    with pytest.raises(RuntimeError, match="GPU fell over"):
        chunked(store, key, CountingCompute(fail_at_batch=fail_at_batch))


def test_an_interrupted_extraction_recomputes_only_the_missing_chunks(tmp_path):
    whole_store, key = FeatureStore(tmp_path / "whole"), make_key()
    whole = chunked(whole_store, key, CountingCompute())
    store = FeatureStore(tmp_path / "resumed")
    interrupted(store, key)  # batches 0 and 1 make chunk [0, 4); batch 2 was computed, batch 3 failed
    assert store.open(key) is None
    assert sorted(p.name for p in store.chunks_path(key).glob("chunk-*")) == ["chunk-000000000000.safetensors"]
    compute = CountingCompute()
    resumed = chunked(store, key, compute)
    assert [b.tolist() for b in compute.batches] == [[4, 5], [6, 7], [8, 9]]
    np.testing.assert_array_equal(resumed, whole)
    assert (store.path(key) / "features.npy").read_bytes() == (whole_store.path(key) / "features.npy").read_bytes()
    assert not store.chunks_path(key).exists()  # removed once the features are cached
    assert [p.name for p in (tmp_path / "resumed").iterdir()] == [store.path(key).name]


def test_chunk_boundaries_are_whole_batches(tmp_path):
    store, key, compute = FeatureStore(tmp_path), make_key(), CountingCompute()
    store.get_or_compute(key, 11, compute, batch_size=4, chunk_size=5, progress=False)
    # chunk_size 5 rounds up to 8 items: the batches are those of an unchunked extraction
    assert [len(b) for b in compute.batches] == [4, 4, 3]


def test_chunks_of_another_batch_size_are_not_mixed_in(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    interrupted(store, key)
    compute = CountingCompute()
    features = store.get_or_compute(key, 10, compute, batch_size=5, chunk_size=5, progress=False)
    assert [b.tolist()[0] for b in compute.batches] == [0, 5]
    np.testing.assert_array_equal(features, expected_features(10))


def test_a_damaged_chunk_is_computed_again(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    interrupted(store, key, fail_at_batch=4)  # chunks [0, 4) and [4, 8) finished
    first = store.chunks_path(key) / "chunk-000000000000.safetensors"
    raw = bytearray(first.read_bytes())
    raw[-2] ^= 0xFF  # a data byte: only the chunk's checksum tells
    first.write_bytes(bytes(raw))
    compute = CountingCompute()
    features = chunked(store, key, compute)
    assert [b.tolist() for b in compute.batches] == [[0, 1], [2, 3], [8, 9]]
    np.testing.assert_array_equal(features, expected_features(10))


def test_rebuild_discards_finished_chunks(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    interrupted(store, key)
    compute = CountingCompute()
    chunked(store, key, compute, rebuild=True)
    assert len(compute.batches) == 5


def test_leftover_chunks_beside_a_finished_cache_are_removed(tmp_path):
    store, key = FeatureStore(tmp_path), make_key()
    chunked(store, key, CountingCompute())
    store.chunks_path(key).mkdir()
    (store.chunks_path(key) / "chunk-000000000000.safetensors").write_bytes(b"left by a killed process")
    compute = CountingCompute()
    chunked(store, key, compute)
    assert compute.batches == [] and not store.chunks_path(key).exists()


def test_progress_of_a_resumed_extraction_starts_at_its_finished_chunks(tmp_path, monkeypatch):
    import fedguide.guidance.store as store_module

    store, key = FeatureStore(tmp_path), make_key()
    interrupted(store, key)
    seen = []
    real = store_module.progress_bar

    def spy(total, description, **kw):
        seen.append((total, kw["completed"]))
        return real(total, description, **kw)

    monkeypatch.setattr(store_module, "progress_bar", spy)
    chunked(store, key, CountingCompute())
    assert seen == [(10, 4)]
