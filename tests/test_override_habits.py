"""Habits users bring from Hydra and FL-bench, and typos: a sentence with the fix, never pydantic's jargon."""
from __future__ import annotations

import pytest

from fedguide.config import apply_overrides, build_config
from fedguide.registry import ConfigError
from fedguide.fl.setup import resolve
from tests.tiny import tiny_raw


def load(*overrides):
    return build_config(apply_overrides(tiny_raw(), list(overrides)))


def test_a_section_given_its_entry_directly_names_the_dotted_form():
    with pytest.raises(ConfigError, match=r"^override 'method=fedprox' would replace the method section; write "
                                          r"method.name=fedprox$"):
        load("method=fedprox")
    with pytest.raises(ConfigError, match=r"model: 'cnn' is not a section; .* write model: \{name: cnn\} \(on the "
                                          r"command line model.name=cnn\)"):
        build_config({**tiny_raw(), "model": "cnn"})


@pytest.mark.parametrize("override, hint", [
    ("metohd.name=fedprox", "metohd: unknown key (did you mean 'method'?)"),
    ("train.lrr=0.1", "train.lrr: unknown key (did you mean 'lr'?)"),
])
def test_a_mistyped_key_gets_a_did_you_mean(override, hint):
    with pytest.raises(ConfigError) as err:
        load(override)
    assert hint in str(err.value) and "extra_forbidden" not in str(err.value)


def test_a_mistyped_name_or_parameter_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown method 'fedprx' \(did you mean 'fedprox'\?\); valid choices"):
        resolve(load("method.name=fedprx"))
    with pytest.raises(ConfigError, match=r"method 'fedprox' has no parameter 'muu' \(did you mean 'mu'\?\)"):
        resolve(load("method.name=fedprox", "method.muu=0.1"))
