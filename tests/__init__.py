"""fedguide's tests, a package mirroring src/fedguide/: helpers import as ``tests.tiny``, ``tests.e2e.helpers``,
``tests.methods.pfl_cases``; benchmark scripts by their own name (``import paper_scale``), as they import each
other. Both through pyproject's ``[tool.pytest.ini_options] pythonpath``; a Python a test starts gets the same
path from ``python_env``."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# pyproject's pythonpath, for a Python a test starts.
PYTHONPATH = (REPO, REPO / "benchmarks")


def python_env(**extra: str) -> dict[str, str]:
    """os.environ with the tests' import path first on PYTHONPATH, offline, and ``extra``."""
    path = [str(p) for p in PYTHONPATH] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "FEDGUIDE_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(path), **extra}
