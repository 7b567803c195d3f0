"""The study scripts' own logic: the guidance study's edge stage and its chosen-variant file, and the reading of
two FedDW tables into where the rows moved, and the records that carry a suite's finished runs across sittings."""
import shutil
from pathlib import Path

import pytest

import feddw_table_moves as moves
import guidance_study as study


def test_the_edge_stage_goes_one_factor_further_only_for_weights_at_the_grids_edge():
    chosen = {("feddifrc", "embedded"): study.Variant("feddifrc", "embedded",
                                                      (("lambda_ndcr", 4.0), ("lambda_tdcl", 0.25), ("t", 150))),
              ("align_features", "embedded"): study.Variant("align_features", "embedded")}
    labels = {v.label for v in study.stage_variants("edge", chosen)}
    assert {"feddifrc@embedded[lambda_ndcr=16.0,lambda_tdcl=0.25,t=150]",
            "feddifrc@embedded[lambda_ndcr=4.0,lambda_tdcl=0.0625,t=150]",
            "feddifrc@embedded[lambda_ndcr=4.0,lambda_tdcl=0.25,t=150]"} <= labels
    assert not any("t=600" in label or "t=37.5" in label for label in labels)  # the timestep is no weight
    assert "align_features@embedded" in labels and not [x for x in labels if x.startswith("align_features@embedded[")]
    kd = study.defaults("semanticfl")["lambda_kd"]
    assert study._at_edge(0.25 * kd, kd) and study._at_edge(4 * kd, kd) and not study._at_edge(kd, kd)


def test_chosen_variants_are_written_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    chosen = {("feddifrc", "embedded"): study.Variant("feddifrc", "embedded", (("lambda_ndcr", 4.0), ("t", 150))),
              ("semanticfl", "oracle"): study.Variant("semanticfl", "oracle", (("t", "paper"),))}
    study.write_chosen("demo", chosen)
    assert study.read_chosen("demo") == chosen  # the same labels, so the same run folders
    with pytest.raises(SystemExit, match="missing: run the stages on other's config first"):
        study.read_chosen("other")


TABLE = """# title

## Table I's shape (last-k accuracy %)

| method | practical global | pathological global |
|---|---:|---:|
| FedAvg | {a} | {b} |
| FedRep | {c} | — |

## practical: every statistic (%)

| method | seeds |
|---|---|
| FedAvg | 0, 1, 2 |
"""


def test_moves_set_each_cell_beside_its_earlier_value_with_the_seeds_each_side_has(tmp_path, monkeypatch):
    monkeypatch.setattr(moves, "REPO", tmp_path)
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    (before / "tables.md").write_text(TABLE.format(a="84.88 ± 0.80", b="63.39 ± 7.98", c="74.72 ± 1.44"))
    (after / "tables.md").write_text(TABLE.format(a="85.77 (1 seed)", b="57.32 ± 1.00", c="71.88 ± 0.50 (2 seeds)"))
    text = moves.moves(before, after)
    assert "| FedAvg | 84.88 → 85.77 (+0.89) (1 vs 3 seeds) | 63.39 → 57.32 (-6.07) |" in text
    assert "| FedRep | 74.72 → 71.88 (-2.84) (2 vs 3 seeds) | — |" in text
    assert "every statistic" not in text  # only Table I's section is read


def test_feddw_tables_set_the_last_local_reading_beside_the_averaged_body_paired_against_fedavg(tmp_path):
    """FedDW's Table I scores FedRep and FedPer on each client's model as its last local training left it
    (``utils.py`` ``inference_by_pFL``); the tables show that reading beside the averaged-body one, and only for
    the rows whose runs recorded it."""
    import feddw_table_suite as suite
    from fedguide.report.runs import RunRecord

    def record(seed, accuracy, last_local=None):
        rows = [{"round": i + 1, "accuracy": a, **({"readings": {"last_local": b}} if last_local else {})}
                for i, (a, b) in enumerate(zip(accuracy, last_local or accuracy))]
        return RunRecord(tmp_path, {"seed": seed}, {"seed": seed, "last_k": 2}, rows)

    recs = {("practical", "fedavg"): [record(0, [0.5, 0.80, 0.84]), record(1, [0.5, 0.82, 0.86])],
            ("practical", "fedrep"): [record(0, [0.4, 0.70, 0.72], [0.3, 0.60, 0.64]),
                                      record(1, [0.4, 0.74, 0.76], [0.3, 0.66, 0.70])]}
    lines = suite._last_local_section(recs, ["fedavg", "fedrep"], ["practical"])
    rows = [line for line in lines if line.startswith("| FedRep")]
    # averaged body: (0.71 + 0.75) / 2; last local: (0.62 + 0.68) / 2; Δ per seed 0.62 - 0.82, 0.68 - 0.84
    assert rows == ["| FedRep | 73.00 ± 2.83 (2 seeds) | 65.00 ± 4.24 (2 seeds) "
                    "| -18.00 [-20.00, -16.00] (-20.00, -16.00) |"]
    assert not any(line.startswith("| FedAvg") for line in lines)  # FedAvg records no last-local reading
    assert suite._last_local_section({k: v for k, v in recs.items() if k[1] == "fedavg"}, ["fedavg"],
                                     ["practical"]) == []


def test_a_finished_run_is_kept_as_a_record_and_restored_only_for_the_same_request(tmp_path, monkeypatch, capsys):
    """runs/ is not in the repository: a suite run over several sittings restores what it finished from
    benchmarks/results/records, and never a record of other settings."""
    import gzip
    import json

    import _runs

    from fedguide.config import load_config, to_yaml
    from fedguide.fl.setup import resolve

    monkeypatch.setattr(_runs, "REPO", tmp_path)
    monkeypatch.setattr(_runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(_runs, "RECORDS", tmp_path / "records")
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")
    calls = []

    def fake_cli(*args, capture=False):  # a run that writes what a finished run folder holds
        calls.append(args[0])
        at = args.index("--out")
        out, overrides = Path(args[at + 1]), list(args[at + 2:])
        out.mkdir(parents=True)
        resolved = to_yaml(resolve(load_config(args[1], overrides)).config)
        for name, text in (("config.yaml", resolved), ("partition.json", "[1, 2]" * 50), ("metrics.jsonl", "{}\n"),
                           ("summary.json", json.dumps({"args": [str(a) for a in args]}))):
            (out / name).write_text(text)
        (out / "checkpoints").mkdir()
        return ""

    monkeypatch.setattr(_runs, "cli", fake_cli)
    out = tmp_path / "runs" / "suite" / "fedavg-s0"
    _runs.ensure_run(config, out, ["seed=0"])
    record = tmp_path / "records" / "suite" / "fedavg-s0"
    assert sorted(p.name for p in record.iterdir()) == ["config.yaml", "metrics.jsonl", "partition.json.gz",
                                                       "request.json", "summary.json"]
    assert gzip.decompress((record / "partition.json.gz").read_bytes()) == (out / "partition.json").read_bytes()
    assert json.loads((record / "request.json").read_text()) == {
        "config": "c.yaml", "config_content_sha256": _runs.config_content_sha256(config), "overrides": ["seed=0"]}

    # a fresh clone: no runs/; the same request restores the run without running it
    kept = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    shutil.rmtree(tmp_path / "runs")
    _runs.ensure_run(config, out, ["seed=0"], execute=False)
    assert calls == ["run"] and {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == kept

    # a comment or the layout of the config file is not another request: still restored
    config.write_text("# a comment\nseed:   0   # the same value\n")
    shutil.rmtree(tmp_path / "runs")
    _runs.ensure_run(config, out, ["seed=0"], execute=False)
    assert (out / "summary.json").is_file() and calls == ["run"]

    # other overrides, or an edited config value: not that run; made anew, and its record replaced
    for change in ("overrides", "config"):
        shutil.rmtree(tmp_path / "runs")
        overrides = ["seed=0", "train.lr=0.1"] if change == "overrides" else ["seed=0"]
        if change == "config":
            config.write_text("seed: 0\ntrain: {lr: 0.1}\n")
        _runs.ensure_run(config, out, overrides, execute=False)
        assert not out.exists()
        assert "kept for another request" in capsys.readouterr().out
        _runs.ensure_run(config, out, overrides)
        assert json.loads((record / "request.json").read_text())["overrides"] == overrides
    assert calls == ["run"] * 3

    # a run kept in runs/ after a config value was edited is not re-labelled with the new request: it is set
    # aside (renamed, not deleted) and the request's own run made
    config.write_text("seed: 0\ntrain: {lr: 0.2}\n")
    _runs.ensure_run(config, out, ["seed=0"])
    assert calls == ["run"] * 4 and "lr: 0.2" in (out / "config.yaml").read_text()
    aside = [p for p in out.parent.iterdir() if p.name.startswith("fedavg-s0.replaced-")]
    assert len(aside) == 1 and "lr: 0.1" in (aside[0] / "config.yaml").read_text()
    assert "train.lr" in capsys.readouterr().out
    # a record whose run no longer resolves from its request (a default changed in the code since) is dropped
    # once restored, and made anew
    shutil.rmtree(tmp_path / "runs")
    (record / "config.yaml").write_text((record / "config.yaml").read_text().replace("lr: 0.2", "lr: 0.3"))
    _runs.ensure_run(config, out, ["seed=0"], execute=False)
    assert not out.exists() and "no longer matches the request" in capsys.readouterr().out
    _runs.ensure_run(config, out, ["seed=0"])
    assert calls == ["run"] * 5 and "lr: 0.2" in (record / "config.yaml").read_text()

    # a finished run of the same request put in the folder by hand (another seed's rerun, a copy) replaces the record
    (out / "summary.json").write_text(json.dumps({"copied": True}))
    _runs.ensure_run(config, out, ["seed=0"], execute=False)
    assert json.loads((record / "summary.json").read_text()) == {"copied": True} and calls == ["run"] * 5

    # a record never overwrites a started run; a record cut short (no summary.json) is no finished run
    asked = _runs.request(config, ["seed=0"])
    shutil.rmtree(tmp_path / "runs")
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("started")
    assert not _runs.restore_run(out, asked) and (out / "config.yaml").read_text() == "started"
    shutil.rmtree(tmp_path / "runs")
    assert _runs.restore_run(out, asked)
    shutil.rmtree(tmp_path / "runs")
    (record / "summary.json").unlink()
    assert not _runs.restore_run(out, asked) and not out.exists()


def test_method_defaults_runs_whole_rows_first_and_the_image_generating_methods_last(tmp_path):
    """Method by method, every seed of one before the next, each beside its FedAvg on the same network: a suite
    stopped part way leaves whole rows; FedCADO's hours of generation wait for the rest."""
    import method_defaults

    runs = method_defaults.plan(tmp_path / "demo.yaml", ["fedcado", "feddw", "fedprox"], [0, 1], tmp_path)
    assert [folder.name for folder, _ in runs] == [
        "fedavg-s0", "fedavg-s1", "fedavg[head_bias=false]-s0", "feddw-s0", "fedavg[head_bias=false]-s1", "feddw-s1",
        "fedprox-s0", "fedprox-s1", "fedcado-s0", "fedcado-s1"]
    overrides = dict(runs)[tmp_path / "demo" / "feddw-s1"]
    assert "method.name=feddw" in overrides and "model.head_bias=false" in overrides and overrides[-1] == "seed=1"


def test_method_defaults_table_pairs_by_seed_flags_a_loss_beyond_the_seed_spread_and_names_an_identical_row(tmp_path):
    import json

    import method_defaults

    config = method_defaults.REPO / "configs" / "demo.yaml"
    last_k = {"fedavg": [0.60, 0.58, 0.62], "fedprox": [0.50, 0.49, 0.52], "fedcda": [0.60, 0.58, 0.62],
              "moon": [0.61, 0.57, 0.63], "fedavg_sm": [0.50, 0.49, 0.52]}
    for name, values in last_k.items():
        for seed, value in enumerate(values):
            folder = method_defaults.run_dir(tmp_path, config, name, seed)
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"accuracy_last_k": value}))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in
            method_defaults.table(config, ["fedavg", "fedprox", "fedcda", "moon", "fedavg_sm"], [], [0, 1, 2],
                                  tmp_path).splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    # fedprox: -10, -9, -10 points; its own spread std(50, 49, 52) = 1.53 < 10 -> flagged
    assert rows["fedprox"][4] == "-9.67" and rows["fedprox"][6].startswith("**yes**")
    assert rows["fedcda"][4] == "+0.00" and "the reference's accuracy on every seed" in rows["fedcda"][6]
    assert rows["moon"][4] == "+0.33" and rows["moon"][6].strip(" |") == "no"
    # FedAvg's own row is the reference, not a method below it; FedAvg_SM, a method of its own, is judged
    assert rows["fedavg"][6].strip(" |") == "—" and rows["fedavg_sm"][6].startswith("**yes**")


def test_method_defaults_personal_table_compares_the_personal_series_over_each_runs_last_k_rounds(tmp_path):
    """--personal: the personal models' own-split accuracy, averaged over the run's last k scored rounds, is what
    pairs with FedAvg's (its global model on the same splits); the global last-k of the same runs is not."""
    import json

    import method_defaults

    assert {"ditto", "pfedme", "fedrep", "local"} <= set(method_defaults.personal_methods())
    assert "fedavg" not in method_defaults.personal_methods()
    config = method_defaults.REPO / "configs" / "demo.yaml"
    # (global accuracy, personal accuracy) of rounds 1-3; the last 2 rounds count
    curves = {"fedavg": [[(0.5, 0.5), (0.6, 0.4), (0.6, 0.6)], [(0.5, 0.5), (0.6, 0.5), (0.6, 0.5)]],
              "pfedme": [[(0.1, 0.9), (0.2, 0.7), (0.2, 0.8)], [(0.1, 0.9), (0.2, 0.8), (0.2, 0.8)]]}
    for name, per_seed in curves.items():
        for seed, rounds in enumerate(per_seed):
            folder = method_defaults.run_dir(tmp_path, config, name, seed)
            folder.mkdir(parents=True)
            (folder / "metrics.jsonl").write_text("".join(
                json.dumps({"round": r, "accuracy": g, "personal_accuracy": p}) + "\n"
                for r, (g, p) in enumerate(rounds, 1)))
            (folder / "summary.json").write_text(json.dumps(
                {"method": name, "accuracy_last_k": sum(g for g, _ in rounds[-2:]) / 2, "last_k": 2}))
    diverged = method_defaults.run_dir(tmp_path, config, "pfedme", 2)
    diverged.mkdir()
    (diverged / "stopped.json").write_text(json.dumps({"reason": "diverged", "after_round": 3}))
    personal = method_defaults.table(config, ["pfedme"], [], [0, 1, 2], tmp_path, "personal_last_k")
    row = next(line for line in personal.splitlines() if line.startswith("| pfedme")).split(" | ")
    # pfedme 75 and 80 % against fedavg's 50 and 50 %: +27.5 points; the global table says -40
    assert row[2] == "2 (seed 2 diverged)"  # said, not silently left out of the mean
    assert row[3] == "77.50 ± 3.54" and row[4] == "+27.50" and row[6].strip(" |") == "no"
    assert "personal last-k % mean ± std" in personal and "--personal" in personal
    row = next(line for line in method_defaults.table(config, ["pfedme"], [], [0, 1], tmp_path).splitlines()
               if line.startswith("| pfedme")).split(" | ")
    assert row[4] == "-40.00" and row[6].startswith("**yes**")


def test_method_defaults_keeps_its_runs_to_a_line_each_unless_verbose(tmp_path, monkeypatch):
    """A suite of a hundred runs prints each run's start and result; --verbose passes each run's rounds through
    (the runs of fmnist_dir0.1 take minutes to hours each)."""
    import sys

    import method_defaults

    asked = []
    monkeypatch.setattr(method_defaults, "ensure_run",
                        lambda config, folder, overrides, quiet=True, execute=True: asked.append((execute, quiet)))
    monkeypatch.setattr(method_defaults, "RESULTS", tmp_path / "results")
    argv = ["method_defaults.py", "--configs", str(method_defaults.REPO / "configs" / "demo.yaml"), "--methods",
            "fedavg", "--seeds", "0", "--out", str(tmp_path / "runs")]
    for flags, quiet in (([], True), (["--verbose"], False)):
        asked.clear()
        monkeypatch.setattr(sys, "argv", argv + flags)
        method_defaults.main()
        assert asked == [(False, True), (True, quiet)]  # the restore pass, then the run


def test_method_defaults_names_the_checks_own_reason_for_a_method_it_leaves_out(monkeypatch):
    """A refused method is listed with the pre-flight check's sentence: on a config naming no guidance model the
    reason was once always "no guidance model", whatever the check had said."""
    import fedguide.fl.preflight as preflight
    import method_defaults
    from fedguide.registry import ConfigError

    real = preflight.check

    def check(cfg):
        if cfg.method.name == "moon":
            raise ConfigError("moon needs train.batch_size >= 2; set train.batch_size=2")
        return real(cfg)

    monkeypatch.setattr(preflight, "check", check)
    run, left = method_defaults.methods_for(method_defaults.REPO / "configs" / "fmnist_dir0.1.yaml",
                                            ["fedavg", "moon", "feddifrc"])
    assert run == ["fedavg", "feddifrc"]  # the embedded guidance model is the default where a config names none
    assert left == ["moon (moon needs train.batch_size >= 2; set train.batch_size=2)"]
