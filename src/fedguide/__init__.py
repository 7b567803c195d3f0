"""fedguide: heterogeneous federated learning guided by pretrained diffusion models.

The Python API (``fedguide.api``): ``run``, ``resume``, ``sweep``, ``dry_run``, ``load``, ``load_run``,
``load_runs``, ``results_table``, ``pivot_table``, ``paired_table``, ``write_report``. It is loaded on first use,
so ``import fedguide`` stays cheap (no torch).
"""
from __future__ import annotations

import importlib
import os
from typing import Any

# cuBLAS reads its workspace setting once per process, at its first call: set here, before anything can make
# that call, a deterministic run keeps working after earlier CUDA work in the same process (an in-process
# sweep, the tests). A value the user set wins. (fedguide.core.device.CUBLAS_WORKSPACE; PyTorch's notes on
# reproducibility.)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

__version__ = "0.1.0"

__all__ = ["ConfigError", "Interrupted", "Observer", "RunRecord", "dry_run", "load", "load_run", "load_runs",
           "paired_table", "pivot_table", "results_table", "resume", "run", "sweep", "write_report"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # By name, not an import statement: modules below the API import this package for __version__,
        # and the API imports them, so the package must not import the API while it is being imported.
        return getattr(importlib.import_module("fedguide.api"), name)
    raise AttributeError(f"module 'fedguide' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
