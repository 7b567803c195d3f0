"""Each client's label histogram before and after the images FedDDA generated for it (``add: lack`` on a Dir 0.05
partition: the classes a client lacks filled up to ⌊n_k/div⌋), drawn by ``fedguide analyze --generated-data`` from
the run's guidance record and shown by ``fedguide report``."""
import json

import numpy as np
import pytest

from fedguide.analysis import analyze
from fedguide.registry import ConfigError
from fedguide.report import report
from tests.analysis.conftest import DIGITS_DOMAINS, finished
from tests.tiny import tiny_config


@pytest.fixture(scope="module")
def feddda_run(tmp_path_factory, tiny_sd):
    cache = tmp_path_factory.mktemp("features")
    cfg = tiny_config({"data": {**DIGITS_DOMAINS, "fraction": 0.05},
                       "partition": {"name": "dirichlet", "alpha": 0.05, "min_size": 5},
                       "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)},
                       "clients": {"num": 3, "per_round": 3}, "train": {"rounds": 1}},
                      method={"name": "feddda", "add": "lack", "steps": 1, "cfg_scale": 1.0, "gen_batch_size": 16})
    return finished(tmp_path_factory, cfg, "feddda")


def test_before_and_after_histograms_of_a_lack_run(feddda_run):
    result = analyze(feddda_run, ["generated_data"])
    out = feddda_run / "analysis"
    assert sorted(p.name for p in result.written["generated_data"]) == [
        "generated_data.json", "generated_data_after.png", "generated_data_before.png"]
    numbers = json.loads((out / "generated_data.json").read_text())
    record = json.loads((feddda_run / "guidance" / "feddda.json").read_text())["generated_data"]["histograms"]
    real, added, after = (np.array(numbers[k]) for k in ("real", "generated", "after"))
    assert real.tolist() == record["real"] and added.tolist() == record["generated"]
    assert np.array_equal(after, real + added) and numbers["add"] == "lack"
    floor = real.sum(1, keepdims=True) // 10
    assert (after >= floor).all()  # every class of every client reaches ⌊n_k / 10⌋
    assert (real < floor).any()  # Dir 0.05: some client lacked a class before
    assert numbers["after_summary"]["classes_held"] == [
        int((row > 0).sum()) for row in after] and numbers["before_summary"]["smallest_class"] == real.min(1).tolist()
    md = report([feddda_run]).markdown
    assert "generated_data_before.png" in md and "generated_data_after.png" in md


def test_a_run_without_generated_data_is_refused_with_the_reason(fedavg_run):
    from fedguide.analysis.figures.generated_data import GeneratedData
    from fedguide.analysis.opened import AnalysisRun

    assert "generated-data histograms" in GeneratedData().applies(AnalysisRun(fedavg_run))
    with pytest.raises(ConfigError, match="--generated-data does not apply"):
        analyze(fedavg_run, ["generated_data"])
