"""Every method says where it is defined: its ``paper`` link is the one docs/methods.md gives it, a paper's own
baseline links that paper, and `fedguide list` shows the link."""
from __future__ import annotations

import json
import re
from pathlib import Path

from fedguide.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
# Baselines a paper defines for itself, and the paper whose link they carry.
DEFINED_BY = {"sd_gen": "fedcado", "centroid_finetune": "feddisc", "zero_shot": "feddisc", "fedavg_sm": "feddisc",
              "align_features": "feddifrc"}
# The references without a paper, and methods whose paper has no link in the docs yet.
UNLINKED = {"local", "centralized", "fedcda", "fednh", "feddda"}


def docs_links() -> dict[str, str]:
    text = (ROOT / "docs" / "methods.md").read_text()
    links = {}
    for name, cell in re.findall(r"^\| `(\w+)` \| [^|]* \| ([^|]*) \|", text, re.M):
        urls = re.findall(r"\((https?://[^)]+)\)", cell)
        if urls:
            links[name] = urls[0]
    return links


def test_every_method_links_the_paper_the_docs_give_it():
    links = docs_links()
    for name in METHODS.names():
        paper = METHODS.get(name).obj.paper
        if name in UNLINKED:
            assert paper == "", name
        elif name in DEFINED_BY:
            assert paper == METHODS.get(DEFINED_BY[name]).obj.paper != "", name
        else:
            assert name in links, f"{name}: give its paper's link in docs/methods.md's table"
            assert paper == links[name], name


def test_list_shows_each_methods_paper(capsys):
    from fedguide.cli import main

    assert main(["list", "--json"]) == 0
    methods = {m["name"]: m for m in json.loads(capsys.readouterr().out)["methods"]}
    assert methods["feddw"]["paper"] == "https://arxiv.org/abs/2412.04521"
    assert "paper" not in methods["local"]
    assert main(["list"]) == 0
    assert "https://arxiv.org/abs/2412.04521" in capsys.readouterr().out
