"""The ``local`` runtime: the clients of a round train in the server process, or in a pool of worker
processes started once per run (``runtime.workers``).

Small FL models use cores poorly through intra-op threads; several single-thread processes train
them faster. The training tensors are moved to shared memory once and reach the workers without a
copy; the global weights go through one shared buffer per round; uploads come back as the same
plain records a network runtime carries. Results are put in client-id order before aggregation,
and every random stream is derived from (seed, round, client), so the number of workers does not
change the result (given the same threads per worker).
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import torch
import torch.multiprocessing as mp
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.device import is_gpu_like, to_cpu
from fedguide.core.records import Record
from fedguide.fl.client_step import ClientResult, run_client
from fedguide.fl.runtime import DEFAULT_THREADS, RUNTIMES, Executor, RunHandle, Runtime, WorkerCrashed
from fedguide.fl.setup import open_run

GLOBAL = "__fedguide_global_weights__"  # stands for the shared global-weights buffer in a payload
POLL_SECONDS = 0.5


def auto_workers(cores: int, per_round: int, num_params: int) -> tuple[int, int]:
    """(workers, threads per worker) from the core count and the model size.

    With two cores or fewer the clients train in the server process on every core: there, two
    single-thread processes trained the FMNIST CNN 1.19× slower than one two-thread process
    (benchmarks/results/parallel_clients.txt), a pool's processes slowing each other down by about
    a fifth. Above that, models under ~5 M parameters, which profit little from intra-op threads,
    get one thread per process and as many processes as cores (never more than the clients of a
    round); larger models get two threads each.
    """
    if cores <= 2:
        return 1, max(1, cores)
    threads = 1 if num_params < 5_000_000 else 2
    workers = max(1, min(per_round, cores // threads))
    return workers, threads


def _die_with_parent() -> None:
    # Linux: the kernel kills this worker when its parent dies, even by SIGKILL: no orphans. The parent is the
    # server, or the fork server, which exits when the server does (multiprocessing.forkserver).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else (a reused id: the server is gone either way)
        return False
    return True


def _next(tasks, parent: int) -> Any:
    """The next message, or None when told to stop or when the server is gone."""
    while True:
        try:
            return tasks.get(timeout=POLL_SECONDS)
        except queue.Empty:
            # The server is gone (non-Linux fallback of the death signal). Its id, not getppid(): a worker
            # forked by the fork server has that server, not the run's, as its parent.
            if not _alive(parent):
                return None


# What the fork server imports once for every worker it forks. Besides this module (torch), what every worker
# imports anyway: the run's set-up and the methods, and torch._dynamo, which torch imports lazily at the first
# optimiser step (torch._compile) and which was most of what a two-worker pool of a tiny run cost when each
# worker imported it itself (benchmarks/pool_start.py). None of them starts a thread.
FORKSERVER_PRELOAD = (__name__, "fedguide.fl.setup", "fedguide.fl.client_step", "fedguide.methods", "torch._dynamo")


def worker_context():
    """Where worker processes come from: a fork server that has imported torch and fedguide once (each worker
    is then forked from it in a fraction of a second, and it has never run torch's thread pools, so forking it
    is safe), else spawn (a fresh interpreter per worker, 2-4 s each). The fork server lives as long as the
    process that started it and serves every pool it opens."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the fork server starts, ignored afterwards
    return ctx


def adopt_environment(environ: dict[str, str]) -> None:
    """The server's environment as it was when the pool started: a forked worker would otherwise have the fork
    server's, taken when that started (the working directory and sys.path come with multiprocessing's own
    start-up data)."""
    os.environ.clear()
    os.environ.update(environ)


def _worker(weights: torch.Tensor, tasks, results, parent: int, ready) -> None:
    _die_with_parent()
    # The run itself comes as the first message, not as a Process argument: a Queue is fed by a
    # background thread, whereas a child dying at start-up (a script without a __main__ guard
    # re-imported by spawn) would leave the server blocked writing the arguments into its pipe.
    start = _next(tasks, parent)
    if start is None:
        return
    prepared, run_dir, threads, environ = start
    adopt_environment(environ)
    torch.set_num_threads(threads)
    ctx, method = open_run(prepared, Path(run_dir), setup=True)
    ready.value = 1  # a worker that dies before this never ran fedguide's code (see _check_alive)
    cfg = prepared.config
    while True:
        job = _next(tasks, parent)
        if job is None:
            return
        round_, client_id, payload = job
        payload = {k: (weights if isinstance(v, str) and v == GLOBAL else v) for k, v in payload.items()}
        try:
            res = run_client(ctx, method, cfg.train, cfg.seed, round_, client_id, payload)
            # Through the queue on the CPU: the server may compute elsewhere, and CUDA tensors shared across
            # processes would tie this worker's memory to the server's lifetime of the message.
            results.put(("ok", client_id, replace(res, upload=to_cpu(res.upload))))
        except FloatingPointError as err:  # a diverged client is the run's settings, not a crash
            results.put(("diverged", client_id, str(err)))
        except BaseException as err:  # report, with the client, instead of dying silently
            results.put(("error", client_id, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


class WorkerPool(Executor):
    def __init__(self, prepared, run_dir: Path, workers: int, threads: int, num_weights: int):
        self.workers, self.threads = workers, threads
        splits = prepared.data.splits
        for t in (splits.train_x, splits.train_y):
            t.share_memory_()  # moved once; workers map the same pages
        self.weights = torch.zeros(num_weights).share_memory_()
        train = prepared.config.train
        # A client's cost is its number of optimiser steps; the longest go first (LPT) so that no
        # worker starts a long client when the others are about to finish.
        self.costs = [train.local_steps or len(idx) * train.epochs for idx in prepared.data.client_indices]
        self._mp = worker_context()  # never plain fork: unsafe once torch's thread pools exist
        self.results = self._mp.Queue()
        self.procs, self.tasks, self.ready = [], [], []
        for _ in range(workers):
            q = self._mp.Queue()
            ready = self._mp.Value("b", 0)
            p = self._mp.Process(target=_worker, daemon=True,
                                 args=(self.weights, q, self.results, os.getpid(), ready))
            p.start()
            q.put((prepared, str(run_dir), threads, dict(os.environ)))
            self.procs.append(p)
            self.tasks.append(q)
            self.ready.append(ready)

    def run_round(self, round_: int, jobs: list[tuple[int, Record]], global_weights: torch.Tensor) -> list[ClientResult]:
        self.weights.copy_(global_weights)
        pending = sorted(jobs, key=lambda job: -self.costs[job[0]])  # stable: ties keep client order
        busy: dict[int, int] = {}  # worker index -> client id
        done: dict[int, ClientResult] = {}
        while pending or busy:
            for w in range(len(self.procs)):  # dynamic scheduling: the next client goes to a free worker
                if w not in busy and pending:
                    cid, payload = pending.pop(0)
                    self.tasks[w].put((round_, cid, self._share(payload, global_weights)))
                    busy[w] = cid
            try:
                status, cid, res = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._check_alive(round_, busy)
                continue
            busy = {w: c for w, c in busy.items() if c != cid}
            if status == "error":
                self.close()
                raise WorkerCrashed(f"client {cid} failed in round {round_}:\n{res}")
            if status == "diverged":
                self.close()
                raise FloatingPointError(res)
            done[cid] = res
        return [done[cid] for cid, _ in jobs]

    @staticmethod
    def _share(payload: Record, global_weights: torch.Tensor) -> Record:
        return {k: (GLOBAL if v is global_weights else v) for k, v in payload.items()}

    def _check_alive(self, round_: int, busy: dict[int, int]) -> None:
        for w, p in enumerate(self.procs):
            if not p.is_alive():
                code = p.exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                doing = f"while training client {busy[w]}" if w in busy else "while idle"
                self.close()
                # Dying before its run context was built: most often a script without a __main__ guard,
                # which each spawned worker re-runs from the top.
                hint = ("" if self.ready[w].value else "; if fedguide was started from a Python script, run it "
                        "under `if __name__ == \"__main__\":` (worker processes re-import the script)")
                raise WorkerCrashed(f"worker process {p.pid} died ({why}) {doing} in round {round_}; "
                                    f"the run stopped at the last completed round{hint}")

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.time() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()  # only processes this pool started, by their own handle
                p.join()
        self.procs = []


class InProcess(Executor):
    """Clients one after another in the server process (workers = 1)."""

    def __init__(self, ctx, method, cfg, threads: int):
        self.ctx, self.method, self.cfg = ctx, method, cfg
        self.workers, self.threads = 1, threads

    def run_round(self, round_: int, jobs: list[tuple[int, Record]], global_weights: torch.Tensor) -> list[ClientResult]:
        return [run_client(self.ctx, self.method, self.cfg.train, self.cfg.seed, round_, cid, payload)
                for cid, payload in jobs]


def resolve_workers(runtime: Any, per_round: int, num_params: int, cores: Optional[int] = None,
                    device: Optional[torch.device] = None) -> tuple[int, int]:
    """(worker processes, torch threads per process) for a run. ``auto`` on a GPU (or the simulated device) is
    one process: the run computes on one GPU, and processes sharing it would each hold a copy of the data and
    the model and queue their kernels behind each other; ask for more with a number."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if runtime.workers == "auto" and device is not None and is_gpu_like(device):
        workers, threads = 1, None
    elif runtime.workers == "auto":
        workers, threads = auto_workers(cores, per_round, num_params)
    else:
        workers, threads = min(int(runtime.workers), per_round), None
    if runtime.threads_per_worker is not None:
        threads = runtime.threads_per_worker
    if threads is None:
        threads = max(1, cores // workers) if workers > 1 else DEFAULT_THREADS
    return workers, threads


Workers = Union[Literal["auto"], Annotated[int, Field(ge=1)]]


class LocalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Default 1: on a 2-core machine the FMNIST CNN trained a round slower in a 2-process pool (13.5 s,
    # one thread each) than in-process with 2 threads (11.4 s); see README "Parallel clients".
    workers: Workers = Field(1, description="processes training the clients of a round; 1 = in the server "
                                            "process; auto = from the cores and the model size")
    threads_per_worker: Optional[int] = Field(
        None, ge=1, description="torch intra-op threads per process; null = chosen with workers")


@RUNTIMES.register("local", summary="clients in the server process, or in a pool of worker processes")
class Local(Runtime):
    Params = LocalParams

    def resources(self, clients_per_round: int, num_params: int, device: Optional[torch.device] = None
                  ) -> tuple[int, int]:
        return resolve_workers(self.params, clients_per_round, num_params, device=device)

    def start(self, run: RunHandle) -> Executor:
        if run.workers > 1:
            return WorkerPool(run.prepared, run.run_dir, run.workers, run.threads, run.ctx.layout.numel)
        return InProcess(run.ctx, run.method, run.prepared.config, run.threads)
