"""``protocol: feddw``: FedDW's released protocol for its personalised rows (github.com/liuvvvvv1/FedDW) as a
named preset of each method's options, which explicit options override, which the resolved config writes
out, and which the FedDW paper configs' documented pFL runs use."""
from pathlib import Path

import pytest

from fedguide.config import build_config, load_config, to_yaml
from fedguide.fl.setup import resolve
from fedguide.registry import ConfigError
from tests.test_paper_configs import documented_runs
from tests.tiny import tiny_raw

PFL = ("fedrep", "fedper", "perfedavg", "fedbabu", "fedala")
PAPER = Path(__file__).resolve().parents[3] / "configs" / "paper"


def test_the_preset_fills_what_the_config_leaves_and_is_written_out():
    raw = tiny_raw(method={"name": "fedrep", "protocol": "feddw", "head_epochs": 2})
    params = resolve(build_config(raw)).config.method.params_dict()
    assert (params["protocol"], params["head_epochs"], params["body_epochs"], params["optimizer"]) == \
        ("feddw", 2, "rest", "shared_kept_grads")
    # The resolved config (a run's config.yaml) resolves to the same settings again.
    again = resolve(build_config({**raw, "method": {"name": "fedrep", **params}})).config.method.params_dict()
    assert again == params and "body_epochs: rest" in to_yaml(resolve(build_config(raw)).config)


@pytest.mark.parametrize("name", PFL)
def test_every_pfl_method_of_feddws_table_takes_the_preset(name):
    own = resolve(build_config(tiny_raw(method={"name": name}))).config.method.params_dict()
    feddw = resolve(build_config(tiny_raw(method={"name": name, "protocol": "feddw"}))).config.method.params_dict()
    assert own["protocol"] == "own" and feddw["protocol"] == "feddw"
    with pytest.raises(ConfigError, match="protocol"):
        resolve(build_config(tiny_raw(method={"name": name, "protocol": "feddwx"})))


@pytest.mark.parametrize("path", sorted(PAPER.glob("feddw_*.yaml")), ids=lambda p: p.stem)
def test_feddw_paper_configs_run_the_pfl_rows_with_the_preset(path):
    runs = documented_runs(path)
    pfl_runs = [r for r in runs if any(o in (f"method.name={n}" for n in PFL) for o in r)]
    assert pfl_runs, f"{path.name} documents no personalised row"
    for run in pfl_runs:
        assert "method.protocol=feddw" in run, f"{path.name}: {run} runs a pFL row without FedDW's protocol"
        assert load_config(path, run).method.params_dict()["protocol"] == "feddw"
    assert "github.com/liuvvvvv1/FedDW" in path.read_text()
