"""Personalised accuracy where people look: the results table, pivots and --vs (eval.mode personal/both)."""
from __future__ import annotations

import csv
import io

import pytest

from fedguide.report import paired_comparisons, pivot_data, report, results_table
from tests.report.report_runs import make_run, table_rows


def personal_runs(tmp_path):
    """FedAvg and FedRep, seeds 0 and 1; FedRep's personal accuracy 0.85 + seed/100, FedAvg's 0.60 + seed/100."""
    out = []
    for method, level in (("fedavg", 0.60), ("fedrep", 0.85)):
        for seed in (0, 1):
            p = level + seed / 100
            out.append(make_run(tmp_path, f"{method}-{seed}", method, seed, curve=[0.3, 0.4, 0.5, 0.6],
                                metrics_extra={"personal_accuracy": p, "personal_accuracy_min": p - 0.2,
                                               "personal_accuracy_bottom10": p - 0.1}))
    return out


def test_the_results_table_shows_personal_accuracy_beside_the_global(tmp_path):
    text = results_table(personal_runs(tmp_path))
    header = text.splitlines()[0].strip("| ").split(" | ")
    col = header.index("personal last-k acc %")
    rows = {r[0]: r for r in table_rows(text)}
    assert rows["fedrep"][col] == "85.50 ± 0.71" and rows["fedavg"][col] == "60.50 ± 0.71"
    # A run without personal scores leaves the column out.
    plain = make_run(tmp_path / "plain", "avg", "fedavg", 0)
    assert "personal" not in results_table([plain]).splitlines()[0]


@pytest.mark.parametrize("metric, fedrep", [("personal_last_k", 0.855), ("personal_min_last_k", 0.655),
                                            ("personal_bottom10_last_k", 0.755)])
def test_pivots_take_the_personal_metrics(tmp_path, metric, fedrep):
    table = pivot_data(personal_runs(tmp_path), "method", metric=metric)
    cells = {row[0]: row[1].mean for row in table.rows}
    assert cells["fedrep"] == pytest.approx(fedrep)
    assert table.columns[1].startswith("personal")


def test_vs_compares_personal_accuracy_when_asked(tmp_path):
    runs = personal_runs(tmp_path)
    [c] = paired_comparisons(runs, "fedavg", metric="personal_last_k")
    assert c.method == "fedrep" and c.last_k == pytest.approx([0.25, 0.25]) and c.final == pytest.approx([0.25, 0.25])
    [g] = paired_comparisons(runs, "fedavg")  # the global accuracy by default: the curves are equal
    assert g.last_k == pytest.approx([0.0, 0.0])
    res = report(runs, tmp_path / "out", vs="fedavg", metric="personal_last_k", fmt="csv")
    assert list(csv.reader(io.StringIO(res.paired)))[0][4] == "Δ last-k personal acc pp [95 % CI]"
