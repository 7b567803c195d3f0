"""--vs METHOD: per-seed paired differences against a reference method, with a bootstrap interval."""
from __future__ import annotations

import numpy as np
import pytest

from fedguide.report import bootstrap_interval, paired_comparisons, paired_table, report
from tests.report.report_runs import make_run, table_rows, with_config

# Four rounds: k = 2, so accuracy_last_k is the mean of rounds 3 and 4.
BASE = [0.10, 0.20, 0.30, 0.50]


def curve(shift_last_two: tuple[float, float], base: float = 0.0) -> list[float]:
    return [BASE[0] + base, BASE[1] + base, BASE[2] + base + shift_last_two[0], BASE[3] + base + shift_last_two[1]]


@pytest.fixture
def runs(tmp_path):
    """fedavg seeds 0, 1, 2; fedprox seeds 0, 1, 3 (seeds 2 and 3 have no partner); per seed a different level."""
    out = [make_run(tmp_path, f"avg-s{s}", "fedavg", s, curve=curve((0.0, 0.0), base=s / 100)) for s in (0, 1, 2)]
    # fedprox: + (0.02, 0.06) over fedavg at seed 0 (last-k +4 pp, final +6 pp), + (0.00, -0.02) at seed 1.
    out.append(make_run(tmp_path, "prox-s0", "fedprox", 0, curve=curve((0.02, 0.06), 0.00), method_params={"mu": 0.1}))
    out.append(make_run(tmp_path, "prox-s1", "fedprox", 1, curve=curve((0.00, -0.02), 0.01), method_params={"mu": 0.1}))
    out.append(make_run(tmp_path, "prox-s3", "fedprox", 3, curve=curve((0.0, 0.0), 0.5), method_params={"mu": 0.1}))
    return out


def test_paired_differences_are_exact_and_unpaired_seeds_are_named(runs):
    [c] = paired_comparisons(runs, "fedavg")
    assert c.method == "fedprox" and c.k == 2 and c.seeds == [0, 1]
    assert c.last_k == pytest.approx([0.04, -0.01])
    assert c.final == pytest.approx([0.06, -0.02])
    assert c.mean_last_k == pytest.approx(0.015) and c.mean_final == pytest.approx(0.02)
    assert c.unpaired == ["seed 2: only fedavg", "seed 3: no fedavg run"]  # named, not used


def test_bootstrap_interval_contains_the_mean_and_is_reproducible():
    d = [0.04, -0.01, 0.02, 0.03, 0.0]
    lo, hi = bootstrap_interval(d)
    assert lo < np.mean(d) < hi and min(d) <= lo and hi <= max(d)
    assert bootstrap_interval(d) == (lo, hi)  # seeded
    # Two differences: the resample means are a, b and (a+b)/2 with probabilities 1/4, 1/4, 1/2.
    lo2, hi2 = bootstrap_interval([0.04, -0.01])
    assert (lo2, hi2) == pytest.approx((-0.01, 0.04))
    assert bootstrap_interval([0.04]) is None  # one pair gives no interval


def test_paired_table_shows_differences_interval_and_footnote(runs):
    text = paired_table(runs, "fedavg")
    [row] = table_rows(text)
    assert row[0] == "fedprox" and row[2] == "2" and row[3] == "0, 1"
    assert row[4] == "+1.50 [-1.00, +4.00]" and row[5] == "+2.00 [-2.00, +6.00]"
    assert row[6] == "0: +4.00, 1: -1.00"
    assert row[7] == "seed 2: only fedavg; seed 3: no fedavg run"
    assert "bootstrap" in text and "10,000 resamples" in text and "numpy seed 0" in text


def test_only_runs_with_the_same_other_settings_pair(tmp_path):
    a = make_run(tmp_path, "avg", "fedavg", 0, curve=curve((0.0, 0.0)))
    b = with_config(make_run(tmp_path, "prox-lr", "fedprox", 0, curve=curve((0.1, 0.1))), train__lr=0.5)
    [c] = paired_comparisons([a, b], "fedavg")
    assert c.seeds == [] and c.unpaired == ["seed 0: no fedavg run with the same settings (train.lr differs)"]
    assert c.settings == ["train.lr=0.5"]


def test_a_method_run_on_another_network_is_named_unpaired_with_the_model_key(tmp_path):
    """FedDW on the mapping layers beside FedAvg without them: --vs names the model key, and the row label
    carries it, instead of presenting a comparison of methods."""
    a = make_run(tmp_path, "avg", "fedavg", 0, curve=curve((0.0, 0.0)))
    b = with_config(make_run(tmp_path, "dw", "feddw", 0, curve=curve((0.1, 0.1))), model__mapping=[128, 128])
    [c] = paired_comparisons([a, b], "fedavg")
    assert c.seeds == [] and c.unpaired == ["seed 0: no fedavg run with the same settings (model.mapping differs)"]
    assert c.settings == ["model.mapping=[128,128]"]


def test_how_a_run_picked_its_convolutions_neither_splits_rows_nor_unpairs(tmp_path):
    """train.cudnn_benchmark, which only a GPU reads, changes floats by rounding as train.device does: a run
    recorded before the key existed and one with it share a row and pair."""
    from fedguide.report.runs import load_runs
    from fedguide.report.tables import group_runs

    a = make_run(tmp_path, "avg", "fedavg", 0, curve=curve((0.0, 0.0)))
    b = make_run(tmp_path, "prox", "fedprox", 0, curve=curve((0.1, 0.1)))
    c = with_config(make_run(tmp_path, "prox1", "fedprox", 1, curve=curve((0.2, 0.2))), train__cudnn_benchmark=True)
    d = with_config(make_run(tmp_path, "avg1", "fedavg", 1, curve=curve((0.0, 0.0))), train__cudnn_benchmark=False)
    [comparison] = paired_comparisons([a, b, c, d], "fedavg")
    assert comparison.seeds == [0, 1] and comparison.unpaired == []
    groups = group_runs(load_runs([a, b, c, d]))
    assert sorted((g.label, len(g.runs)) for g in groups) == [("fedavg", 2), ("fedprox", 2)]


def test_runs_of_different_lengths_never_pair(tmp_path):
    """A folder whose config.yaml still says 5 rounds while it ran 6 (written before config.yaml followed a
    raised train.rounds) does not pair with a 5-round run: their difference would measure the extra round."""
    a = make_run(tmp_path, "avg", "fedavg", 0, curve=curve((0.0, 0.0)) + [0.0])
    b = with_config(make_run(tmp_path, "prox", "fedprox", 0, curve=curve((0.1, 0.1)) + [0.1, 0.1]),
                    train__rounds=len(curve((0.0, 0.0))) + 1)
    [c] = paired_comparisons([a, b], "fedavg")
    assert c.seeds == [] and c.unpaired == [f"seed 0: {len(curve((0, 0))) + 2} rounds against fedavg's "
                                            f"{len(curve((0, 0))) + 1}"]


def test_reference_by_label_and_bad_references(tmp_path):
    runs = [make_run(tmp_path, f"p{mu}", "fedprox", 0, curve=curve((mu, mu)), method_params={"mu": mu})
            for mu in (0.01, 0.1)]
    [c] = paired_comparisons(runs, "fedprox(mu=0.01)")
    assert c.method == "fedprox(mu=0.1)" and c.last_k == pytest.approx([0.09])
    with pytest.raises(ValueError, match=r"names 2 settings.*--vs 'fedprox\(mu=0.01\)'"):
        paired_comparisons(runs, "fedprox")
    with pytest.raises(ValueError, match="no complete run of that method; the runs hold fedprox"):
        paired_comparisons(runs, "scaffold")


def test_report_writes_the_paired_section(runs, tmp_path):
    res = report(runs, tmp_path / "out", vs="fedavg")
    assert "## Paired differences against fedavg" in res.markdown and res.paired in res.markdown
