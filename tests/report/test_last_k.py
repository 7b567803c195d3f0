"""accuracy_last_k and the rounds-to-accuracy marks: the report: config section, summary.json, the report."""
from __future__ import annotations

import pytest

from fedguide.config import ROUND_ACCURACY_MARKS, ReportConfig, build_config, default_last_k
from fedguide.registry import ConfigError
from fedguide.report import load_run, report, results_table, rounds_to_table
from tests.report.report_runs import make_run, table_rows, with_config
from tests.tiny import run_tiny, tiny_config, tiny_raw

LAST, K = 7, 6  # columns of the results table

# An oscillating curve (period 2), 10 rounds: the final round is a high phase.
CURVE = [0.10, 0.30, 0.20, 0.40, 0.30, 0.50, 0.40, 0.60, 0.50, 0.70]


@pytest.mark.parametrize("rounds,k", [(1, 1), (2, 2), (3, 2), (5, 2), (20, 2), (21, 4), (25, 4), (40, 4), (41, 6),
                                      (100, 10), (101, 12), (200, 20)])
def test_default_window_is_the_last_tenth_rounded_up_to_even(rounds, k):
    assert default_last_k(rounds) == k


def test_report_section_defaults_and_explicit_values():
    assert ReportConfig().last_k_for(100) == 10 and ReportConfig().rounds_to == list(ROUND_ACCURACY_MARKS)
    cfg = ReportConfig(last_k=4, rounds_to=[0.4, 0.2, 0.3, 0.2])
    assert cfg.last_k_for(100) == 4 and cfg.last_k_for(3) == 3  # never beyond the rounds evaluated
    assert cfg.rounds_to == [0.2, 0.3, 0.4]  # sorted, each mark once


@pytest.mark.parametrize("section,message", [
    ({"last_k": 3}, "even whole number"),
    ({"last_k": 0}, "even whole number"),
    ({"last_k": True}, "even whole number"),
    ({"rounds_to": [20, 30]}, "fractions"),
    ({"rounds_to": [0.0]}, "in (0, 1]"),
    ({"last_k": 6}, "exceeds train.rounds (3)"),
    ({"lastk": 2}, "valid keys"),
])
def test_bad_report_sections_are_refused_with_the_fix(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build_config(tiny_raw(report=section))


def test_summary_carries_accuracy_last_k_and_the_configured_marks(tmp_path):
    summary, rows, _ = run_tiny(tmp_path, tiny_config(train={"rounds": 4},
                                                      report={"last_k": 2, "rounds_to": [0.4, 0.2, 0.99]}))
    acc = [r["accuracy"] for r in rows]
    assert summary["last_k"] == 2 and summary["accuracy_last_k"] == pytest.approx((acc[2] + acc[3]) / 2)
    assert list(summary["rounds_to_accuracy"]) == ["0.2", "0.4", "0.99"]
    for mark, reached in summary["rounds_to_accuracy"].items():
        assert reached == next((r["round"] for r in rows if r["accuracy"] >= float(mark)), None)
    assert summary["rounds_to_accuracy"]["0.99"] is None  # 4 rounds of an MLP on 8x8 digits stay below 99 %
    # The report reads the run's own numbers back.
    record = load_run(tmp_path / "run")
    assert record.last_k == 2 and record.accuracy_last_k == summary["accuracy_last_k"]
    assert record.rounds_to_marks == [0.2, 0.4, 0.99]


def test_older_runs_get_accuracy_last_k_from_their_curve(tmp_path):
    old = make_run(tmp_path, "old", "fedavg", 0, curve=CURVE)  # a summary without accuracy_last_k
    rec = load_run(old)
    assert rec.last_k == 2 and rec.accuracy_last_k == pytest.approx((0.50 + 0.70) / 2)
    assert rec.accuracy_last(4) == pytest.approx((0.40 + 0.60 + 0.50 + 0.70) / 4)
    # A run whose config set report.last_k (but older than the summary key) uses its own window.
    with_config(make_run(tmp_path, "own", "fedavg", 1, curve=CURVE), report__last_k=4)
    assert load_run(tmp_path / "own").accuracy_last_k == pytest.approx(0.55)


def test_summary_value_is_used_as_written(tmp_path):
    d = make_run(tmp_path, "new", "fedavg", 0, curve=CURVE, summary_extra={"accuracy_last_k": 0.123, "last_k": 2})
    rec = load_run(d)
    assert rec.accuracy_last_k == 0.123  # summary.json is the run's record
    assert rec.accuracy_last(4) == pytest.approx(0.55)  # another window is computed from the curve


def test_results_table_shows_last_k_and_can_recompute_it_at_one_window(tmp_path):
    runs = [make_run(tmp_path, f"s{s}", "fedavg", s, curve=[a + s / 100 for a in CURVE]) for s in range(2)]
    row = table_rows(results_table(runs))[0]
    assert row[K] == "2" and row[LAST] == "60.50 ± 0.71"  # (0.60, 0.61)
    row = table_rows(results_table(runs, last_k=4))[0]
    assert row[K] == "4" and row[LAST] == "55.50 ± 0.71"  # (0.55, 0.56)


def test_runs_with_different_windows_are_compared_at_one(tmp_path):
    a = make_run(tmp_path, "a", "fedavg", 0, curve=CURVE)
    b = with_config(make_run(tmp_path, "b", "fedavg", 1, curve=CURVE), report__last_k=4)
    rows = table_rows(results_table([a, b]))
    assert len(rows) == 1, "report: does not change training: seeds of one setting share a row"
    assert rows[0][K] == "4" and rows[0][LAST] == "55.00 ± 0.00"


def test_rounds_to_table_uses_the_recorded_marks_or_those_asked_for(tmp_path):
    marks = {"0.2": 3, "0.3": 2, "0.4": 4}  # the engine's keys; the report recomputes from the curve
    slow = [0.05, 0.15, 0.12, 0.25, 0.15, 0.28, 0.22, 0.35, 0.25, 0.36]
    runs = [with_config(make_run(tmp_path, f"s{s}", "fedavg", s, curve=[CURVE, slow][s],
                                 summary_extra={"rounds_to_accuracy": marks}), report__rounds_to=[0.2, 0.3, 0.4])
            for s in range(2)]
    text = rounds_to_table(runs)
    header = text.splitlines()[0]
    assert "rounds to 20 %" in header and "rounds to 30 %" in header and "rounds to 40 %" in header
    assert "rounds to 50 %" not in header  # the runs recorded 0.2, 0.3, 0.4 (FedDifRC Table 12), not the defaults
    # seed 0 reaches 20 % at round 2, 30 % at 2, 40 % at 4; seed 1 reaches 20 % at 4, 30 % at 8, 40 % never.
    assert table_rows(text)[0][3:] == ["3", "5", "4 (1/2 seeds)"]
    assert table_rows(rounds_to_table(runs, [0.65]))[0][3:] == ["10 (1/2 seeds)"]
    assert table_rows(rounds_to_table(runs, [0.9]))[0][3:] == ["—"]
    md = report(runs, tmp_path / "out").markdown
    assert "## Rounds to accuracy" in md and "rounds to 40 %" in md


def test_a_mean_over_seeds_of_rounds_is_shown_to_one_decimal(tmp_path):
    runs = [make_run(tmp_path, f"s{s}", "fedavg", s, curve=c)
            for s, c in enumerate(([0.1, 0.6, 0.7], [0.1, 0.2, 0.6], [0.1, 0.2, 0.6]))]
    assert table_rows(rounds_to_table(runs, [0.5]))[0][3:] == ["2.7"]  # rounds 2, 3, 3: not 2.66667


def test_a_window_longer_than_the_runs_is_refused_not_shortened(tmp_path):
    runs = [make_run(tmp_path, f"s{s}", "fedavg", s, curve=[0.1, 0.2, 0.3]) for s in range(2)]
    with pytest.raises(ValueError, match=r"--last-k 4 exceeds the 3 evaluated rounds of 2 of the runs; write "
                                         r"--last-k 3 or fewer"):
        results_table(runs, last_k=4)

