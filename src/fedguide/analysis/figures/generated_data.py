"""Each client's label histogram before and after the images a method generated for it (FedDDA's ``add: lack``
fills the classes a client lacks; ``add: random`` hands it a slice of a class-balanced pool; FedRCL ◇ adds
images of the classes it holds).

Read from the run's guidance record (``guidance/<method>.json``, ``generated_data.histograms``: the clients'
real samples per class, the generated counts and their sum, written when the method set up), drawn as the
partition heatmap of ``fedguide report`` twice: ``generated_data_before.png`` (real samples) and
``generated_data_after.png`` (real + generated), with the numbers and a per-client summary (classes held,
smallest class count) in ``generated_data.json``. Nothing is recomputed: the run need not be opened.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import save_numbers
from fedguide.report.plots import heatmap

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun


def recorded(run_dir: Path) -> Optional[tuple[str, dict[str, Any]]]:
    """(method, histograms) of the first guidance record that holds generated-data histograms, else None."""
    for path in sorted((run_dir / "guidance").glob("*.json")):
        try:
            note = json.loads(path.read_text()).get("generated_data")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(note, dict) and isinstance(note.get("histograms"), dict):
            return path.stem, {**note["histograms"], "add": note.get("add")}
    return None


def client_summary(counts: np.ndarray) -> dict[str, list[int]]:
    """Per client: how many classes it has any sample of, and its smallest class count."""
    return {"classes_held": (counts > 0).sum(1).tolist(), "smallest_class": counts.min(1).tolist()}


@FIGURES.register("generated_data",
                  summary="each client's label histogram before and after the images the method generated for it "
                          "(FedDDA, FedRCL with generated data)")
class GeneratedData(Figure):
    order = 70  # after the general figures: it applies to the runs that generated data only

    def applies(self, run: AnalysisRun) -> Optional[str]:
        if recorded(run.run_dir) is None:
            return ("the run's guidance record holds no generated-data histograms (only FedDDA and FedRCL with "
                    "generated data generate images for their clients)")
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        method, hist = recorded(run.run_dir)
        real, added = np.asarray(hist["real"], dtype=float), np.asarray(hist["generated"], dtype=float)
        after = real + added
        names, label = hist.get("class_names"), f"{method}" + (f" add: {hist['add']}" if hist.get("add") else "")
        k, c = real.shape
        out = run.out_dir
        paths = [heatmap(real, names, "class", f"{label}: real samples per class ({k} clients × {c} classes)",
                         out / "generated_data_before.png"),
                 heatmap(after, names, "class", f"{label}: real + generated per class ({int(added.sum())} generated)",
                         out / "generated_data_after.png")]
        real, added, after = real.astype(int), added.astype(int), after.astype(int)
        numbers = {"method": method, "add": hist.get("add"), "class_names": names, "real": real, "generated": added,
                   "after": after, "before_summary": client_summary(real), "after_summary": client_summary(after)}
        return paths + [save_numbers(out / "generated_data.json", numbers)]
