"""The Python API (``import fedguide``) as a user calls it, and the example under examples/ that uses it."""
from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import fedguide
from fedguide.config import Config
from tests.tiny import Crash, crash_after, tiny_raw, without_timing

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
RAW = tiny_raw(train={"rounds": 2})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One finished FedProx run through the API."""
    out = tmp_path_factory.mktemp("api") / "fedprox"
    return fedguide.run(RAW, {"method.name": "fedprox", "method.mu": 0.5}, out=out, quiet=True)


def test_run_returns_the_record_of_its_run_folder(reference):
    assert reference.path.name == "fedprox" and (reference.path / "summary.json").is_file()
    assert reference.summary["method"] == "fedprox" and reference.summary["method_params"]["mu"] == 0.5
    assert reference.config["method"] == {"name": "fedprox", "mu": 0.5, "gradient": "direct"}
    assert [m["round"] for m in reference.metrics] == [1, 2]
    assert reference.summary["final_accuracy"] == reference.metrics[-1]["accuracy"]


def test_run_refuses_a_folder_that_holds_a_run(reference):
    with pytest.raises(fedguide.ConfigError, match="already holds a run"):
        fedguide.run(RAW, out=reference.path, quiet=True)


def test_resume_continues_a_crashed_run_to_the_uninterrupted_result(reference, tmp_path):
    with pytest.raises(Crash):
        fedguide.run(RAW, ["method.name=fedprox", "method.mu=0.5"], out=tmp_path / "r", log=crash_after(2))  # the header, round 1
    assert not (tmp_path / "r" / "summary.json").exists()
    lines = []
    resumed = fedguide.resume(tmp_path / "r", log=lines.append)
    assert lines[0].startswith("resuming") and "after round 1" in lines[0]
    assert without_timing(resumed.metrics) == without_timing(reference.metrics)


def test_resume_of_a_finished_run_returns_it_untouched(reference):
    before = (reference.path / "summary.json").read_bytes()
    assert fedguide.resume(reference.path, quiet=True).summary == reference.summary
    assert (reference.path / "summary.json").read_bytes() == before


def test_a_config_is_a_path_a_mapping_or_a_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RAW))
    overrides = ["method.mu=0.5", "method.name=fedprox"]
    from_path = fedguide.load(path, overrides)
    assert from_path.method.params_dict() == {"mu": 0.5}
    assert fedguide.load(RAW, {"method.name": "fedprox", "method.mu": 0.5}) == from_path
    assert fedguide.load(Config.model_validate(RAW), overrides) == from_path
    assert fedguide.load(RAW, "seed=7").seed == 7
    with pytest.raises(fedguide.ConfigError, match="pass a YAML file's path, a mapping or a fedguide Config"):
        fedguide.load(42)


def test_sweep_runs_every_combination_once(tmp_path):
    records = fedguide.sweep(RAW, {"method.name": ["fedavg", "fedprox"]}, {"train.rounds": 1}, out=tmp_path, quiet=True)
    assert [r.path.name for r in records] == ["name=fedavg", "name=fedprox"]
    assert [r.summary["method"] for r in records] == ["fedavg", "fedprox"]
    stamps = [(r.path / "summary.json").stat().st_mtime_ns for r in records]
    lines = []
    again = fedguide.sweep(RAW, ["method.name=[fedavg, fedprox]"], ["train.rounds=1"], out=tmp_path, log=lines.append)
    assert [r.summary for r in again] == [r.summary for r in records]
    assert [(r.path / "summary.json").stat().st_mtime_ns for r in again] == stamps
    assert lines == [f"[1/2] method.name=fedavg: finished before, skipped -> {tmp_path / 'name=fedavg'}",
                     f"[2/2] method.name=fedprox: finished before, skipped -> {tmp_path / 'name=fedprox'}"]


def test_write_report_takes_records(reference, tmp_path):
    result = fedguide.write_report([reference], tmp_path / "report")
    assert result.markdown_path == tmp_path / "report" / "report.md" and "fedprox" in result.markdown
    assert result.plot_paths and all(p.read_bytes()[:8] == PNG for p in result.plot_paths)
    assert "| fedprox |" in fedguide.results_table([reference.path])
    assert fedguide.load_run(reference.path).summary == reference.summary


def test_import_fedguide_loads_the_api_on_first_use():
    code = ("import sys, fedguide; assert 'torch' not in sys.modules and 'fedguide.api' not in sys.modules; "
            "print(callable(fedguide.run), 'fedguide.api' in sys.modules, 'sweep' in dir(fedguide))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fedguide.nope  # noqa: B018


def test_the_example_runs_and_writes_its_table_plot_and_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "example"
    monkeypatch.setattr(sys, "argv", ["compare_methods.py", str(out), "--rounds", "2", "--fraction", "0.5"])
    runpy.run_path(str(REPO / "examples" / "compare_methods.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "| fedavg | digits |" in printed and "| fedprox | digits |" in printed
    assert (out / "accuracy.png").read_bytes()[:8] == PNG
    assert (out / "report" / "report.md").is_file()
    for method in ("fedavg", "fedprox"):
        s = json.loads((out / f"name={method}" / "summary.json").read_text())
        assert s["rounds"] == 2 and s["method"] == method


def test_a_sweep_says_whose_round_each_line_is(tmp_path):
    lines = []
    fedguide.sweep(RAW, ["seed=0,1"], {"train.rounds": 1}, out=tmp_path, log=lines.append)
    rounds = [line for line in lines if "round   1/1" in line]
    assert [line.split("  round")[0] for line in rounds] == ["[1/2] seed=0", "[2/2] seed=1"]


def test_the_results_functions_take_a_sweep_folder_as_a_string(tmp_path):
    """The module docstring's example: tables, the pivot, --vs and the report from a sweep folder given as a
    plain string, in every format the command line has."""
    import csv
    import io

    fedguide.sweep(RAW, {"method.name": ["fedavg", "fedprox"], "seed": [0, 1]}, {"train.rounds": 2},
                   out=tmp_path / "sweep", quiet=True)
    folder = str(tmp_path / "sweep")
    assert [r.method for r in fedguide.load_runs(folder)] == ["fedavg", "fedavg", "fedprox", "fedprox"]
    assert "| fedavg |" in fedguide.results_table(folder) and "| fedprox |" in fedguide.results_table(folder)
    latex = fedguide.pivot_table(folder, rows="method", cols="dataset", fmt="latex")
    assert latex.startswith(r"\begin{tabular}") and "fedprox" in latex
    rows = list(csv.reader(io.StringIO(fedguide.paired_table(folder, vs="fedavg", fmt="csv"))))
    assert rows[1][0] == "fedprox" and rows[1][3] == "0, 1"  # both seeds paired
    result = fedguide.write_report(folder, vs="fedavg", fmt="latex")
    assert result.out_dir == tmp_path / "sweep" / "report" and result.paired_path.name == "paired.tex"
    with pytest.raises(ValueError, match="for a folder of runs, such as a sweep's --out, use load_runs"):
        fedguide.load_run(folder)


def test_sweep_raise_rounds_report_vs_pairs_only_runs_of_equal_length(tmp_path):
    """Two methods over two seeds for 2 rounds, then FedAvg's runs raised to 3: --vs must not pair a 2-round
    FedProx with a 3-round FedAvg, and names why."""
    out = tmp_path / "cmp"
    fedguide.sweep(RAW, {"method.name": ["fedavg", "fedprox"], "seed": [0, 1]}, {"train.rounds": 2}, out=out,
                   quiet=True)
    fedguide.sweep(RAW, {"method.name": ["fedavg"], "seed": [0, 1]}, {"train.rounds": 3}, out=out, quiet=True)
    records = fedguide.load_runs(out)
    assert sorted((r.method, r.config["train"]["rounds"], r.rounds_done) for r in records) == [
        ("fedavg", 3, 3), ("fedavg", 3, 3), ("fedprox", 2, 2), ("fedprox", 2, 2)]
    [c] = fedguide.report.paired_comparisons(records, "fedavg")
    assert c.seeds == [] and c.unpaired == [f"seed {s}: no fedavg run with the same settings (train.rounds differs)"
                                            for s in (0, 1)]
