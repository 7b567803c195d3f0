"""Writing a figure: the PNG and the numbers behind it (JSON), both atomically, into RUN/analysis/.

Figures are ``matplotlib.figure.Figure`` objects drawn by the Agg canvas, never through pyplot: no global
backend is switched and no figure is left registered anywhere.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedguide.core.atomic import write_atomic, write_json

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(size: tuple[float, float]) -> Figure:
    # matplotlib here, not at the top: every figure module imports this one, and 'fedguide --help' imports
    # every figure module to list its option.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> Path:
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path


def jsonable(value: Any) -> Any:
    """Tensors, arrays and numpy scalars as plain lists and numbers; NaN as null (JSON has no NaN)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return None if not np.isfinite(value) else value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def save_numbers(path: Path, numbers: dict[str, Any]) -> Path:
    write_json(path, jsonable(numbers))
    return path


def class_colors(num_classes: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if num_classes <= 10 else "tab20"]
    return [cmap(c % cmap.N) for c in range(num_classes)]
