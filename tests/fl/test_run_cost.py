"""A run's cost is its set-up and its rounds: summary.json, the final line and the report say both."""
from __future__ import annotations

import time

import pytest

from fedguide.api import final_line
from fedguide.methods.base import Method
from fedguide.report import results_table
from tests.report.report_runs import make_run, table_rows
from tests.tiny import run_tiny, tiny_config


def test_set_up_time_is_part_of_the_run_s_cost(tmp_path, monkeypatch):
    def slow_setup(self):  # a feature extraction or a generation, as the set-up of a guided method
        time.sleep(1.2)

    monkeypatch.setattr(Method, "setup", slow_setup)
    summary, _, run_dir = run_tiny(tmp_path, tiny_config(train={"rounds": 1}))
    assert summary["setup_seconds"] >= 1.2
    assert summary["wall_seconds"] == pytest.approx(summary["setup_seconds"] + summary["training_seconds"])
    assert 0 < summary["training_seconds"] < summary["wall_seconds"]
    assert f"{summary['wall_seconds']:.0f} s (set-up {summary['setup_seconds']:.0f} s)" in final_line(summary, run_dir)


def test_the_report_s_cost_column_is_the_sum_with_the_set_up_beside_it(tmp_path):
    runs = [make_run(tmp_path, f"s{s}", "feddifrc", s, wall=20.0 + s, summary_extra={"setup_seconds": 8.0 + s})
            for s in range(2)]
    header = results_table(runs).splitlines()[0].strip("| ").split(" | ")
    assert table_rows(results_table(runs))[0][header.index("wall s (mean)")] == "20.5 (set-up 8.5)"
