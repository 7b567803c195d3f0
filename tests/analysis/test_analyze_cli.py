"""``fedguide analyze`` on the command line (in process): every figure that applies by default, a clear error
for a folder that is not a finished run and for a figure that does not apply, and ``report`` linking them."""
import json
import shutil

import pytest

from fedguide.analysis import analyze
from fedguide.cli import main
from fedguide.registry import ConfigError
from fedguide.report import report


def test_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a fedguide run directory" in err and "Traceback" not in err


def test_an_unfinished_run_is_a_clear_error(tmp_path, fedavg_run, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(fedavg_run / "config.yaml", unfinished / "config.yaml")
    assert main(["analyze", str(unfinished), "--tsne"]) == 2
    err = capsys.readouterr().err
    assert "is not a finished run" in err and f"fedguide resume {unfinished}" in err


def test_a_run_whose_partition_cannot_be_rebuilt_is_refused(tmp_path, fedavg_run):
    copy = tmp_path / "copy"
    shutil.copytree(fedavg_run, copy, ignore=shutil.ignore_patterns("analysis", "plots"))
    partition = json.loads((copy / "partition.json").read_text())
    partition["counts"][0][0] += 1  # as if the data or the partitioner had changed since the run
    (copy / "partition.json").write_text(json.dumps(partition))
    with pytest.raises(ConfigError, match="differs from partition.json"):
        analyze(copy, ["sl_cr"])


def test_no_flag_makes_every_figure_that_applies(fedavg_run, capsys):
    assert main(["analyze", str(fedavg_run), "--points", "60"]) == 0
    out = capsys.readouterr().out
    for name in ("tsne", "weight_norms", "sl_cr", "flops"):
        assert (fedavg_run / "analysis" / f"{name}.png").is_file() and (fedavg_run / "analysis" / f"{name}.json").is_file()
    assert "pca: skipped" in out and "samples: skipped" in out


def test_a_named_figure_that_does_not_apply_is_an_error(fedavg_run, capsys):
    assert main(["analyze", str(fedavg_run), "--samples", "--sl-cr"]) == 2
    assert "--samples does not apply" in capsys.readouterr().err


def test_report_links_the_analysis_figures(fedavg_run):
    main(["analyze", str(fedavg_run), "--sl-cr"])
    markdown = report([fedavg_run]).markdown  # one run: the report goes to RUN/plots/
    assert "## Analysis figures" in markdown
    assert f"![{fedavg_run.name}: sl_cr](../analysis/sl_cr.png)" in markdown
