"""Which figures ``fedguide analyze`` makes and for which runs: one module per figure, each with
``applies(run)`` (None, or the sentence saying why the figure does not apply to the run) and
``make(run, points=, seed=)`` (the paths it wrote under RUN/analysis/).

Asked for by name, a figure that does not apply is an error naming the reason; with no figure named,
every figure that applies is made and the others are skipped with their reason.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from fedguide.registry import ConfigError


@dataclass(frozen=True)
class FigureKind:
    name: str  # also the option: --tsne, --pca, --weight-norms, ...
    module: str
    help: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def load(self):
        return importlib.import_module(self.module)


FIGURES: tuple[FigureKind, ...] = (
    FigureKind("tsne", "fedguide.analysis.tsne",
               "t-SNE of the final global model's features on a stratified test subset, by class (and domain)"),
    FigureKind("pca", "fedguide.analysis.diffusion_maps",
               "diffusion-guided runs: PCA-as-RGB and K-means maps of the diffusion features of a few test images"),
    FigureKind("weight_norms", "fedguide.analysis.weight_norms",
               "norm of each class's classifier row against the class's share of the data (global, clients)"),
    FigureKind("sl_cr", "fedguide.analysis.sl_cr",
               "FedDW's soft-label and class-relation matrices of the final model"),
    FigureKind("flops", "fedguide.analysis.flops",
               "FLOPs of one local training step of the method against FedAvg's"),
    FigureKind("samples", "fedguide.analysis.samples",
               "one-shot generating runs: generated images beside client originals of the same class"),
)
BY_NAME = {f.name: f for f in FIGURES}


@dataclass
class AnalysisResult:
    run_dir: Path
    written: dict[str, list[Path]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # figure -> why it does not apply


def analyze(run_dir: Path | str, figures: Optional[Sequence[str]] = None, points: int = 2000, seed: int = 0,
            log: Callable[[str], None] = lambda s: None) -> AnalysisResult:
    """Write the asked figures (default: every one that applies) of a finished run into RUN/analysis/."""
    from fedguide.analysis.opened import AnalysisRun

    unknown = [f for f in figures or () if f not in BY_NAME]
    if unknown:
        raise ConfigError(f"unknown figure(s) {unknown}; choose from {', '.join(BY_NAME)}")
    if points < 10:
        raise ConfigError(f"points={points} is too few for a t-SNE; ask for at least 10")
    run = AnalysisRun(run_dir)
    result = AnalysisResult(run.run_dir)
    kinds = [BY_NAME[f] for f in dict.fromkeys(figures)] if figures else list(FIGURES)
    todo = []
    for kind in kinds:  # every refusal before the first figure is computed
        module = kind.load()
        reason = module.applies(run)
        if reason is None:
            todo.append((kind, module))
        elif figures:
            raise ConfigError(f"{kind.option} does not apply to {run.run_dir}: {reason}")
        else:
            result.skipped[kind.name] = reason
            log(f"{kind.name}: skipped ({reason})")
    for kind, module in todo:
        log(f"{kind.name}: computing")
        result.written[kind.name] = module.make(run, points=points, seed=seed)
    return result
