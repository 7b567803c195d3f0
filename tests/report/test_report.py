"""Report subpackage: run loading, the results table, plots and the report() entry point."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedguide.report import RunRecord, load_run, make_plots, report, results_table

from tests.report.report_runs import ROUNDS, make_run, rows_of, table_rows, with_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Columns of the results table.
SEEDS, K, LAST, FINAL, BEST, WALL, MB = 5, 6, 7, 8, 9, 10, 11


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    other = [[1, 2, 3, 4], [4, 3, 2, 1], [0, 0, 9, 9]]
    return [
        make_run(tmp_path, "fedavg-s0", "fedavg", 0, 0.80),
        make_run(tmp_path, "fedavg-s1", "fedavg", 1, 0.84, wall=20.0),
        make_run(tmp_path, "fedprox-s0", "fedprox", 0, 0.85, method_params={"mu": 0.01}, counts=other),
        make_run(tmp_path, "fedprox-s1", "fedprox", 1, 0.89, method_params={"mu": 0.01}, counts=other),
        # Unfinished and with a suspiciously high accuracy: it must not leak into fedavg's mean.
        make_run(tmp_path, "fedavg-s2", "fedavg", 2, 0.99, rounds_done=3, complete=False),
    ]


def test_load_run(runs):
    rec = load_run(runs[0])
    assert isinstance(rec, RunRecord)
    assert rec.complete and rec.summary["final_accuracy"] == pytest.approx(0.80)
    assert len(rec.metrics) == ROUNDS and rec.partition["num_classes"] == 4
    assert rec.config["method"]["name"] == "fedavg"
    # Extra metrics the engine writes stay reachable, nested dicts included.
    assert "domain_accuracy.b" in rec.numeric_metric_keys()
    assert rec.series("domain_accuracy.b")[1][-1] == pytest.approx(0.40)

    live = load_run(runs[4])
    assert not live.complete and live.summary is None
    assert live.rounds_done == 3 and live.rounds_planned == ROUNDS
    assert live.partition_label == "dirichlet(alpha=0.1)"  # rebuilt from config, matching the summary label


def test_an_unfinished_run_names_its_partition_as_the_engine_names_a_finished_ones(tmp_path):
    """A diverged or running run is labelled from its resolved config.yaml: the search budget max_tries, which the
    engine leaves out of a summary's label, must not make it look like another partition in the table."""
    from fedguide.config import load_config
    from fedguide.fl.engine import partition_label

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml", ["partition.max_tries=1000"])
    live = with_config(make_run(tmp_path, "live", "fedavg", 0, complete=False, rounds_done=2),
                       partition__min_size=10, partition__max_tries=1000)
    assert load_run(live).partition_label == partition_label(cfg) == "dirichlet(alpha=0.1, min_size=10)"


def test_table_values_order_and_incomplete(runs):
    md = results_table([load_run(p) for p in runs])
    header = [line for line in md.splitlines() if line.startswith("|")][0]
    assert "best acc†" in header and "max over rounds" in header and "final acc" in header
    assert "†" in md.split(header)[1]  # the footnote explaining "best" is present

    rows = table_rows(md)
    assert [r[0] for r in rows] == ["fedprox", "fedavg", "fedavg (incomplete, 3/5 rounds)"]
    prox, avg, live = rows
    assert prox[FINAL] == "87.00 ± 2.83"
    assert avg[FINAL] == "82.00 ± 2.83"  # mean/std of 0.80 and 0.84 only; the 0.99 incomplete run excluded
    assert avg[BEST] == "83.00 ± 2.83"  # best = final + 1 point in the fixture
    # 5 rounds: k = 2, the mean of the last two rounds (final + 1 point, final): 80.5 and 84.5.
    assert avg[K] == "2" and avg[LAST] == "82.50 ± 2.83"
    assert avg[SEEDS] == "0, 1" and avg[1] == "cifar10" and avg[2] == "dirichlet(alpha=0.1)"
    assert avg[3] == "3" and avg[4] == "5"
    assert avg[WALL] == "15.0"  # mean wall seconds of 10 and 20
    assert avg[MB] == "2.000"  # MB up per round
    # The live run so far: 3 of 5 rounds (0.198, 0.396, 0.594), its window the last 2 of them.
    assert live[SEEDS] == "2" and live[FINAL].endswith("± n/a") and live[LAST] == "49.50 ± n/a"


def test_method_params_that_differ_split_rows(tmp_path):
    paths = [
        make_run(tmp_path, "p1", "fedprox", 0, 0.70, method_params={"mu": 0.01, "lr": 0.1}),
        make_run(tmp_path, "p2", "fedprox", 0, 0.75, method_params={"mu": 0.1, "lr": 0.1}),
        make_run(tmp_path, "a", "fedavg", 0, 0.60),
    ]
    rows = table_rows(results_table(paths))
    # Only the varying param is shown; the shared lr would be noise.
    assert [r[0] for r in rows] == ["fedprox(mu=0.1)", "fedprox(mu=0.01)", "fedavg"]
    assert rows[0][FINAL] == "75.00 ± n/a"


def test_plots_are_valid_pngs(runs, tmp_path):
    out = tmp_path / "plots-out"
    paths = make_plots([load_run(p) for p in runs], out)
    names = sorted(p.name for p in paths)
    # Five runs, two distinct partition.json contents -> two heatmaps.
    assert names == ["accuracy_curves.png", "partition_fedavg-s0.png", "partition_fedprox-s0.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, p
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no temp files left behind


def test_report_several_runs(runs, tmp_path):
    res = report(runs)
    assert res.out_dir == tmp_path / "report"
    assert res.markdown_path == res.out_dir / "report.md" and res.markdown_path.read_text() == res.markdown
    assert "82.00 ± 2.83" in res.markdown and "incomplete, 3/5 rounds" in res.markdown
    assert "accuracy_curves.png" in res.markdown
    assert all(p.is_file() and p.read_bytes()[:8] == PNG_MAGIC for p in res.plot_paths)

    (res.out_dir / "partition_gone.png").write_bytes(PNG_MAGIC)  # a plot the runs no longer make
    again = report(runs)  # the same runs reported again: their report is replaced, nothing stale stays
    assert again.out_dir == res.out_dir and not (res.out_dir / "partition_gone.png").exists()
    assert sorted(p.name for p in res.out_dir.iterdir()) == sorted(p.name for p in again.paths)


def test_report_single_run_defaults_to_plots_dir(runs):
    res = report([runs[0]])
    assert res.out_dir == runs[0] / "plots"
    assert (runs[0] / "plots" / "report.md").is_file()
    assert (runs[0] / "plots" / "accuracy_curves.png").read_bytes()[:8] == PNG_MAGIC


def test_report_explicit_out(runs, tmp_path):
    out = tmp_path / "custom"
    res = report(runs[:2] + [runs[0]], out)  # duplicate path is not counted as another seed
    assert res.out_dir == out and len(res.runs) == 2
    assert table_rows(res.markdown)[0][SEEDS] == "0, 1"


def test_bad_path_raises_value_error(tmp_path):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(ValueError, match=re.escape(str(empty))) as err:
        load_run(empty)
    assert "metrics.jsonl" in str(err.value)
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        report([missing])


def test_partial_last_metrics_line_of_live_run_is_tolerated(tmp_path):
    d = make_run(tmp_path, "live", "fedavg", 0, 0.5, rounds_done=2, complete=False)
    with open(d / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "accur')  # engine mid-write
    assert load_run(d).rounds_done == 2

    done = make_run(tmp_path, "done", "fedavg", 0, 0.5)
    with open(done / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 6, "accur')
    with pytest.raises(ValueError, match="metrics.jsonl:6"):
        load_run(done)


# ---- grouping: only runs that differ in their seed share a row ---------------------------------------
def test_runs_that_differ_in_a_setting_get_their_own_rows_with_the_setting_shown(tmp_path):
    a = with_config(make_run(tmp_path, "lr-small", "fedavg", 0, 0.40), train__lr=0.01)
    b = with_config(make_run(tmp_path, "lr-large", "fedavg", 0, 0.80), train__lr=0.1)
    text = results_table([a, b])
    header = text.splitlines()[0]
    assert header.rstrip(" |").endswith("train.lr")
    rows = rows_of(text)
    assert len(rows) == 2, text  # not one row "seeds 0, 0" averaging two learning rates
    assert {(r[0], r[SEEDS], r[FINAL], r[-1]) for r in rows} == {("fedavg", "0", "80.00 ± n/a", "0.1"),
                                                          ("fedavg", "0", "40.00 ± n/a", "0.01")}


def test_runs_that_differ_only_in_their_seed_share_a_row_with_n_seeds(tmp_path):
    runs = [with_config(make_run(tmp_path, f"s{s}", "fedavg", s, 0.5 + s / 10), train__lr=0.05) for s in range(3)]
    rows = rows_of(results_table(runs))
    assert len(rows) == 1 and rows[0][SEEDS] == "0, 1, 2" and rows[0][FINAL] == "60.00 ± 10.00"


def test_two_runs_of_the_same_seed_are_never_averaged(tmp_path):
    a = make_run(tmp_path, "first", "fedavg", 0, 0.40)
    b = make_run(tmp_path, "again", "fedavg", 0, 0.60)
    text = results_table([a, b])
    rows = rows_of(text)
    assert [r[0] for r in rows] == ["fedavg (seed 0 repeated)"] * 2
    assert sorted(r[FINAL] for r in rows) == ["40.00 ± n/a", "60.00 ± n/a"]
    assert "never averaged" in text


def test_personal_metrics_get_their_own_table(tmp_path):
    """A run scored with eval.mode: both reports its personalised accuracy, minimum and bottom-10 % over clients."""
    import json

    from tests.tiny import run_tiny, tiny_config

    _, rows, run_dir = run_tiny(tmp_path, tiny_config(train={"rounds": 2}, eval={"mode": "both"}), "personal")
    text = report([run_dir], tmp_path / "out").markdown_path.read_text()
    assert "## Personalised test accuracy" in text
    section = text[text.index("## Personalised test accuracy"):]
    line = next(l for l in section.splitlines() if l.startswith("| fedavg"))
    last_two = (rows[0]["personal_accuracy"] + rows[1]["personal_accuracy"]) / 2
    assert f"{100 * last_two:.2f}" in line
    assert json.loads((run_dir / "summary.json").read_text())["final_personal_accuracy"] == rows[-1]["personal_accuracy"]


def test_report_shows_the_simulated_device_check(tmp_path):
    check = {"device": "simulated", "steps": 98, "host_syncs_per_step": 0.5, "h2d_bytes_per_step": 512.0,
             "host_syncs": 60, "h2d_bytes": 90000, "d2h_bytes": 0, "mixes": 0}
    checked = make_run(tmp_path, "sim", "fedavg", 0, summary_extra={"device_check": check})
    plain = make_run(tmp_path, "cpu", "fedavg", 1)
    md = report([checked, plain], tmp_path / "out").markdown
    assert "## Device check (train.device: simulated)" in md
    assert "| sim | fedavg | 98 | 0.50 | 512 | 60 | 90000 | 0 |" in md and "| cpu | fedavg | 98" not in md
    assert "Device check" not in report([plain], tmp_path / "out2").markdown
    assert "Where the steps' host-to-device bytes come from" not in md
    sited = make_run(tmp_path, "sited", "fedavg", 2, summary_extra={"device_check": {
        **check, "h2d_step_sites": {"fedguide/methods/x.py:10 in step: rows.to(device)": 512}}})
    md = report([sited], tmp_path / "out3").markdown
    assert "- sited: `fedguide/methods/x.py:10 in step: rows.to(device)` 512 B" in md
