"""fedguide report DIR...: run folders and the run folders below sweep folders, through the command line."""
from __future__ import annotations

import csv
import io

import pytest
import yaml

from fedguide.cli import main
from fedguide.report import find_run_dirs, load_run, report
from tests.report.report_runs import make_run, table_rows


@pytest.fixture
def sweep(tmp_path):
    """A sweep folder: two runs, a nested sweep, the report folder a sweep writes beside its runs, and a
    run's own plots/ (report.md and PNGs, no config.yaml)."""
    root = tmp_path / "sweep"
    make_run(root, "name=fedavg", "fedavg", 0, curve=[0.1, 0.2, 0.3, 0.4])
    make_run(root, "name=fedprox", "fedprox", 0, curve=[0.1, 0.2, 0.4, 0.5])
    make_run(root / "more", "name=fedavg-s1", "fedavg", 1, curve=[0.1, 0.2, 0.3, 0.6])
    for folder in (root / "report-20250101-120000", root / "name=fedavg" / "plots"):
        folder.mkdir(parents=True)
        (folder / "report.md").write_text("# fedguide report\n")
        (folder / "accuracy_curves.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return root


def test_sweep_folders_are_searched_for_run_folders(sweep):
    found = find_run_dirs([sweep])
    assert [p.relative_to(sweep).as_posix() for p in found] == ["more/name=fedavg-s1", "name=fedavg", "name=fedprox"]
    # A run folder given directly and again through its parent is one run.
    assert find_run_dirs([sweep / "name=fedavg", sweep]) == [sweep / "name=fedavg", *found[:1], found[2]]


def test_a_folder_without_runs_says_what_to_pass(tmp_path, sweep):
    with pytest.raises(ValueError, match="holds no run folder .*sweep's --out"):
        find_run_dirs([sweep / "report-20250101-120000"])
    with pytest.raises(ValueError, match="is not a directory"):
        find_run_dirs([tmp_path / "missing"])


def test_a_run_that_has_not_finished_a_round_is_listed_as_incomplete(tmp_path):
    d = tmp_path / "starting"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"method": {"name": "fedavg"}, "train": {"rounds": 4}, "seed": 0}))
    rec = load_run(d)
    assert rec.status == "incomplete, 0/4 rounds" and rec.accuracy_last_k is None
    assert report([d], tmp_path / "out").markdown.count("incomplete, 0/4 rounds") == 2  # table and run list


def test_report_of_a_sweep_twice_through_the_command_line(sweep, capsys):
    assert main(["report", str(sweep)]) == 0
    first = capsys.readouterr().out
    assert "last-k acc % (mean ± std)" in first.splitlines()[0]
    assert {r[0] for r in table_rows(first)} == {"fedavg", "fedprox"}
    # The report folder the first call wrote into the sweep folder is not a run.
    assert main(["report", str(sweep), "--rows", "method", "--format", "csv", "--vs", "fedavg"]) == 0
    out = capsys.readouterr().out
    pivot, paired = out.split("\n\n")[:2]
    rows = list(csv.reader(io.StringIO(pivot)))
    assert rows[0] == ["method", "last-k acc %", "last-k acc % std", "a", "a std", "b", "b std"]
    assert rows[1][0] == "fedavg" and float(rows[1][1]) == pytest.approx(40.0)  # seeds 0, 1: 0.35, 0.45
    # --vs in the format asked for: a CSV of plain numbers, also written beside the pivot.
    paired_rows = list(csv.reader(io.StringIO(paired)))
    assert paired_rows[0][4:7] == ["Δ last-k acc pp [95 % CI]", "Δ last-k acc pp [95 % CI] low",
                                   "Δ last-k acc pp [95 % CI] high"]
    assert "seed 1: only fedavg" in paired_rows[1][-1]
    assert (sweep / "report" / "paired.csv").read_text() == paired + "\n"
    # Reported again, the sweep's report/ is replaced, not joined by another folder; --keep-previous keeps it.
    assert sorted(p.name for p in sweep.glob("report*")) == ["report", "report-20250101-120000"]
    assert main(["report", str(sweep), "--keep-previous"]) == 0
    assert len(list(sweep.glob("report-*"))) == 2 and (sweep / "report" / "report.md").is_file()


def test_command_line_errors_are_one_sentence(sweep, capsys):
    assert main(["report", str(sweep), "--vs", "scaffold"]) == 2
    assert capsys.readouterr().err.startswith("error: --vs scaffold: no complete run of that method")
    assert main(["report", str(sweep), "--last-k", "3"]) == 2
    assert "even number" in capsys.readouterr().err
