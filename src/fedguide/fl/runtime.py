"""The runtime interface: where the clients of a run train. A registry like the methods'.

A runtime is a ``Runtime`` subclass registered in ``RUNTIMES`` under the name ``runtime.name`` gives;
its ``Params`` validate the rest of the ``runtime:`` section, as a method's validate ``method:``. The
engine asks it for the processes and threads it will use (``resources``), then, once the server's
method is set up, for an ``Executor`` (``start``), and from then on only calls the executor. So the
engine never names a runtime, and a new runtime is one new module in ``fl/runtimes/``.

This module is the bottom of fl/: the engine, the set-up and the runtimes import it, and it imports
nothing of fl/ but ``client_step`` (what an executor returns).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch
from pydantic import BaseModel

from fedguide.core.records import Record
from fedguide.fl.client_step import ClientResult
from fedguide.registry import NoParams, Registry

# Every public module below fl/runtimes/ registers its runtime here; they are imported at the first lookup.
RUNTIMES: Registry = Registry("runtime", plugins=("fedguide.fl.runtimes",))

# torch's own choice at start-up, so a run asking for "the default" gets it even after an earlier run
# in the same process changed the thread count.
DEFAULT_THREADS = torch.get_num_threads()


class WorkerCrashed(RuntimeError):
    """A process training clients died or failed; the run stops, resumable from its last checkpoint."""


@dataclass
class RunHandle:
    """What a runtime gets to start its executor: the opened run on the server."""

    prepared: Any  # fl.setup.Prepared: the config, parsed parameters and federated data
    ctx: Any  # the server's RunContext (a runtime may replace ``ctx.store``: state that lives elsewhere)
    method: Any  # the server's Method, already set up
    run_dir: Path
    log: Callable[[str], None]
    workers: int  # what ``Runtime.resources`` decided for this run, once
    threads: int
    checkpoint: Any = None  # fl.checkpoint.Checkpoint of a resumed run, else None


class Executor:
    """Trains the clients of a round; the engine's only view of a started runtime."""

    workers: int = 1  # processes that train clients (recorded in summary.json)
    threads: int = 1  # torch threads per such process

    def run_round(self, round_: int, jobs: list[tuple[int, Record]], global_weights: torch.Tensor) -> list[ClientResult]:
        """Train each job's client on its payload; the results in job order (jobs are in client order).
        A client that failed is left out only where the runtime allows it (a deployment's
        ``min_clients``); otherwise the round raises ``WorkerCrashed``."""
        raise NotImplementedError

    def round_metrics(self, round_: int) -> dict[str, Any]:
        """Keys this runtime adds to the round's line in metrics.jsonl (e.g. the clients that failed)."""
        return {}

    def finish(self, metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """At the end of a completed run: keys this runtime adds to summary.json."""
        return {}

    def close(self) -> None:
        """Stop what the runtime started; called once, also when the run fails."""


class Runtime:
    """A registered runtime; subclasses set ``Params`` and implement ``resources`` and ``start``."""

    Params: ClassVar[type[BaseModel]] = NoParams
    # Optional install layers this runtime needs (pyproject extras), checked when a config is resolved.
    extras: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: BaseModel):
        self.params = params

    @classmethod
    def refuses(cls, run_dir: Optional[Path], resume: bool) -> Optional[str]:
        """Why ``fedguide run`` (``resume``: ``fedguide resume``) cannot start this runtime, naming the
        command that can; None when they can."""
        return None

    def resources(self, clients_per_round: int, num_params: int, device: Optional[torch.device] = None
                  ) -> tuple[int, int]:
        """(processes that will train clients, torch threads per process). The server's set-up and
        evaluation run with the same threads, so results do not depend on the number of processes.
        ``device``: where the run computes (``auto`` worker counts on a GPU mean one process per GPU)."""
        raise NotImplementedError

    def start(self, run: RunHandle) -> Executor:
        raise NotImplementedError


def runtime_of(prepared) -> Runtime:
    """The runtime a prepared (resolved) config names, built from its parsed parameters."""
    runtime = prepared.resolved.runtime
    return runtime.entry.obj(runtime.params)
