"""The clients of a run on Flower's simulation engine: one virtual SuperNode per client, Ray actors.

``FlowerClients`` is a client executor like ``WorkerPool``: the fedguide server loop calls
``run_round(round, jobs, global_weights)`` and gets the ClientResults in job order. Each job becomes
one Flower train Message to the SuperNode whose partition-id is the client's id; the ClientApp's
train handler runs fedguide's own ``run_client`` on the run context it built from the run directory,
so every method runs unchanged and client state lands in the run directory's store.

Decisions:
- The fedguide loop stays in the caller's thread and the Flower simulation runs in a background
  thread whose ServerApp main hands its Grid over and waits until the executor is closed. Running
  the loop inside the ServerApp main instead would need ``run_simulation`` to own the loop, while
  here the command line keeps its progress lines, Ctrl-C and exit codes: ``run_simulation`` runs the
  ServerApp in a thread of its own anyway, so the Grid is used from a non-Flower thread either way.
- Messages go straight through the Grid; Flower's strategies sample clients unseeded, and fedguide
  samples (seeded) in its own loop. Node ids are random, so the node -> partition-id map is learned
  once with a query message to every node.
- Ray is started here (num_cpus = actors, one CPU per actor, no dashboard, logs not echoed, a private
  temporary directory), so Flower's backend finds it running and all it started stops in ``close``.
  Processes Ray started that are still alive after ``ray.shutdown`` are stopped by their own ids.
- Actors: ``runtime.workers`` when a number, else (``auto``, the default) one per core, at most the clients of a
  round (the local runtime's "1 = in the server process" has no Flower meaning: 1 is one actor). Threads per actor:
  ``runtime.threads_per_worker``, default 1; the server evaluates with the same count.
- Cost: Ray and the SuperNodes take seconds to start and each actor builds the run context in
  round 1; after that a round pays Flower's dispatch, which looks for new messages every 0.1 s
  (inside Flower, not changed here), so about 0.05 s per round on average.
- Each actor process builds the run context (data, model, method after ``setup``) once per run
  directory from its config.yaml, as a worker process of the pool does.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from fedguide.core.records import Record
from fedguide.fl.client_step import ClientResult
from fedguide.fl.runtime import Executor
from fedguide.fl.runtimes.flower.messages import (FlowerClientFailed, FlowerRuntimeFailed, decode_result, error_reason,
                                                  train_reply)
from fedguide.fl.runtimes.flower.processes import FLOWER_ENV, alive as _alive, descendants, stop_processes
from fedguide.fl.runtimes.flower.records import encode
from fedguide.fl.run_folder import RunFolder
from fedguide.fl.setup import open_run, prepare
from fedguide.registry import ConfigError

START_TIMEOUT_S = 300  # Ray and the SuperNodes up; a slow, busy machine takes tens of seconds
STOP_TIMEOUT_S = 60
# Replies are polled from Flower's in-memory state: 1 ms at first, backing off to 20 ms, so a short
# round pays about a millisecond of latency and a long one costs no CPU to speak of.
POLL_MIN_S, POLL_MAX_S = 0.001, 0.02


class _DropDeprecation(logging.Filter):
    # run_simulation warns that it is deprecated in favour of `flwr run`, which starts a separate
    # SuperLink process; the in-process engine is what this runtime needs, so the notice is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "deprecated feature" not in str(record.msg).lower()


def _import_flower():
    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"runtime.name=flower-sim needs Flower's simulation engine ({err.name} is missing); "
                          "pip install 'flwr[simulation]'") from None


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def actors_and_threads(params: Any, per_round: int, cores: Optional[int] = None) -> tuple[int, int]:
    """(Ray actors, torch threads per actor) from the runtime's parameters."""
    workers = params.workers if isinstance(params.workers, int) else None
    actors = workers or max(1, min(per_round, cores or cpu_count()))
    return actors, params.threads_per_worker or 1


# ---- client side (runs inside the Ray actors) ---------------------------------------------------
_RUNS: dict[str, Any] = {}  # run dir -> (ctx, method, config); one run per actor process


def _run_context(run_dir: str, threads: int):
    if run_dir not in _RUNS:
        _RUNS.clear()  # a new run replaces the old one: one copy of the data per process
        torch.set_num_threads(threads)
        prepared = prepare(RunFolder(Path(run_dir)).read_config())
        ctx, method = open_run(prepared, Path(run_dir), setup=True)
        _RUNS[run_dir] = (ctx, method, prepared.config)
    torch.set_num_threads(threads)
    return _RUNS[run_dir]


def client_query(msg, context):
    """Tells the server which client (partition) this SuperNode is."""
    from flwr.app import ConfigRecord, Message, RecordDict

    reply = RecordDict({"node": ConfigRecord({"partition-id": int(context.node_config["partition-id"])})})
    return Message(reply, reply_to=msg)


def client_train(msg, context):
    """One client's round: decode the payload, run fedguide's run_client, encode the result."""
    job = msg.content["job"]
    client_id = int(job["client-id"])
    partition = int(context.node_config["partition-id"])
    if partition != client_id:
        raise RuntimeError(f"client {client_id}'s message reached the SuperNode of client {partition}")
    ctx, method, cfg = _run_context(str(job["run-dir"]), int(job["threads"]))
    return train_reply(msg, ctx, method, cfg)


def results_in_job_order(round_: int, client_ids: list[int], client_of_node: dict[int, int],
                         replies: list) -> list[ClientResult]:
    """The replies' ClientResults in the order of ``client_ids``; a reply with an error names its client."""
    done: dict[int, ClientResult] = {}
    for reply in replies:
        cid = client_of_node[reply.metadata.src_node_id]
        if reply.has_error():
            raise FlowerClientFailed(f"client {cid} failed in round {round_}:\n{error_reason(reply.error.reason)}")
        done[cid] = decode_result(reply.content)
    missing = [cid for cid in client_ids if cid not in done]
    if missing:
        raise FlowerClientFailed(f"clients {missing} sent no reply in round {round_}")
    return [done[cid] for cid in client_ids]


# ---- server side --------------------------------------------------------------------------------
class FlowerClients(Executor):
    def __init__(self, actors: int, threads: int, run_dir: Path, num_clients: int, gpus_per_client: float = 0.0):
        _import_flower()
        self.gpus_per_client = gpus_per_client
        self.run_dir = Path(run_dir).resolve()
        self.num_clients = num_clients
        self.actors, self.threads = actors, threads  # simulation.py: actors_and_threads
        self.workers = self.actors
        self.ray_pids: set[int] = set()  # every process Ray started, for close() and for tests
        self._tmp = Path(tempfile.mkdtemp(prefix="fedguide-flower-"))  # short: Ray's socket paths
        self._grid_box: "queue.Queue[Any]" = queue.Queue()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread: Optional[threading.Thread] = None
        self._ray_started = False
        self.grid = None
        self.nodes: dict[int, int] = {}  # client id -> node id
        self.startup_seconds: dict[str, float] = {}
        self._saved_home = os.environ.get("FLWR_HOME")
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import ray

        t0 = time.perf_counter()
        before = descendants(os.getpid())
        os.environ["FLWR_HOME"] = str(self._tmp / "flwr_home")  # Flower writes nothing outside the run
        gpus = {"num_gpus": torch.cuda.device_count()} if self.gpus_per_client > 0 else {}
        ray.init(num_cpus=self.actors, **gpus, include_dashboard=False, _temp_dir=str(self._tmp / "ray"),
                 logging_level="WARNING", log_to_driver=False, configure_logging=False)
        self._ray_started = True
        self.ray_pids = descendants(os.getpid()) - before
        t_ray = time.perf_counter()
        self._thread = threading.Thread(target=self._simulate, name="flower-simulation", daemon=True)
        self._thread.start()
        deadline = time.time() + START_TIMEOUT_S
        while self.grid is None:
            try:
                self.grid = self._grid_box.get(timeout=0.5)
            except queue.Empty:
                self._raise_if_failed("while starting")
                if time.time() > deadline:
                    raise FlowerRuntimeFailed(f"the Flower simulation did not start within {START_TIMEOUT_S} s")
        self.nodes = self._learn_nodes(deadline)
        self.ray_pids |= descendants(os.getpid()) - before  # the actors, started with the first messages
        t_nodes = time.perf_counter()
        self.startup_seconds = {"ray": t_ray - t0, "simulation": t_nodes - t_ray}

    def _simulate(self) -> None:
        from flwr.clientapp import ClientApp
        from flwr.serverapp import ServerApp
        from flwr.simulation import run_simulation

        server = ServerApp()

        @server.main()
        def _main(grid, context):
            self._grid_box.put(grid)
            self._stop.wait()  # the fedguide loop drives the grid until close()

        client = ClientApp()
        client.train()(client_train)
        client.query()(client_query)
        flwr_log = logging.getLogger("flwr")
        flwr_log.setLevel(logging.WARNING)
        if not any(isinstance(f, _DropDeprecation) for f in flwr_log.filters):
            flwr_log.addFilter(_DropDeprecation())
        try:
            run_simulation(server_app=server, client_app=client, num_supernodes=self.num_clients,
                           backend_config={"client_resources": {"num_cpus": 1,
                                                                "num_gpus": float(self.gpus_per_client)}})
        except BaseException as err:  # reported to the caller's thread
            self._errors.append(err)
        finally:
            self._stop.set()

    def _raise_if_failed(self, doing: str) -> None:
        if self._errors:
            err = self._errors[0]
            raise FlowerRuntimeFailed(f"the Flower simulation failed {doing}: {type(err).__name__}: {err}") from err
        if self._thread is not None and not self._thread.is_alive():
            raise FlowerRuntimeFailed(f"the Flower simulation ended {doing}")

    def _send(self, messages: list, doing: str) -> list:
        """Push the messages and pull until every reply is in. Not Grid.send_and_receive: that polls
        every 0.1 s (a tenth of a second added to every round) and waits forever if the simulation
        dies; here the poll interval starts at 1 ms and the simulation's liveness is checked."""
        self._raise_if_failed(doing)
        waiting = set(self.grid.push_messages(messages))
        if len(waiting) != len(messages):
            raise FlowerRuntimeFailed(f"Flower accepted {len(waiting)} of {len(messages)} messages {doing}")
        replies, pause = [], POLL_MIN_S
        while waiting:
            got = list(self.grid.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if waiting:
                self._raise_if_failed(doing)
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
        return replies

    def _learn_nodes(self, deadline: float) -> dict[int, int]:
        from flwr.app import Message, MessageType, RecordDict

        node_ids = []
        while len(node_ids) < self.num_clients:  # the SuperNodes register while the simulation starts
            node_ids = list(self.grid.get_node_ids())
            if time.time() > deadline:
                raise FlowerRuntimeFailed(f"{len(node_ids)} of {self.num_clients} Flower SuperNodes registered "
                                   f"within {START_TIMEOUT_S} s")
            if len(node_ids) < self.num_clients:
                time.sleep(0.1)
        messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
        nodes: dict[int, int] = {}
        for reply in self._send(messages, "while asking the SuperNodes for their partition ids"):
            if reply.has_error():
                raise FlowerRuntimeFailed(f"SuperNode {reply.metadata.src_node_id} failed to answer: "
                                   f"{error_reason(reply.error.reason)}")
            nodes[int(reply.content["node"]["partition-id"])] = reply.metadata.src_node_id
        if sorted(nodes) != list(range(self.num_clients)):
            raise FlowerRuntimeFailed(f"the SuperNodes' partition ids {sorted(nodes)} are not 0..{self.num_clients - 1}")
        return nodes

    def run_round(self, round_: int, jobs: list[tuple[int, Record]], global_weights: torch.Tensor) -> list[ClientResult]:
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        messages, client_of = [], {}
        for cid, payload in jobs:
            arrays, scalars = encode(payload)
            job = ConfigRecord({"client-id": int(cid), "round": int(round_), "run-dir": str(self.run_dir),
                                "threads": int(self.threads)})
            content = RecordDict({"job": job, "payload-arrays": arrays, "payload-scalars": scalars})
            messages.append(Message(content, dst_node_id=self.nodes[cid], message_type=MessageType.TRAIN))
            client_of[self.nodes[cid]] = cid
        return results_in_job_order(round_, [cid for cid, _ in jobs], client_of,
                                    self._send(messages, f"in round {round_}"))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)
            self._thread = None
        if self._ray_started:
            import ray

            self.ray_pids |= self._new_ray_children()
            ray.shutdown()
            self._ray_started = False
        stop_processes({p for p in self.ray_pids if _alive(p)})
        if self._saved_home is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = self._saved_home
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _new_ray_children(self) -> set[int]:
        # Processes started under the ones Ray started (actors start when the first messages arrive).
        found: set[int] = set()
        for pid in list(self.ray_pids):
            found |= descendants(pid)
        return found
