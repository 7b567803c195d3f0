"""Generated images beside client originals of the same class: SD_Gen's synthetic set end to end, FedDISC's
kept images read from their file, the rows taking the clients in turn."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fedguide.analysis import analyze
from fedguide.analysis.figures.samples import Generated, generated_images, row_pairs
from fedguide.analysis.opened import AnalysisRun
from fedguide.methods.frozen_encoder.centroids.feddisc import SAMPLES_FILE
from fedguide.registry import ConfigError


def test_rows_take_the_clients_in_turn():
    clients = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    labels = torch.tensor([3, 1, 2, 2, 5, 4, 0])
    gen = Generated(torch.zeros(7, 3, 2, 2), labels, clients, [])
    assert row_pairs(gen, 4) == [(0, 1), (0, 2), (1, 4), (2, 0)]
    assert row_pairs(gen, 10) == [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (2, 0)]


def test_feddisc_samples_file_is_read_as_unit_rgb(tmp_path):
    images = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 4, 4).contiguous()
    save_file({"images": images, "labels": torch.tensor([1, 7]), "clients": torch.tensor([-1, 2])},
              str(tmp_path / SAMPLES_FILE))
    gen = generated_images(tmp_path)
    assert gen.images.shape == (2, 3, 4, 4) and gen.images[0].max() == 0 and gen.images[1].min() == 1
    assert gen.labels.tolist() == [1, 7] and gen.clients.tolist() == [-1, 2] and SAMPLES_FILE in gen.sources[0]
    assert generated_images(tmp_path / "nothing") is None


def test_generated_images_beside_the_clients_own_images(sd_gen_run):
    result = analyze(sd_gen_run, ["samples"])
    assert [p.name for p in result.written["samples"]] == ["samples.png", "samples.json"]
    data = json.loads((sd_gen_run / "analysis" / "samples.json").read_text())
    run = AnalysisRun(sd_gen_run)
    counts = np.array(run.partition["counts"])
    labels = run.splits.train_y.numpy()
    held = [{c for c in range(10) if counts[k, c] > 0} for k in range(2)]
    assert {(r["client"], r["class"]) for r in data["rows"]} == {(k, c) for k in range(2) for c in held[k]}
    for row in data["rows"]:
        assert row["generated_of_pair"] == 2 == row["generated_shown"]  # images_per_class
        own = set(run.prepared.data.client_indices[row["client"]].tolist())
        assert row["original_indices"] and set(row["original_indices"]) <= own
        assert (labels[row["original_indices"]] == row["class"]).all() and row["originals_from"] == f"client {row['client']}"
    assert data["generated_total"] == 8


def test_a_run_without_generated_images_is_refused_when_asked(fedavg_run):
    with pytest.raises(ConfigError, match="--samples does not apply.*no generated images"):
        analyze(fedavg_run, ["samples"])
