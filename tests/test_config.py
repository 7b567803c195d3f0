"""Config loading, dotted overrides, validation messages, and registry resolution."""
from pathlib import Path

import pytest
import yaml

from fedguide.config import Config, apply_overrides, build_config, load_config, load_raw, parse_value, to_yaml
from fedguide.fl.setup import resolve
from fedguide.registry import ConfigError, Registry

REPO = Path(__file__).resolve().parents[1]


def write_yaml(path: Path, obj) -> Path:
    path.write_text(yaml.safe_dump(obj))
    return path


# ---- defaults and round trip ----------------------------------------------------------------------

def test_defaults_load():
    cfg = build_config({})
    assert cfg.data.name == "fmnist" and cfg.data.fraction == 1.0
    assert cfg.partition.name == "dirichlet"
    assert cfg.model.name == "cnn"
    assert cfg.method.name == "fedavg"
    assert (cfg.clients.num, cfg.clients.per_round) == (10, 10)
    assert cfg.train.rounds == 20 and cfg.train.lr == 0.01 and cfg.train.optimizer == "sgd"
    assert cfg.runtime.name == "local"
    runtime = resolve(cfg).config.runtime  # a runtime's keys are its Params', written out when resolved
    assert runtime.workers == 1 and runtime.threads_per_worker is None
    assert cfg.seed == 0 and cfg.meta == {}


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


def test_yaml_file_round_trip(tmp_path):
    raw = {
        "data": {"name": "digits", "fraction": 0.5},
        "partition": {"name": "dirichlet", "alpha": 0.3},
        "method": {"name": "fedprox", "mu": 0.05},
        "clients": {"num": 6, "per_round": 3},
        "train": {"rounds": 4, "lr": 0.2, "optimizer": "adam"},
        "seed": 11,
    }
    cfg = load_config(write_yaml(tmp_path / "c.yaml", raw))
    assert cfg.data.name == "digits" and cfg.data.fraction == 0.5
    assert cfg.partition.params_dict() == {"alpha": 0.3}
    assert cfg.method.name == "fedprox" and cfg.method.params_dict() == {"mu": 0.05}
    assert (cfg.clients.num, cfg.clients.per_round) == (6, 3)
    assert cfg.train.rounds == 4 and cfg.train.lr == 0.2 and cfg.train.optimizer == "adam"
    assert cfg.seed == 11

    # to_yaml -> file -> load_config reproduces the same config.
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(again) == cfg


def test_load_config_applies_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"train": {"rounds": 3}})
    cfg = load_config(path, ["train.rounds=7", "seed=5"])
    assert cfg.train.rounds == 7 and cfg.seed == 5
    assert load_config(str(path), ["train.rounds=7", "seed=5"]) == cfg  # a path given as a string, as in a notebook


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as exc:
        load_config(missing)
    assert str(missing) in str(exc.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="mapping"):
        load_raw(path)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train: {rounds: 3\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


# ---- overrides ------------------------------------------------------------------------------------

def test_parse_value_is_yaml_typed():
    assert parse_value("0.1") == 0.1 and isinstance(parse_value("0.1"), float)
    assert parse_value("5") == 5 and isinstance(parse_value("5"), int)
    assert parse_value("[dw]") == ["dw"]
    assert parse_value("null") is None
    assert parse_value("true") is True
    assert parse_value("fedavg") == "fedavg"


def test_overrides_nested_and_typed():
    raw = {"train": {"rounds": 3}}
    out = apply_overrides(raw, ["train.lr=0.1", "method.regularizers=[dw]", "a.b.c=1", "seed=4"])
    assert out["train"] == {"rounds": 3, "lr": 0.1}
    assert isinstance(out["train"]["lr"], float)
    assert out["method"]["regularizers"] == ["dw"]
    assert out["a"] == {"b": {"c": 1}}
    assert out["seed"] == 4
    assert raw == {"train": {"rounds": 3}}, "apply_overrides must not mutate its input"


def test_override_value_may_contain_equals():
    assert apply_overrides({}, ["meta.note=a=b"])["meta"]["note"] == "a=b"


def test_later_override_wins():
    assert apply_overrides({}, ["seed=1", "seed=2"])["seed"] == 2


@pytest.mark.parametrize("bad", ["foo", "train.rounds"])
def test_override_without_equals(bad):
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, [bad])


@pytest.mark.parametrize("bad", ["a..b=1", ".x=1", "x.=1", "=1"])
def test_override_malformed_key(bad):
    with pytest.raises(ConfigError, match="malformed"):
        apply_overrides({}, [bad])


def test_override_into_scalar_is_error():
    with pytest.raises(ConfigError, match="'seed' is a value"):
        apply_overrides({"seed": 1}, ["seed.x=1"])


def test_switching_method_drops_old_params():
    raw = {"method": {"name": "fedprox", "mu": 0.1}}
    out = apply_overrides(raw, ["method.name=fedavg"])
    assert out["method"] == {"name": "fedavg"}
    # ... so the result resolves instead of failing on fedavg's unknown 'mu'.
    cfg = resolve(build_config(out)).config
    assert cfg.method.name == "fedavg" and cfg.method.params_dict() == {}


def test_same_method_name_keeps_params():
    out = apply_overrides({"method": {"name": "fedprox", "mu": 0.1}}, ["method.name=fedprox"])
    assert out["method"] == {"name": "fedprox", "mu": 0.1}


def test_switch_then_set_param():
    out = apply_overrides({"method": {"name": "fedavg"}}, ["method.name=fedprox", "method.mu=0.5"])
    assert out["method"] == {"name": "fedprox", "mu": 0.5}


def test_a_parameter_given_before_the_name_lands_in_the_new_entry():
    raw = {"method": {"name": "fedavg"}, "partition": {"name": "shards", "k": 2}}
    out = apply_overrides(raw, ["method.mu=0.5", "partition.alpha=0.3", "method.name=fedprox", "partition.name=dirichlet"])
    assert out["method"] == {"name": "fedprox", "mu": 0.5}
    assert out["partition"] == {"name": "dirichlet", "alpha": 0.3}  # the file's k belonged to shards
    cfg = resolve(build_config(out)).config
    assert cfg.method.params_dict()["mu"] == 0.5 and cfg.partition.params_dict()["alpha"] == 0.3


def test_the_files_parameters_of_the_old_entry_go_whatever_the_order():
    out = apply_overrides({"method": {"name": "fedprox", "mu": 0.1}}, ["method.tau=0.3", "method.name=moon"])
    assert out["method"] == {"name": "moon", "tau": 0.3}


def test_a_parameter_the_newly_named_entry_lacks_is_named():
    out = apply_overrides({}, ["method.mu=0.5", "method.name=fedavg"])
    with pytest.raises(ConfigError, match=r"method\.mu: method 'fedavg' has no parameter 'mu'"):
        resolve(build_config(out))


def test_overrides_may_be_key_value_pairs():
    out = apply_overrides({"model": {"name": "mlp"}}, [("model.mapping", [64, 64]), ("method.name", "fedprox"),
                                                       "method.mu=0.5"])
    assert out["model"] == {"name": "mlp", "mapping": [64, 64]} and out["method"] == {"name": "fedprox", "mu": 0.5}


def test_switching_dataset_keeps_fraction():
    # data.fraction is a field of the data section itself (DataConfig), not a parameter of the
    # dataset entry, so switching data.name should not reset it to 1.0.
    out = apply_overrides({"data": {"name": "fmnist", "fraction": 0.05}}, ["data.name=digits"])
    assert out["data"].get("fraction") == 0.05, (
        "BUG (config.py apply_overrides): 'data.name=digits' clears the whole data section, silently "
        "dropping data.fraction (0.05 -> default 1.0); only entry parameters should be dropped"
    )


# ---- validation -----------------------------------------------------------------------------------

def test_unknown_top_level_key_lists_valid_keys():
    with pytest.raises(ConfigError) as exc:
        build_config({"bogus": 1})
    msg = str(exc.value)
    assert "bogus" in msg and "unknown key" in msg
    for key in ("data", "partition", "model", "method", "clients", "train", "seed"):
        assert key in msg


def test_unknown_nested_key_lists_valid_keys():
    with pytest.raises(ConfigError) as exc:
        build_config({"train": {"lrr": 0.1}})
    msg = str(exc.value)
    assert "train.lrr" in msg
    assert "valid keys" in msg
    for key in ("rounds", "epochs", "batch_size", "lr", "momentum"):
        assert key in msg


def test_unknown_clients_key():
    with pytest.raises(ConfigError, match=r"clients\.total.*valid keys: num, per_round"):
        build_config({"clients": {"total": 3}})


@pytest.mark.parametrize("raw, where", [
    ({"train": {"lr": "fast"}}, "train.lr"),
    ({"train": {"rounds": "many"}}, "train.rounds"),
    ({"train": {"optimizer": "rmsprop"}}, "train.optimizer"),
    ({"train": {"lr": -1.0}}, "train.lr"),
    ({"clients": {"num": 0}}, "clients.num"),
    ({"data": {"fraction": 1.5}}, "data.fraction"),
    ({"seed": "abc"}, "seed"),
])
def test_wrong_type_or_range(raw, where):
    with pytest.raises(ConfigError) as exc:
        build_config(raw)
    assert where in str(exc.value)


def test_wrong_type_from_override(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {})
    with pytest.raises(ConfigError, match="train.rounds"):
        load_config(path, ["train.rounds=[1, 2]"])


def test_per_round_exceeds_num_names_fix():
    with pytest.raises(ConfigError) as exc:
        build_config({"clients": {"num": 2, "per_round": 5}})
    msg = str(exc.value)
    assert "per_round" in msg and "(5)" in msg and "(2)" in msg
    assert "lower clients.per_round" in msg


def test_per_round_equal_num_ok():
    cfg = build_config({"clients": {"num": 3, "per_round": 3}})
    assert cfg.clients.per_round == 3


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- resolve against the registries ----------------------------------------------------------------

@pytest.mark.parametrize("section, kind, expected", [
    ("method", "method", ["centralized", "fedavg", "fedprox", "local"]),
    ("partition", "partition", ["dirichlet", "iid", "shards"]),
    ("model", "model", ["cnn"]),
    ("data", "dataset", ["digits", "fmnist"]),
])
def test_unknown_name_lists_choices(section, kind, expected):
    with pytest.raises(ConfigError) as exc:
        resolve(build_config({section: {"name": "nope"}}))
    msg = str(exc.value)
    assert f"unknown {kind} 'nope'" in msg
    assert "valid choices" in msg
    for name in expected:
        assert name in msg


def test_unknown_method_param_names_valid_keys():
    with pytest.raises(ConfigError) as exc:
        resolve(build_config({"method": {"name": "fedprox", "nu": 1}}))
    msg = str(exc.value)
    assert "method.nu" in msg
    assert "valid keys for method 'fedprox'" in msg and "mu" in msg


def test_param_for_method_without_params():
    with pytest.raises(ConfigError, match=r"method\.mu.*valid keys for method 'fedavg': name, \(none\)"):
        resolve(build_config({"method": {"name": "fedavg", "mu": 0.1}}))


def test_wrong_param_type_for_partition():
    with pytest.raises(ConfigError, match=r"partition\.alpha"):
        resolve(build_config({"partition": {"name": "dirichlet", "alpha": "lots"}}))
    with pytest.raises(ConfigError, match=r"partition\.alpha"):
        resolve(build_config({"partition": {"name": "dirichlet", "alpha": 0}}))


def test_resolve_writes_defaults():
    resolved = resolve(build_config({"method": {"name": "fedprox"}, "data": {"name": "digits", "fraction": 0.5}}))
    cfg = resolved.config
    assert cfg.method.params_dict() == {"mu": 0.001, "gradient": "direct"}
    assert resolved.method.params.mu == 0.001
    part = cfg.partition.params_dict()
    assert part["alpha"] == 0.5 and "min_size" in part and "max_tries" in part
    assert cfg.data.fraction == 0.5, "resolve keeps the section's own fields"
    assert "root" in cfg.data.params_dict()
    # Resolving the resolved config is a fixed point.
    assert resolve(cfg) == resolved


def test_resolve_keeps_given_params():
    resolved = resolve(build_config({"method": {"name": "fedprox", "mu": 0.25},
                                     "partition": {"name": "dirichlet", "alpha": 0.1}}))
    assert resolved.config.method.params_dict() == {"mu": 0.25, "gradient": "direct"}
    assert resolved.config.partition.params_dict()["alpha"] == 0.1
    assert resolved.partition.params.alpha == 0.1


def test_resolved_yaml_lists_defaults(tmp_path):
    dumped = yaml.safe_load(to_yaml(resolve(build_config({"method": {"name": "fedprox"}})).config))
    assert dumped["method"] == {"name": "fedprox", "mu": 0.001, "gradient": "direct"}
    assert "alpha" in dumped["partition"]


# ---- closed sets typed from where they are defined --------------------------------------------------

@pytest.mark.parametrize("raw, key, choices", [
    ({"train": {"augment": "flip"}}, "train.augment", ["none", "crop", "crop_flip", "autoaugment"]),
    ({"logging": ["csv", "tensorbord"]}, "logging.1", ["csv", "tensorboard", "wandb"]),
    ({"train": {"device": "gpu"}}, "train.device", ["auto", "cpu", "cuda", "cuda:N", "mps", "simulated"]),
    ({"guidance": {"device": "cuda:x"}}, "guidance.device", ["auto", "cpu", "cuda", "cuda:N", "mps", "simulated"]),
])
def test_a_wrong_choice_is_refused_at_load_with_the_choices(tmp_path, raw, key, choices):
    with pytest.raises(ConfigError) as exc:
        load_config(write_yaml(tmp_path / "c.yaml", raw))
    line = next(line for line in str(exc.value).splitlines() if line.strip().startswith(f"{key}:"))
    assert all(c in line for c in choices), line
    assert "write" in line, "the line names the fix"


def test_the_typed_choices_are_those_defined_where_they_are_used():
    from fedguide.core.device import DEVICE_NAMES
    from fedguide.data.augment import AUGMENTATIONS
    from fedguide.fl.loggers import LOGGERS

    for device in (*DEVICE_NAMES, "cuda:0", "cuda:12"):
        assert build_config({"train": {"device": device}, "guidance": {"device": device}}).train.device == device
    for augment in AUGMENTATIONS:
        assert build_config({"train": {"augment": augment}}).train.augment == augment
    assert build_config({"logging": LOGGERS.names()}).logging == LOGGERS.names()


# ---- resolved once, into types ------------------------------------------------------------------------

def test_resolving_parses_each_named_section_once_and_the_run_never_again(monkeypatch, tmp_path):
    from fedguide.fl.setup import open_run, prepare
    from tests.tiny import tiny_config

    calls = []
    parse = Registry.parse_params

    def counted(self, name, raw, where):
        calls.append(where)
        return parse(self, name, raw, where)

    monkeypatch.setattr(Registry, "parse_params", counted)
    cfg = tiny_config(method={"name": "fedprox", "mu": 0.5}, regularizers=[{"name": "dw", "mu": 0.2}],
                      model={"head_bias": False})
    resolved = resolve(cfg)
    assert sorted(calls) == sorted(["data", "partition", "model", "method", "runtime", "server_optimizer",
                                   "regularizers[0]"])
    calls.clear()
    prepared = prepare(resolved)  # a resolved config is taken as it is
    open_run(prepared, tmp_path / "run")
    assert calls == [], "the data, the partition, the model, the method and the regularisers take parsed parameters"
    assert prepared.resolved is resolved


def test_the_resolved_config_types_each_section():
    from fedguide.data.partition import PARTITIONS
    from fedguide.methods import METHODS
    from fedguide.methods.compose import REGULARIZERS

    r = resolve(build_config({"method": {"name": "fedprox", "mu": 0.25}, "data": {"name": "digits", "fraction": 0.5},
                              "regularizers": ["dw"], "model": {"name": "cnn", "head_bias": False}}))
    assert r.method.entry is METHODS.get("fedprox") and r.method.params.mu == 0.25 and r.method.name == "fedprox"
    assert r.partition.entry is PARTITIONS.get("dirichlet") and r.partition.params.alpha == 0.5
    assert (r.data.name, r.data.fraction, r.data.public_fraction, r.data.on_device) == ("digits", 0.5, 0.0, "auto")
    assert [(g.entry, g.params.mu) for g in r.regularizers] == [(REGULARIZERS.get("dw"), 0.1)]
    assert r.config.regularizers == [{"name": "dw", "mu": 0.1, "mu_decay_every": None, "mu_decay_factor": 10.0}]
    with pytest.raises(AttributeError):
        r.method = r.model  # frozen: resolved once, read everywhere


def test_build_regularizers_takes_parsed_parameters():
    from pydantic import BaseModel

    from fedguide.methods.compose import Regularizer, build_regularizers

    class Term(Regularizer):
        class Params(BaseModel):
            mu: float = 0.0

    reg = Registry("regularizer")
    reg.register("term")(Term)
    parsed = reg.parse("term", {"mu": 0.5}, "regularizers[0]")
    (term,) = build_regularizers([parsed], run="the run")
    assert type(term) is Term and term.params is parsed.params and term.run == "the run"


CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_a_resolved_config_resolves_to_itself_from_its_dump(path):
    """config.yaml (the dump) resolves to the same types and dumps to the same text: resume, report and a
    Flower client read a run's settings back exactly."""
    resolved = resolve(load_config(path))
    dumped = to_yaml(resolved.config)
    again = resolve(build_config(yaml.safe_load(dumped)))
    assert again == resolved and to_yaml(again.config) == dumped


def test_the_smoke_configs_dump_is_unchanged():
    """What config.yaml holds for configs/smoke.yaml, every default written out. A change here changes every
    run folder's config.yaml (and what resume compares); when it is meant, rewrite the expected file with
    ``python -c "from tests.test_config import write_smoke_dump; write_smoke_dump()"``."""
    assert to_yaml(resolve(load_config(REPO / "configs/smoke.yaml")).config) == SMOKE_DUMP.read_text()


SMOKE_DUMP = Path(__file__).parent / "expected" / "smoke.resolved.yaml"


def write_smoke_dump() -> None:
    SMOKE_DUMP.write_text(to_yaml(resolve(load_config(REPO / "configs/smoke.yaml")).config))


# ---- the Registry itself ----------------------------------------------------------------------------

def test_registry_register_get_and_duplicates():
    reg = Registry("widget")

    @reg.register("b")
    def b():
        """B does things.

        More text."""

    @reg.register("a", summary="the a")
    def a():
        pass

    assert reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg
    assert reg.get("b").summary == "B does things."
    assert reg.get("a").summary == "the a"
    assert [e.name for e in reg.entries()] == ["a", "b"]
    with pytest.raises(RuntimeError, match="registered twice"):
        reg.register("a")(lambda: None)
    with pytest.raises(ConfigError, match="unknown widget 'c'; valid choices: a, b"):
        reg.get("c")
