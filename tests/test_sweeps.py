"""Sweep axes (the comma form and YAML lists), their run folders, and the plan that checks every
combination and reads its run folder before anything runs."""
from __future__ import annotations

import dataclasses

import pytest

from fedguide.config import build_config
from fedguide.registry import ConfigError
from fedguide.fl.run_folder import RunFolder
from fedguide.sweeps import check_like_with_like, grid, parse_axis, plan
from tests.tiny import run_tiny, tiny_config, tiny_raw


def folders(*specs: str) -> list[str]:
    return [c.folder for c in grid([parse_axis(s) for s in specs])]


def test_the_comma_form_and_a_yaml_list_give_the_same_values_and_folders():
    assert parse_axis("seed=0,1,2").values == parse_axis("seed=[0, 1, 2]").values == (0, 1, 2)
    assert folders("seed=0,1,2") == folders("seed=[0, 1, 2]") == ["seed=0", "seed=1", "seed=2"]


@pytest.mark.parametrize("spec", ["model.mapping=[[64, 64], []]", "model.mapping=[64,64],[]"])
def test_list_values_are_swept_whole(spec):
    assert parse_axis(spec).values == ([64, 64], [])
    assert folders(spec) == ["mapping=[64,64]", "mapping=[]"]


def test_a_comma_inside_brackets_or_quotes_does_not_split():
    assert parse_axis("method.layers=[1],[2, 3]").values == ([1], [2, 3])
    assert parse_axis("meta.note='a,b',c").values == ("a,b", "c")


def test_folders_follow_the_first_axis_slowest_and_hold_no_path_separator():
    assert folders("method.name=fedavg,fedprox", "seed=0,1") == [
        "name=fedavg-seed=0", "name=fedavg-seed=1", "name=fedprox-seed=0", "name=fedprox-seed=1"]
    assert folders("guidance.model=CompVis/sd-v1-4,a b") == ["model=CompVis_sd-v1-4", "model=a_b"]


@pytest.mark.parametrize("specs,message", [
    (["seed"], "is not key=values"),
    (["seed=[]"], "has no values"),
    (["seed=0,0"], "lists the value 0 twice"),
    (["model.mapping=[64, 64]"], "model.mapping=[[64, 64], []]"),  # two equal scalars, meant as one list
    (["seed=0,1", "seed=2"], "given twice"),
    (["x=[1, 2"], "unbalanced"),
    (["guidance.model=a/b,a_b"], "would share the run folder"),
])
def test_bad_sweeps_are_a_sentence(specs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        grid([parse_axis(s) for s in specs])


def test_the_plan_names_every_invalid_combination_and_returns_nothing(tmp_path):
    combos = grid([parse_axis("method.name=fedprox,fedavg,moon")])
    with pytest.raises(ConfigError) as err:
        plan(tiny_raw(), ["method.mu=0.5", "method.name=fedavg"], combos, tmp_path / "sweep")
    msg = str(err.value)
    assert msg.startswith("1 of 3 sweep combinations are invalid")
    assert "method.name=fedavg: method.mu: method 'fedavg' has no parameter 'mu'" in msg
    assert not (tmp_path / "sweep").exists()


def test_the_plan_resolves_each_combination_and_reads_its_folder(tmp_path):
    runs = plan(tiny_raw(), [], grid([parse_axis("model.mapping=[[16], []]")]), tmp_path)
    assert [r.config.model.params_dict()["mapping"] for r in runs] == [[16], []]
    assert [r.state for r in runs] == ["new", "new"]
    assert runs[0].run_dir == tmp_path / "mapping=[16]" and runs[0].partition_summary["num_clients"] == 4


def test_the_run_folder_tells_finished_unfinished_and_other_settings_apart(tmp_path):
    cfg = tiny_config(train={"rounds": 2})
    _, _, run_dir = run_tiny(tmp_path, cfg)
    resolved = plan(tiny_raw(train={"rounds": 2}), [], grid([parse_axis("seed=[1]")]), tmp_path)[0].config
    assert RunFolder(tmp_path / "elsewhere").state_for(resolved) == "new"
    assert RunFolder(run_dir).state_for(resolved) == "finished"
    assert RunFolder(run_dir).state_for(resolved.model_copy(update={"train": resolved.train.model_copy(update={"rounds": 3})})) \
        == "unfinished"  # rounds raised: the run continues
    (run_dir / "summary.json").unlink()
    assert RunFolder(run_dir).state_for(resolved) == "unfinished"
    other = resolved.model_copy(update={"train": resolved.train.model_copy(update={"lr": 0.5})})
    with pytest.raises(ConfigError, match=r"holds a run of other settings:\n  train.lr: 0.05 \(run folder\) vs 0.5"):
        RunFolder(run_dir).state_for(other)


def test_a_sweep_that_raises_the_rounds_leaves_a_config_that_describes_the_run(tmp_path):
    """The continued run's config.yaml says its new length (a report pairs runs by it) and keeps the meta of
    the process that started it; summary.json records where it was raised from."""
    import fedguide

    [first] = fedguide.sweep(tiny_raw(train={"rounds": 2}), ["seed=0"], out=tmp_path, quiet=True)
    meta = first.config["meta"]
    [raised] = fedguide.sweep(tiny_raw(train={"rounds": 3}), ["seed=0"], out=tmp_path, quiet=True)
    assert raised.path == first.path and raised.config["train"]["rounds"] == 3 and raised.config["meta"] == meta
    assert raised.summary["rounds"] == 3 and raised.summary["rounds_raised_from"] == 2
    assert [m["round"] for m in raised.metrics] == [1, 2, 3]


def test_keys_that_share_their_last_part_keep_the_whole_key_in_folder_names():
    assert folders("method.name=fedavg", "data.name=digits") == ["method.name=fedavg-data.name=digits"]
    assert folders("method.name=fedavg", "seed=0") == ["name=fedavg-seed=0"]  # unique last parts stay short


def test_an_axis_added_to_a_sweep_continues_its_runs_instead_of_recomputing_them(tmp_path):
    """A sweep over seeds of FedAvg, then the same sweep with a method axis: the FedAvg runs are found in their
    folders by their settings and skipped; only FedProx runs."""
    import fedguide

    base = tiny_raw(train={"rounds": 1})
    [before] = fedguide.sweep(base, ["seed=0"], out=tmp_path, quiet=True)
    stamp = (before.path / "summary.json").stat().st_mtime_ns
    lines = []
    records = fedguide.sweep(base, ["method.name=fedavg,fedprox", "seed=0"], out=tmp_path, log=lines.append)
    assert records[0].path == before.path and (before.path / "summary.json").stat().st_mtime_ns == stamp
    assert lines[0] == f"[1/2] method.name=fedavg seed=0: finished before, skipped -> {before.path}"
    assert records[1].path == tmp_path / "name=fedprox-seed=0" and records[1].summary["method"] == "fedprox"


def test_a_sweep_over_fedavg_and_feddw_without_a_bias_free_head_is_refused_before_anything_runs(tmp_path):
    """FedDW needs a bias-free classification layer. It used to bring one itself, so a sweep beside FedAvg ran
    two networks under one table; now the sweep is refused with the key to set, and set in the config it
    runs both methods on the one network."""
    raw = tiny_raw(train={"rounds": 1})
    with pytest.raises(ConfigError, match=r"1 of 2 sweep combinations are invalid, so none ran:\n  method.name=feddw: "
                                          r"method.name=feddw needs model.head_bias=false"):
        plan(raw, [], grid([parse_axis("method.name=fedavg,feddw")]), tmp_path)
    assert not any(tmp_path.iterdir())
    same = plan(raw, ["model.head_bias=false", "model.mapping=[128, 128]"],
                grid([parse_axis("method.name=fedavg,feddw")]), tmp_path)
    assert [p.config.model.params_dict() for p in same][0] == [p.config.model.params_dict() for p in same][1]
    assert same[0].config.model.params_dict()["mapping"] == [128, 128]


def test_combinations_that_resolve_to_different_unswept_settings_are_refused_naming_the_keys(tmp_path):
    """The last guard of a sweep's table, whatever made two combinations differ (a plug-in that changes a
    setting by a method's name, say): the differing keys and each combination's value."""
    planned = plan(tiny_raw(train={"rounds": 1}), [], grid([parse_axis("method.name=fedavg,fedprox")]), tmp_path)
    dump = planned[1].config.model_dump(mode="json")
    planned[1] = dataclasses.replace(planned[1], config=build_config({**dump, "model": {**dump["model"], "hidden": 64}}))
    with pytest.raises(ConfigError, match=r"would differ in more than the swept keys.*\n  model\.hidden: "
                                          r"128 \(method\.name=fedavg\), 64 \(method\.name=fedprox\)"):
        check_like_with_like(planned)
    check_like_with_like(planned[:1])


def test_a_sweep_over_an_entry_sweeps_its_parameters_with_it(tmp_path):
    planned = plan(tiny_raw(train={"rounds": 1}), [], grid([parse_axis("partition.name=dirichlet,iid")]), tmp_path)
    assert [p.config.partition.name for p in planned] == ["dirichlet", "iid"]  # their parameters differ: allowed


def test_method_options_give_each_swept_method_its_own_settings_from_one_config(tmp_path):
    """method_options: {name: options} reaches the method section when it names that method, beneath the
    section's own keys (an override of method.mu wins), so one config sweeps method.name with FedProx's mu set;
    options of a method not run are still checked against it, before anything runs."""
    raw = tiny_raw(train={"rounds": 1}, method_options={"fedprox": {"mu": 0.1}, "moon": {"tau": 0.2}})
    planned = plan(raw, [], grid([parse_axis("method.name=fedavg,fedprox")]), tmp_path)
    assert [p.config.method.name for p in planned] == ["fedavg", "fedprox"]
    assert planned[1].config.method.params_dict()["mu"] == 0.1 and "mu" not in planned[0].config.method.params_dict()
    assert plan(raw, ["method.mu=0.5"], grid([parse_axis("method.name=fedprox")]), tmp_path / "b"
                )[0].config.method.params_dict()["mu"] == 0.5
    with pytest.raises(ConfigError, match=r"method_options.moon.taus: method 'moon' has no parameter 'taus' "
                                          r"\(did you mean 'tau'\?\)"):
        plan(tiny_raw(method_options={"moon": {"taus": 0.2}}), [], grid([parse_axis("seed=0")]), tmp_path / "c")
    with pytest.raises(ConfigError, match=r"unknown method 'fedproxx' \(did you mean 'fedprox'\?\)"):
        plan(tiny_raw(method_options={"fedproxx": {"mu": 1}}), [], grid([parse_axis("seed=0")]), tmp_path / "d")
    for bad in ({"fedprox": 0.1}, {"fedprox": {"name": "fedprox", "mu": 0.1}}):
        with pytest.raises(ConfigError, match=r"method_options maps method names to their options \(the key is"):
            build_config(tiny_raw(method_options=bad))
    assert not any((tmp_path / d).exists() for d in ("c", "d"))


def test_other_methods_options_are_no_setting_of_a_run(tmp_path):
    """A run's pinned settings and its report row hold what its own method got; the options of methods it did
    not run neither refuse its resume nor split it from the same run made without them."""
    from fedguide.config import flat_keys
    from fedguide.fl.run_folder import pinned_config
    from fedguide.report.tables import NOT_SETTINGS, _under

    with_options = build_config(tiny_raw(method_options={"fedprox": {"mu": 0.1}}))
    assert pinned_config(with_options) == pinned_config(build_config(tiny_raw()))
    assert all(_under(k, NOT_SETTINGS) for k in flat_keys(with_options.model_dump(mode="json")) if "method_options" in k)
