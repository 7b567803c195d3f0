"""Everything that can refuse a run, checked before anything of it is written.

``check`` is the one sequence behind ``fedguide run`` (and ``--dry-run``), ``resume``, the sweep planner and
the Python API: the config resolved against the registries and the data, partition and model built
(``fl.setup.prepare``), the logging back-ends' packages, optionally the method and its regularisers built
over the run context (what their constructors refuse), and the runtime's own refusals for the folder.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from fedguide.config import Config
from fedguide.fl.loggers import check_available
from fedguide.fl.runtime import RUNTIMES
from fedguide.fl.setup import Prepared, open_run, prepare
from fedguide.registry import ConfigError


def check(config: Config, run_dir: Optional[Path] = None, resume: bool = False,
          build_method: bool = True) -> Prepared:
    """The prepared run, or a ConfigError naming the fix. ``build_method=False`` leaves building the method to
    the run itself (it happens there before anything is written); ``run_dir``: also ask the runtime whether
    it can start (``resume``: continue) a run in that folder (``refuse_runtime``)."""
    prepared = prepare(config)
    check_available(prepared.config.logging)  # a missing logger package is named before any folder exists
    if build_method:
        with tempfile.TemporaryDirectory() as scratch:
            open_run(prepared, Path(scratch))
    if run_dir is not None:
        refuse_runtime(prepared.config, Path(run_dir), resume)
    return prepared


def refuse_runtime(config: Config, run_dir: Path, resume: bool) -> None:
    """A ConfigError when the config's runtime cannot start (``resume``: continue) a run in ``run_dir`` from
    here, naming the command that can (a deployment is started with ``fedguide serve``)."""
    refusal = RUNTIMES.get(config.runtime.name).obj.refuses(run_dir, resume=resume)
    if refusal:
        raise ConfigError(refusal)
