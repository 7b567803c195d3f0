"""The one-shot servers' generated images and features are sealed: a chunk of a run's own synthetic set or a
generation-cache entry that does not verify is generated again (and said), a damaged chunk of a reused set
is refused naming the file, and sets written before sealing are still read."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from fedguide.methods._synthetic import GenerationJob, SyntheticStore, generate_set
from fedguide.methods.frozen_encoder.centroids._generation_cache import GenerationCache, batch_key
from fedguide.registry import ConfigError
from tests.methods.one_shot.test_fedcado import splits_of


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def job(calls: list) -> GenerationJob:
    def generate(prompts, labels, first):
        calls.append(first)
        g = torch.Generator().manual_seed(first)
        return SimpleNamespace(images=torch.rand(len(labels), 3, 8, 8, generator=g) * 2 - 1)

    return GenerationJob(0, [0, 1], {"class_names": ["cat", "dog", "car"]}, generate)


def make_set(store, calls):
    return generate_set(store, [job(calls)], lambda labels: ["x"] * len(labels), 2, 2, splits_of())


def test_a_damaged_chunk_of_the_runs_own_set_is_generated_again(tmp_path, capsys):
    store, calls = SyntheticStore(tmp_path / "synthetic"), []
    first, _ = make_set(store, calls)
    assert calls == [0, 2]  # two chunks of two images
    _, stats = make_set(store, calls)
    assert calls == [0, 2] and stats.reused_chunks == 2  # intact chunks are read back
    flip_last_byte(store.chunk_path(0, 1))
    again, stats = make_set(store, calls)
    assert calls == [0, 2, 2] and stats.reused_chunks == 1  # only the damaged chunk is generated again
    assert "chunk_0001.safetensors cannot be trusted" in capsys.readouterr().err
    assert torch.equal(again.inputs(torch.arange(4)), first.inputs(torch.arange(4)))


def test_a_damaged_chunk_of_a_reused_set_is_refused_naming_it(tmp_path):
    store = SyntheticStore(tmp_path / "synthetic")
    make_set(store, [])
    assert len(SyntheticStore.reused(str(tmp_path)).parts(0)) == 2
    flip_last_byte(store.chunk_path(0, 0))
    with pytest.raises(ConfigError, match=r"synthetic set: .*chunk_0000.safetensors cannot be trusted.*"
                                          r"reuse_synthetic"):
        SyntheticStore.reused(str(tmp_path)).parts(0)


def test_a_sealed_chunk_that_lost_its_metadata_digest_is_refused_not_read_as_an_older_one(tmp_path):
    from safetensors import safe_open

    store = SyntheticStore(tmp_path / "synthetic")
    make_set(store, [])
    path = store.chunk_path(0, 0)
    with safe_open(str(path), "pt") as fh:
        meta, tensors = dict(fh.metadata()), {k: fh.get_tensor(k) for k in fh.keys()}
    del meta["metadata_sha256"]
    save_file(tensors, path, metadata=meta)
    with pytest.raises(ConfigError, match="cannot be trusted"):
        SyntheticStore.reused(str(tmp_path)).parts(0)


def test_a_chunk_written_before_sealing_is_read_with_a_warning(tmp_path, capsys):
    folder = tmp_path / "synthetic" / "client_000"
    folder.mkdir(parents=True)
    save_file({"images": torch.zeros(2, 1, 8, 8, dtype=torch.uint8), "labels": torch.tensor([0, 1])},
              folder / "chunk_0000.safetensors", metadata={"recipe": json.dumps({"class_names": ["a", "b"]})})
    store = SyntheticStore.reused(str(tmp_path))
    assert store.parts(0)[0][2].tolist() == [0, 1]
    assert "written before chunk files carried a checksum" in capsys.readouterr().err
    assert json.loads(store.metadata(0)["recipe"])["class_names"] == ["a", "b"]


def test_a_damaged_generation_cache_entry_is_generated_again(tmp_path, capsys):
    cache, key = GenerationCache(tmp_path / "cache"), batch_key({"steps": 2}, {"c": torch.ones(2)})
    cache.save((0, 0), key, {"features": torch.arange(6.0).view(2, 3)})
    assert torch.equal(cache.load((0, 0), key)["features"], torch.arange(6.0).view(2, 3))
    flip_last_byte(cache.path(0, 0))
    assert cache.load((0, 0), key) is None
    assert "cannot be trusted" in capsys.readouterr().err
