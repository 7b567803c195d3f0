"""Figures are a registry: a new module in fedguide.analysis.figures is an option of ``fedguide analyze``
and a figure it makes, with no other edit; the built-in figures keep their names, options and order."""
import json
import sys
import textwrap

import pytest

import fedguide.analysis.figures
from fedguide.analysis import analyze
from fedguide.analysis.figure import FIGURES, in_order
from fedguide.cli import build_parser, main

BUILT_IN = ["tsne", "pca", "weight_norms", "sl_cr", "flops", "samples", "generated_data"]
OPTIONS = ["--tsne", "--pca", "--weight-norms", "--sl-cr", "--flops", "--samples", "--generated-data"]

EXTRA = '''
from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import save_numbers


@FIGURES.register("class_count", summary="how many classes the run's data has")
class ClassCount(Figure):
    def applies(self, run):
        return None

    def make(self, run, points, seed):
        return [save_numbers(run.out_dir / "class_count.json", {"classes": len(run.class_names), "seed": seed})]
'''


def analyze_options(parser) -> list[str]:
    sub = next(a for a in parser._actions if a.dest == "command")
    return [o for action in sub.choices["analyze"]._actions for o in action.option_strings
            if o not in ("-h", "--help", "--points", "--seed")]


@pytest.fixture
def extra_figure(tmp_path, monkeypatch):
    """A figure module dropped into the figures package (its folder added to the package's path), found by
    discovery as a new file in src/fedguide/analysis/figures/ would be; the registry as it was afterwards."""
    (tmp_path / "class_count.py").write_text(textwrap.dedent(EXTRA))
    FIGURES.names()  # the built-in figures registered first: restoring the registry must keep them
    monkeypatch.setattr(fedguide.analysis.figures, "__path__", [*fedguide.analysis.figures.__path__, str(tmp_path)])
    monkeypatch.setattr(FIGURES, "_entries", dict(FIGURES._entries))
    monkeypatch.setattr(FIGURES, "_loaded", False)
    yield "class_count"
    sys.modules.pop("fedguide.analysis.figures.class_count", None)


def test_the_built_in_figures_keep_their_names_options_and_order():
    assert [entry.name for entry in in_order()] == BUILT_IN
    assert analyze_options(build_parser()) == OPTIONS
    assert all(entry.summary for entry in in_order())


def test_a_figure_module_added_to_the_package_is_an_option_and_is_made(extra_figure, fedavg_run, capsys):
    parser = build_parser()
    assert analyze_options(parser) == OPTIONS + ["--class-count"]  # after the built-in ones (default order)
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "how many classes" in sub.choices["analyze"].format_help()
    assert main(["analyze", str(fedavg_run), "--class-count", "--seed", "3"]) == 0
    assert f"class_count: {fedavg_run / 'analysis' / 'class_count.json'}" in capsys.readouterr().out
    assert json.loads((fedavg_run / "analysis" / "class_count.json").read_text()) == {"classes": 10, "seed": 3}
    result = analyze(fedavg_run, ["class_count"])
    assert list(result.written) == ["class_count"] and not result.skipped


def test_an_unknown_figure_names_the_registered_ones(tmp_path):
    from fedguide.registry import ConfigError

    with pytest.raises(ConfigError, match="choose from tsne, pca, weight_norms, sl_cr, flops, samples"):
        analyze(tmp_path, ["nope"])
