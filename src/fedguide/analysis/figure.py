"""What a figure of ``fedguide analyze`` is, and the registry that finds them.

A figure is a ``Figure`` subclass in a public module of ``fedguide.analysis.figures``, registered by name:

    @FIGURES.register("tsne", summary="t-SNE of the final global model's features ...")
    class TSNE(Figure):
        order = 10
        def applies(self, run): return None if run.trained else run.untrained_reason
        def make(self, run, points, seed): return [png_path, json_path]

The name is also the option (``--tsne``; ``weight_norms`` is ``--weight-norms``) and the summary its help,
so a new module in that package is a new option with no other edit. ``fedguide --help`` imports every
figure module to build those options: a figure's module imports its heavy libraries (scikit-learn,
matplotlib, the guidance models) inside the functions that use them.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional

from fedguide.registry import Entry, Registry

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun


class Figure:
    """One figure of a finished run; registered in ``FIGURES``, made once per ``analyze`` call that asks."""

    # Place among the figures in ``fedguide analyze --help`` and when every figure is made (cheap and
    # general figures first); ties go by name.
    order: ClassVar[int] = 100
    # The fewest sampled points the figure can be made from (t-SNE's perplexity needs more than a handful).
    min_points: ClassVar[int] = 1

    def applies(self, run: AnalysisRun) -> Optional[str]:
        """None, or the sentence saying why the figure does not apply to ``run``. Cheap: every figure
        asked for is checked before the first one is computed."""
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        """Write the figure under ``run.out_dir`` (RUN/analysis/) and return the paths written.
        ``points``: at most this many test images where the figure samples them; ``seed``: of every
        random choice the figure makes."""
        raise NotImplementedError


# Every public module of fedguide.analysis.figures registers its figure here; imported at the first lookup.
FIGURES: Registry[type[Figure]] = Registry("figure", plugins=("fedguide.analysis.figures",))


def option(name: str) -> str:
    """The command-line flag of figure ``name``."""
    return "--" + name.replace("_", "-")


def in_order() -> list[Entry[type[Figure]]]:
    """The registered figures in the order ``analyze`` lists and makes them."""
    return sorted(FIGURES.entries(), key=lambda e: (e.obj.order, e.name))
