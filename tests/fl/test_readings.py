"""Other readings of the global accuracy a method reports beside ``accuracy`` (its evaluation's ``readings``):
summary.json's final, last-k and best of each, and the results table's column, next to the method's own."""
import pytest

from fedguide.fl.evaluation import readings_summary
from fedguide.report.tables import results_data
from tests.tiny import run_tiny, tiny_config


def test_summary_of_a_reading_on_hand_computed_numbers():
    cfg = tiny_config(report={"last_k": 2})
    metrics = [{"round": 1, "accuracy": 0.5, "readings": {"last_local": 0.2}},
               {"round": 2, "accuracy": 0.5, "readings": {"last_local": 0.6}},
               {"round": 3, "accuracy": 0.5, "readings": {"last_local": 0.4}}]
    assert readings_summary(cfg, metrics) == {
        "final_last_local_accuracy": 0.4, "last_local_accuracy_last_k": pytest.approx(0.5),  # (0.6 + 0.4) / 2
        "best_last_local_accuracy": 0.6, "best_last_local_round": 2}
    assert readings_summary(cfg, [{"round": 1, "accuracy": 0.5}]) == {}


def test_a_run_with_a_reading_shows_it_in_summary_and_report(tmp_path):
    cfg = tiny_config(method={"name": "fedper", "last_local_eval": True}, train={"rounds": 2})
    summary, rows, run_dir = run_tiny(tmp_path, cfg)
    assert [set(r["readings"]) for r in rows] == [{"last_local"}] * 2
    assert summary["final_last_local_accuracy"] == rows[-1]["readings"]["last_local"]
    assert summary["final_accuracy"] == rows[-1]["accuracy"]  # the method's own reading stays the headline
    table = results_data([run_dir])
    column = table.columns.index("last_local last-k acc % (mean ± std)")
    assert table.rows[0][column].values == pytest.approx((summary["last_local_accuracy_last_k"],))
