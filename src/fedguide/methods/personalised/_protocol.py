"""``protocol: feddw``: FedDW's protocol for its personalised rows (Tables I and IV), a named preset of a
method's own options.

FedDW's authors released the code that ran every row of their tables (github.com/liuvvvvv1/FedDW:
``Updata.py`` the local updates, ``main.py`` the rounds, ``config.py`` the settings, ``utils.py`` the scoring).
Where it runs a baseline otherwise than the baseline's own paper or code, the method has an option for it,
and ``protocol: feddw`` sets those options to FedDW's values; ``protocol: own`` (the default) leaves the
method's own defaults. Options the config gives itself win over the preset, and the resolved config
(config.yaml of a run) lists the values the preset gave, so a run shows what it ran.

A preset, not a config section: the FedDW paper configs sweep ``method.name``, and a method's options go with
its name, so each method carries the preset itself and the engine never learns which method it runs.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

Protocol = Literal["own", "feddw"]


def protocol_field() -> Any:
    return Field("own", description="own: the method's own defaults; feddw: FedDW's released protocol for its "
                                    "pFL rows (sets the options it names; options given explicitly win)")


def apply_protocol(data: Any, presets: dict[str, dict[str, Any]]) -> Any:
    """``data`` (a method's raw options) with every option of ``presets[data['protocol']]`` it does not give."""
    if not isinstance(data, dict) or data.get("protocol", "own") not in presets:
        return data
    return {**presets[data["protocol"]], **data}
