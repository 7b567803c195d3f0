"""FEMNIST from LEAF's JSON files: a tiny fixture in LEAF's format (TalwalkarLab/leaf,
data/femnist/preprocess/data_to_json.py lines 1-5 and 59-83: users, num_samples, user_data {x: 784 pixels / 255,
y: labels 0..61 by ``relabel_class``, lines 25-38}), the writers as groups, the error without the files, and a
two-round FedAvg run on it with the ``natural`` partition."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedguide.config import build_config, load_config
from fedguide.data.sources import DATASETS, SourceParams
from fedguide.data.sources.femnist import CLASS_NAMES
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.registry import ConfigError

REPO = Path(__file__).resolve().parents[2]
# writer -> (train labels, test labels); written unsorted, in two train files, so order is the loader's doing
WRITERS = {"f0300_41": ([10, 35, 36, 61], [10]), "f0102_07": ([0, 1, 2], [9, 0]), "f0211_33": ([5, 5, 20, 40, 50], [5])}


def pixels(writer: str, n: int, split: str) -> list[list[float]]:
    rng = np.random.default_rng([zlib.crc32(writer.encode()), split == "test"])
    return (rng.integers(0, 256, size=(n, 784)) / 255).tolist()


def write_leaf(folder: Path, writers=WRITERS, x=pixels) -> dict:
    """LEAF's data/femnist/data/{train,test}/*.json for ``writers``; returns what was written."""
    written = {"train": {}, "test": {}}
    order = list(writers)
    for split, files in (("train", [order[:1], order[1:]]), ("test", [order])):
        (folder / split).mkdir(parents=True, exist_ok=True)
        for i, users in enumerate(files):
            data = {u: {"x": x(u, len(writers[u][split == "test"]), split), "y": writers[u][split == "test"]}
                    for u in users}
            written[split].update(data)
            record = {"users": users, "num_samples": [len(data[u]["y"]) for u in users], "user_data": data}
            (folder / split / f"all_data_{i}_niid_05_keep_0_{split}_9.json").write_text(json.dumps(record))
    return written


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """Only what a test writes is found: no FEDGUIDE_DATA, and the download folder under a fresh home."""
    monkeypatch.delenv("FEDGUIDE_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def load(root):
    entry = DATASETS.get("femnist")
    return entry.obj(SourceParams(root=str(root)))


def test_class_order_is_leafs_relabelling():
    # relabel_class: '30'..'39' -> 0..9, '41'..'5a' -> 10..35, '61'..'7a' -> 36..61 (NIST's hex folder names)
    assert len(CLASS_NAMES) == 62
    assert [CLASS_NAMES[i] for i in (0, 9, 10, 35, 36, 61)] == ["0", "9", "A", "Z", "a", "z"]
    def relabel_class(c):  # data_to_json.py lines 25-38, as written there
        if c.isdigit() and int(c) < 40:
            return int(c) - 30
        return int(c, 16) - 55 if int(c, 16) <= 90 else int(c, 16) - 61

    for hexname in ("30", "39", "41", "5a", "61", "7a"):
        assert CLASS_NAMES[relabel_class(hexname)] == chr(int(hexname, 16))


def test_loader_reads_writers_as_groups_and_normalises_with_train_statistics(isolated):
    root = isolated / "leaf" / "data" / "femnist" / "data"
    written = write_leaf(root)
    splits = load(root)
    names = sorted(WRITERS)
    assert splits.group_names == names and splits.num_classes == 62 and splits.input_shape == (1, 28, 28)
    for split, x, y, g in (("train", splits.train_x, splits.train_y, splits.train_groups),
                           ("test", splits.test_x, splits.test_y, splits.test_groups)):
        # writer by writer in name order, each writer's samples in its file's order
        assert y.tolist() == sum((written[split][w]["y"] for w in names), [])
        assert g.tolist() == sum(([k] * len(written[split][w]["y"]) for k, w in enumerate(names)), [])
        raw = np.concatenate([np.array(written[split][w]["x"], dtype=np.float32) for w in names])
        mean, std = splits.pixel_stats
        # row-major 28x28, as LEAF's CNN reshapes (models/femnist/cnn.py line 20)
        assert torch.allclose(x * std + mean, torch.from_numpy(raw).reshape(-1, 1, 28, 28), atol=1e-5)
    train_raw = np.concatenate([np.array(written["train"][w]["x"]) for w in names])
    assert splits.pixel_stats == pytest.approx((train_raw.mean(), train_raw.std()))
    assert float(splits.train_x.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(splits.train_x.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    assert splits.owner_groups()[1] == names


def test_test_pixels_do_not_change_the_normalisation(isolated):
    a, b = isolated / "a", isolated / "b"
    write_leaf(a)
    write_leaf(b, x=lambda w, n, split: pixels(w, n, split) if split == "train" else np.ones((n, 784)).tolist())
    assert load(a).pixel_stats == load(b).pixel_stats


def test_found_under_the_common_parent_folders(isolated):
    write_leaf(isolated / "clone" / "leaf" / "data" / "femnist" / "data")
    assert len(load(isolated / "clone").train_y) == 12
    assert len(load(isolated / "clone" / "leaf" / "data" / "femnist").train_y) == 12


def test_without_the_files_the_error_names_the_folder_and_leafs_command(isolated):
    empty = isolated / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as err:
        load(empty)
    message = str(err.value)
    assert str(empty) in message and "femnist/data/" in message
    assert "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample" in message and "data.root" in message
    assert not (isolated / "home" / ".cache" / "fedguide" / "femnist").exists(), "nothing is fetched"


def test_the_config_stops_with_that_error_where_the_files_are_absent(isolated, monkeypatch):
    monkeypatch.setenv("FEDGUIDE_DATA", str(isolated / "data"))
    cfg = load_config(REPO / "configs" / "femnist_natural.yaml")
    assert cfg.data.name == "femnist" and cfg.partition.name == "natural"
    with pytest.raises(ConfigError, match=r"preprocess\.sh -s niid"):
        prepare(cfg)


@pytest.mark.parametrize("bad, match", [
    (lambda w, n, s: (np.ones((n, 784)) * 255).tolist(), r"pixels span 255..255, expected 0..1"),
    (lambda w, n, s: np.zeros((n, 783)).tolist(), r"expected \[n, 784\]"),
])
def test_malformed_pixels_are_refused_naming_the_file(isolated, bad, match):
    write_leaf(isolated, x=bad)
    with pytest.raises(ConfigError, match=match):
        load(isolated)


def test_a_writer_in_two_files_of_a_split_is_refused(isolated):
    write_leaf(isolated)
    first = isolated / "train" / "all_data_0_niid_05_keep_0_train_9.json"
    other = json.loads((isolated / "train" / "all_data_1_niid_05_keep_0_train_9.json").read_text())
    record = json.loads(first.read_text())
    record["user_data"]["f0102_07"] = other["user_data"]["f0102_07"]
    first.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="f0102_07.*also in"):
        load(isolated)


def test_labels_outside_the_62_classes_are_refused(isolated):
    write_leaf(isolated, writers={**WRITERS, "f0999_00": ([62], [0])})
    with pytest.raises(ConfigError, match=r"labels span .*expected 0..61"):
        load(isolated)


def run_config(root, **over):
    raw = {"data": {"name": "femnist", "root": str(root)}, "partition": {"name": "natural"},
           "model": {"name": "cnn"}, "method": {"name": "fedavg"}, "clients": {"num": 3, "per_round": 3},
           "train": {"rounds": 2, "epochs": 1, "batch_size": 4, "lr": 0.01},
           "runtime": {"workers": 1, "threads_per_worker": 1}, "seed": 0}
    raw.update(over)
    return build_config(raw)


def test_fedavg_two_rounds_on_the_fixture_one_writer_per_client(isolated):
    root = isolated / "femnist"
    write_leaf(root)
    prepared = prepare(run_config(root))
    names = sorted(WRITERS)
    groups = prepared.data.splits.train_groups.numpy()
    assert [sorted(set(groups[p].tolist())) for p in prepared.data.client_indices] == [[0], [1], [2]]
    Experiment(prepared, isolated / "run", log=lambda s: None).run()
    rows = [json.loads(line) for line in (isolated / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    partition = json.loads((isolated / "run" / "partition.json").read_text())
    # client k holds writer k's training samples, class by class
    assert partition["counts"] == [np.bincount(WRITERS[w][0], minlength=62).tolist() for w in names]
    assert partition["class_names"] == CLASS_NAMES
    # the writers each client owns
    assert partition["groups_per_client"] == [1, 1, 1] and partition["client_groups"] == [[w] for w in names]
    # the class x client heatmap renders a natural partition (62 classes, 3 clients)
    from fedguide.report.plots import make_plots

    pngs = make_plots([isolated / "run"], isolated / "report")
    assert any(p.name.startswith("partition") and p.stat().st_size > 0 for p in pngs)


def test_fewer_clients_than_writers_deal_whole_writers(isolated):
    root = isolated / "femnist"
    write_leaf(root)
    data = prepare(run_config(root, clients={"num": 2, "per_round": 2})).data
    groups = data.splits.train_groups.numpy()
    owned = [sorted(set(groups[p].tolist())) for p in data.client_indices]
    assert sorted(len(o) for o in owned) == [1, 2] and sorted(sum(owned, [])) == [0, 1, 2]
    assert data.group_record()["groups_per_client"] == [len(o) for o in owned]
    with pytest.raises(ConfigError, match=r"4 clients but 3 groups"):
        prepare(run_config(root, clients={"num": 4, "per_round": 4}))


def test_a_scored_test_subset_keeps_each_samples_writer(isolated):
    root = isolated / "femnist"
    write_leaf(root, writers={**WRITERS, "f0102_07": ([0, 1, 2], [0, 0, 0, 0, 9]), "f0211_33": ([5, 5], [0, 0, 0])})
    full = load(root)
    splits = prepare(run_config(root, eval={"test_subset": 0.5})).data.splits
    assert 0 < len(splits.test_y) < len(full.test_y)
    # the kept samples' writers are their own: match each kept image to its row in the full test set
    rows = [int(torch.nonzero((full.test_x == x).all(dim=(1, 2, 3)))[0]) for x in splits.test_x]
    assert splits.test_groups.tolist() == full.test_groups[rows].tolist()
