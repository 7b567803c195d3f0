"""The pivot into the papers' table shape, and the CSV and LaTeX renderings."""
from __future__ import annotations

import csv
import io

import pytest

from fedguide.report import pivot_data, pivot_table, report, results_table
from tests.report.report_runs import make_run, table_rows, with_config

CURVE = [0.10, 0.20, 0.30, 0.50]  # 4 rounds: k = 2, accuracy_last_k = mean of rounds 3 and 4


def run(root, method, alpha, seed, level, **kw):
    """A run whose accuracy_last_k is ``level`` (rounds 3, 4 = level -/+ 0.01) and final level + 0.01."""
    d = make_run(root, f"{method}-a{alpha}-s{seed}", method, seed, curve=[0.1, 0.2, level - 0.01, level + 0.01],
                 partition_label=f"dirichlet(alpha={alpha})", **kw)
    return with_config(d, partition__alpha=alpha)


@pytest.fixture
def grid(tmp_path):
    """fedavg and fedprox on two partitions, two seeds each."""
    levels = {("fedavg", 0.1): (0.50, 0.54), ("fedavg", 0.5): (0.70, 0.74),
              ("fedprox", 0.1): (0.60, 0.62), ("fedprox", 0.5): (0.60, 0.66)}
    return [run(tmp_path, m, a, s, lv[s]) for (m, a), lv in levels.items() for s in (0, 1)]


def test_pivot_shape_values_and_bold_best(grid):
    table = pivot_data(grid, "method", "partition")
    assert table.columns[:3] == ["method \\ partition", "dirichlet(alpha=0.1)", "dirichlet(alpha=0.5)"]
    assert [r[0] for r in table.rows] == ["fedavg", "fedprox"]
    md = pivot_table(grid, "method", "partition")
    rows = table_rows(md)
    # mean ± std over seeds of accuracy_last_k: (0.50, 0.54), (0.70, 0.74), (0.60, 0.62), (0.60, 0.66)
    assert rows[0][1:3] == ["52.00 ± 2.83", "**72.00 ± 2.83**"]
    assert rows[1][1:3] == ["**61.00 ± 1.41**", "63.00 ± 4.24"]
    assert "mean ± sample std" in md and "bold = best" in md


def test_pivot_takes_per_domain_columns_and_other_metrics(grid):
    table = pivot_data(grid, "partition", "method", metric="final")
    assert table.columns == ["partition \\ method", "fedavg", "fedprox", "fedavg: a", "fedavg: b", "fedprox: a",
                             "fedprox: b"]
    first = table.rows[0]  # alpha=0.1: finals fedavg (0.51, 0.55), fedprox (0.61, 0.63)
    assert first[0] == "dirichlet(alpha=0.1)"
    assert first[1].mean == pytest.approx(0.53) and first[2].mean == pytest.approx(0.62)
    assert first[5].mean == pytest.approx(0.62) and first[6].mean == pytest.approx(0.31)  # domain b = acc / 2
    best = pivot_data(grid, "method", metric="best")  # one column: the metric
    assert best.columns[:2] == ["method", "best acc %"] and best.rows[0][1].mean == pytest.approx(0.53)


def test_per_client_columns_where_the_runs_report_them(tmp_path):
    d = make_run(tmp_path, "local", "local", 0, curve=CURVE,
                 metrics_extra={"client_accuracy_min": 0.25, "client_accuracy_max": 0.75,
                                "client_class_accuracy": {"0": 0.3, "1": 0.6}})
    table = pivot_data([d], "method")
    assert table.columns == ["method", "last-k acc %", "a", "b", "client 0", "client 1", "client min",
                             "client max"]
    assert [c.mean for c in table.rows[0][1:]] == pytest.approx([0.40, 0.40, 0.20, 0.3, 0.6, 0.25, 0.75])


def test_a_setting_that_is_no_axis_splits_rows_never_cells(grid, tmp_path):
    extra = [with_config(run(tmp_path / "lr", "fedavg", 0.1, s, 0.9), train__lr=0.5) for s in (0, 1)]
    table = pivot_data(grid + extra, "method", "partition")
    labels = [r[0] for r in table.rows]
    assert labels == ["fedavg [train.lr=0.5]", "fedavg [train.lr=unset]", "fedprox [train.lr=unset]"]
    assert table.rows[0][1].mean == pytest.approx(0.9) and table.rows[0][2] == ""


def test_repeated_seed_cell_is_not_averaged(tmp_path):
    runs = [run(tmp_path / "a", "fedavg", 0.1, 0, 0.5), run(tmp_path / "b", "fedavg", 0.1, 0, 0.7)]
    cell = pivot_data(runs, "method", "partition").rows[0][1]
    assert cell.mean is None and cell.note == "seed 0 repeated"


@pytest.mark.parametrize("rows,cols,message", [
    ("train.lrr", None, "no run has this config key"),
    ("seed", None, "seed cannot be an axis"),
    ("method", "method", "two different keys"),
])
def test_bad_axes_say_what_to_write(grid, rows, cols, message):
    with pytest.raises(ValueError, match=message):
        pivot_data(grid, rows, cols)


def test_csv_is_plain_numbers(grid):
    text = pivot_table(grid, "method", "partition", fmt="csv")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0][:5] == ["method \\ partition", "dirichlet(alpha=0.1)", "dirichlet(alpha=0.1) std",
                           "dirichlet(alpha=0.5)", "dirichlet(alpha=0.5) std"]
    assert rows[1][0] == "fedavg" and [float(v) for v in rows[1][1:5]] == pytest.approx([52, 2.828427, 72, 2.828427])
    assert "**" not in text and "±" not in text


def test_latex_is_a_tabular_with_bold_best(grid):
    text = pivot_table(grid, "method", "partition", fmt="latex")
    lines = text.splitlines()
    assert lines[0] == r"\begin{tabular}{lrrrrrr}" and lines[-1] == r"\end{tabular}"
    fedavg = next(line for line in lines if line.startswith("fedavg &"))
    assert fedavg.startswith(r"fedavg & 52.00 $\pm$ 2.83 & \textbf{72.00 $\pm$ 2.83} &") and fedavg.endswith(r"\\")


def test_results_table_in_csv_and_latex(grid):
    rows = list(csv.reader(io.StringIO(results_table(grid, fmt="csv"))))
    header = rows[0]
    assert header[:7] == ["method", "dataset", "partition", "clients", "rounds", "seeds", "last k"]
    last = header.index("last-k acc % mean")
    assert header[last + 1] == "last-k acc % std" and "best acc % mean" in header
    assert rows[1][0] == "fedavg" and float(rows[1][last]) == pytest.approx(72.0)
    latex = results_table(grid, fmt="latex")
    assert latex.startswith(r"\begin{tabular}") and r"best acc$^\dagger$ \%" in latex


def test_report_writes_the_pivot_file_in_the_format_asked_for(grid, tmp_path):
    res = report(grid, tmp_path / "out", rows="method", cols="partition", fmt="latex")
    assert res.table_path == tmp_path / "out" / "pivot.tex" and res.table_path.read_text() == res.table
    assert "## method × partition" in res.markdown and "**72.00 ± 2.83**" in res.markdown
    with pytest.raises(ValueError, match="--cols needs --rows"):
        report(grid, tmp_path / "bad", cols="partition")
    assert not (tmp_path / "bad").exists()
