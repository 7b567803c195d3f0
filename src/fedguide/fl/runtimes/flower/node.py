"""The client side of a Flower deployment (``runtime.name: flower``): what ``fedguide client`` runs.

One client = one Flower SuperNode (``flower-supernode``, connected to the server's SuperLink) and the
process that trains. Its ClientApp answers train messages with fedguide's own ``run_client`` on a
run context built from the client's own copy of the config, so every method runs unchanged; its
state stays on the client's disk (``<client dir>/runs/<run key>/client_state``), never on the server.

Two ways to run the ClientApp (``runtime.client_process``):
- ``long-lived`` (default): the SuperNode runs with ``--isolation process`` and this process takes
  its tasks from the SuperNode's Runtime API (as Flower's ``flower-superexec`` does) and runs them
  in-process: torch, the data and the run context are loaded once, a message costs milliseconds.
- ``per-message``: Flower's own way (``--isolation subprocess``): the SuperNode starts a fresh
  ``flwr-clientapp`` process per message, which imports torch and rebuilds the run context from
  the data every time (seconds per message; kept for comparison and for Flower versions whose
  Runtime API differs).

Decisions:
- The long-lived executor uses Flower 1.42's Runtime API the way ``flwr-clientapp`` does
  (AcquireTask, PullTaskInput, PushMessages, PushTaskOutput, task heartbeats), with its own retry
  policy: Flower's default one answers an expired token by sending SIGINT to its own process.
- The data is loaded (and the partition derived) when ``fedguide client`` starts, so a client whose
  machine lacks the data fails at once rather than in round 1. Every client machine holds the
  whole dataset and derives its own share with the run's seed, as the local runtime does.
- A client serves run after run (a SuperNode outlives a run); its run context is rebuilt when a
  message of another run arrives, one run at a time per process.
- The ClientApp finds the client's config and folder in the SuperNode's node config
  (``fedguide-config``, ``fedguide-dir``, beside Flower's ``partition-id``/``num-partitions``),
  written as a TOML file so any path survives.
- Security: with ``runtime.tls.ca`` the SuperNode connects over TLS (``--root-certificates``),
  else plain HTTP (``--insecure``), which a SuperLink beyond loopback needs ``--insecure`` for;
  with ``runtime.auth.private_key`` it proves that key to the SuperLink
  (``--auth-supernode-private-key``). The SuperNode's own Runtime API, which this process polls, stays
  plain HTTP on 127.0.0.1 (Flower's default; nothing leaves the machine).
- A SuperLink that refuses the SuperNode's key (not registered there, Flower's error 2004) may not
  have registered it yet (``fedguide serve`` registers its allow-list right after the SuperLink
  starts), so the client retries for ``runtime.connect_timeout`` seconds, then stops with the
  refusal named; a SuperLink that requires a key this client lacks (error 2001), or a certificate
  that does not verify against ``runtime.tls.ca``, stops it at once.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fedguide.config import Config, load_config, to_yaml
from fedguide.core.atomic import write_text
from fedguide.core.state import ClientStateStore
from fedguide.fl.runtime import DEFAULT_THREADS
from fedguide.fl.runtimes.flower.messages import FlowerRuntimeFailed, train_reply
from fedguide.fl.runtimes.flower.processes import (FLOWER_ENV, flower_command, flower_env, free_port, log_tail, start,
                                                   stop_tree)
from fedguide.fl.runtimes.flower.protocol import APP_NAME, APP_PUBLISHER, comparable, fingerprint
from fedguide.fl.runtimes.flower.records import encode
from fedguide.fl.runtimes.flower.security import Security, check_connection
from fedguide.fl.setup import open_run, prepare
from fedguide.registry import ConfigError

POLL_MIN_S, POLL_MAX_S = 0.01, 0.2  # asking the SuperNode for a task: quick after a task, then backing off
RUNTIME_RETRY_S = 20  # transport errors to the local SuperNode are retried this long
RESTART_MIN_UPTIME_S = 10  # a SuperNode that stops sooner is failing, not being replaced
REFUSED_RETRY_S = 2  # pause before a refused SuperNode tries again
NOT_REGISTERED = "[code: 2004]"  # Flower 1.42's FLEET_NODE_ACTIVATION_FAILED: this key is not registered
KEY_REQUIRED = "[code: 2001]"  # FLEET_SUPERNODE_REGISTRATION_DISABLED: the SuperLink admits registered keys only
CONNECT_FAILED = "Failed to initialize the connection to the SuperLink."  # Flower's exit code 305
CERTIFICATE_FAILED = "CERTIFICATE_VERIFY_FAILED"  # the SuperLink's certificate does not verify against the CA


class ClientNode:
    """One client's experiment: its config, data share and, per run, its run context."""

    def __init__(self, config_path: Path, partition_id: int, folder: Path):
        self.prepared = prepare(load_config(Path(config_path)))
        self.cfg: Config = self.prepared.config
        self.partition_id = partition_id
        self.folder = Path(folder)
        self.fingerprint = fingerprint(self.cfg)
        self.threads = self.prepared.resolved.runtime.params.threads_per_worker or DEFAULT_THREADS
        self._run: Optional[tuple[str, Any, Any]] = None  # (run key, ctx, method)

    def run_folder(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"run key {key!r} is not a folder name")
        return self.folder / "runs" / key

    def store(self, key: str) -> ClientStateStore:
        return ClientStateStore(self.run_folder(key) / "client_state")

    def run_context(self, key: str):
        torch.set_num_threads(self.threads)
        if self._run is None or self._run[0] != key:
            self._run = None  # one run's model and method at a time
            ctx, method = open_run(self.prepared, self.run_folder(key), setup=True)
            self._run = (key, ctx, method)
        return self._run[1], self._run[2]

    def check(self, job) -> int:
        """The client id of a message meant for this client and this experiment."""
        client_id = int(job["client-id"])
        if client_id != self.partition_id:
            raise RuntimeError(f"client {client_id}'s message reached the client with partition id {self.partition_id}")
        if str(job["fingerprint"]) != self.fingerprint:
            raise RuntimeError(f"client {client_id} holds another config than the server's (fingerprint "
                               f"{self.fingerprint} vs {job['fingerprint']}); restart it with the server's config")
        return client_id


_NODES: dict[tuple[str, int, str], ClientNode] = {}  # (config, partition id, folder) -> node; one per process


def node_of(context) -> ClientNode:
    nc = context.node_config
    for key in ("fedguide-config", "fedguide-dir", "partition-id"):
        if key not in nc:
            raise RuntimeError(f"this SuperNode's node config lacks {key!r}; start it with 'fedguide client'")
    key = (str(nc["fedguide-config"]), int(nc["partition-id"]), str(nc["fedguide-dir"]))
    if key not in _NODES:
        _NODES[key] = ClientNode(Path(key[0]), key[1], Path(key[2]))
    return _NODES[key]


def settle(store: ClientStateStore, settled: int, keep: Optional[int] = None) -> None:
    """Commit the pending state of rounds up to ``settled`` (aggregated and checkpointed by the
    server); drop every other pending round (a late reply, a round re-run after a resume), except
    ``keep``, the round in progress."""
    for pending in sorted(store.root.glob("pending-*"), key=lambda p: int(p.name.split("-")[1])):
        round_ = int(pending.name.split("-")[1])
        if round_ <= settled:
            store.commit(round_)
        elif round_ != keep:
            shutil.rmtree(pending)


def client_train(msg, context):
    node = node_of(context)
    job = msg.content["job"]
    node.check(job)
    ctx, method = node.run_context(str(job["run-key"]))
    settle(ctx.store, int(job["settled-round"]))
    return train_reply(msg, ctx, method, node.cfg)


def client_query(msg, context):
    from flwr.app import ConfigRecord, Message, RecordDict

    node = node_of(context)
    ask = msg.content["fedguide"]
    kind = str(ask["kind"])
    reply: dict[str, Any] = {}
    if kind == "hello":
        reply["fedguide"] = ConfigRecord({"partition-id": node.partition_id, "fingerprint": node.fingerprint,
                                          "config": json.dumps(comparable(node.cfg), sort_keys=True)})
    elif kind in ("state", "finish"):
        client_id = node.check(ask)
        store = node.store(str(ask["run-key"]))
        in_progress = int(ask["round"]) if kind == "state" else None
        settle(store, int(ask["settled-round"]), keep=in_progress)
        reply["fedguide"] = ConfigRecord({"client-id": client_id})
        if kind == "state":
            state = store.get(client_id, in_progress)
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            arrays, _ = encode(tensors)
            reply["state-arrays"] = arrays
            reply["state-json"] = ConfigRecord(
                {"json": json.dumps({k: v for k, v in state.items() if not isinstance(v, torch.Tensor)})})
    else:
        raise ValueError(f"unknown fedguide query {kind!r}")
    return Message(RecordDict(reply), reply_to=msg)


@functools.cache
def flower_client_app():
    """The ClientApp of fedguide's clients, built once per process; _client_app.py names it for Flower."""
    for key, value in FLOWER_ENV.items():
        os.environ.setdefault(key, value)
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.train()(client_train)
    app.query()(client_query)
    return app


# ---- the long-lived executor --------------------------------------------------------------------
def _retry(alive: Optional[Callable[[], bool]] = None):
    """Transport errors to the local SuperNode retried for RUNTIME_RETRY_S, but not once its process has exited
    (``alive`` False): its port is gone for good, and waiting out the retries held a client that a SuperLink
    had refused (or whose SuperNode stopped) for the whole RUNTIME_RETRY_S before it could say so or replace it."""
    import httpx
    from flwr.supercore.retry import RetryInvoker, exponential

    return RetryInvoker(lambda: exponential(base_delay=0.2, max_delay=2), httpx.TransportError,
                        max_tries=None, max_time=RUNTIME_RETRY_S, jitter=None,
                        should_giveup=None if alive is None else (lambda err: not alive()))


def _runtime_client(address: str, token: Optional[str] = None, alive: Optional[Callable[[], bool]] = None):
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp" if token else "SuperExec")]
    if token:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors, retry_invoker=_retry(alive))


def _heartbeat(client) -> Callable[[], bool]:
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=no-name-in-module

    def beat() -> bool:
        try:
            return bool(client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success)
        except httpx.HTTPError:
            return False
    return beat


def answer(message, context):
    """The ClientApp's reply to ``message``, or an error reply naming the exception (as Flower's
    flwr-clientapp sends), so the server can name the failing client."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    try:
        return flower_client_app()(message=message, context=context), ""
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
        print(f"{message.metadata.message_type} message failed: {reason}\n{traceback.format_exc()}", flush=True)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message), reason


def pull_task(client):
    """(message, context, run) of the task ``client``'s token names.

    As Flower's flwr-clientapp pulls them, except how long it waits for the message's objects: the
    SuperNode hands a task over before it has fetched the message's objects from the SuperLink, and
    Flower waits 1 s (then 2, 4, ...) for a missing object; here 20 ms, doubling up to 0.5 s.
    """
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=no-name-in-module
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (make_confirm_message_received_fn_protobuf,
                                                                     make_pull_object_fn_protobuf)
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    task = client.PullTaskInput(PullTaskInputRequest())
    # Messages built in this process (the reply) take their run and task from here.
    TaskIdentity.task_id, TaskIdentity.run_id = task.task_id, task.run.run_id
    TaskIdentity.node_id = task.context.node_id
    context, run = context_from_proto(task.context), run_from_proto(task.run)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode handed over a task without its message")
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.02, backoff_cap=0.5)
    message.metadata.__dict__["_message_id"] = tree.object_id  # the id is not part of the pulled content
    return message, context, run


def run_task(address: str, token: str, alive: Optional[Callable[[], bool]] = None) -> str:
    """Run one task (one message) the SuperNode handed over; returns its message type. ``alive``: whether the
    SuperNode's process still runs (no retries once it has exited)."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    client = _runtime_client(address, token, alive)
    heartbeat = HeartbeatSender(_heartbeat(client))
    heartbeat.start()
    context, status, details, kind = None, SubStatus.FAILED, "the task did not finish", "?"
    try:
        message, context, run = pull_task(client)
        kind = message.metadata.message_type
        if run.fab_id != f"{APP_PUBLISHER}/{APP_NAME}":
            details = f"this SuperNode runs fedguide runs only, not the Flower app {run.fab_id!r}"
            reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=details), reply_to=message)
        else:
            reply, details = answer(message, context)
            status = SubStatus.FAILED if details else SubStatus.COMPLETED
        push_message(client, reply, context)
    finally:
        try:
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()
    return kind


def serve_tasks(address: str, supernode, log: Callable[[str], None], stop: Optional[threading.Event] = None) -> None:
    """Take the SuperNode's tasks and run them here until ``stop`` is set or the SuperNode exits."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.constant import TaskType

    def alive() -> bool:
        return supernode.poll() is None

    acquire = _runtime_client(address, alive=alive)
    pause = POLL_MIN_S
    try:
        while stop is None or not stop.is_set():
            if supernode.poll() is not None:
                return
            try:
                res = acquire.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP],
                                                             agentapp_fab_hashes=[]))
            except httpx.HTTPError:
                if supernode.poll() is not None:
                    return
                raise
            if res.HasField("task") and res.token:
                t0 = time.perf_counter()
                try:
                    kind = run_task(address, res.token, alive)
                    log(f"{kind} message answered in {time.perf_counter() - t0:.2f} s")
                except Exception as err:  # e.g. the SuperNode went away mid-task; the server times it out
                    log(f"a message could not be answered: {type(err).__name__}: {err}")
                pause = POLL_MIN_S
            else:
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
    finally:
        acquire.close()


# ---- `fedguide client` ----------------------------------------------------------------------------
def node_config_toml(values: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(values)


def run_client_node(cfg: Config, partition_id: int, folder: Path, superlink: Optional[str] = None,
                    log: Callable[[str], None] = print, insecure: bool = False) -> None:
    """Start this machine's SuperNode for client ``partition_id`` and serve it until interrupted; a
    SuperNode that stops is replaced. Raises FlowerRuntimeFailed when one stops right after starting,
    or when the SuperLink refuses this client for ``runtime.connect_timeout`` seconds.
    """
    from fedguide.fl.runtimes.flower.deployment import flower_params

    if not 0 <= partition_id < cfg.clients.num:
        raise ConfigError(f"--partition-id {partition_id} is outside 0..{cfg.clients.num - 1} "
                          f"(clients.num is {cfg.clients.num})")
    params = flower_params(cfg)
    address = superlink or cfg.runtime.superlink
    check_connection(address, params.tls, insecure)
    security = Security(params.tls.ca if params.tls else None, params.auth.private_key if params.auth else None)
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.yaml"
    write_text(config_path, to_yaml(cfg))
    node_config = folder / "node-config.toml"
    write_text(node_config, node_config_toml({"partition-id": partition_id, "num-partitions": cfg.clients.num,
                                              "fedguide-config": str(config_path), "fedguide-dir": str(folder)}))
    long_lived = cfg.runtime.client_process == "long-lived"
    if long_lived:  # the data is loaded now: a machine without it fails before connecting
        _NODES[(str(config_path), partition_id, str(folder))] = ClientNode(config_path, partition_id, folder)
    log_path = folder / "supernode.log"
    log(f"client {partition_id} of {cfg.clients.num}: SuperNode connecting to {address} "
        f"({'TLS' if security.ca else 'plain HTTP'}{', authenticated' if security.private_key else ''}; "
        f"{'long-lived' if long_lived else 'per-message'} ClientApp; log {log_path})")
    restore = _stop_on_sigterm()
    refused_since: Optional[float] = None
    try:
        while True:
            started = time.time()
            offset = log_path.stat().st_size if log_path.exists() else 0
            code = _run_supernode(address, node_config, folder, long_lived, log, security)
            said = _read_from(log_path, offset)  # a refusal ends a SuperNode however long it tried to connect
            if KEY_REQUIRED in said:
                raise FlowerRuntimeFailed(
                    f"the SuperLink {address} admits registered SuperNodes only: set runtime.auth.private_key to "
                    f"this client's key, and have the server list its public key in runtime.auth.public_keys")
            if NOT_REGISTERED in said:
                first = refused_since is None
                refused_since = refused_since or time.time()
                waited = time.time() - refused_since
                if waited > params.connect_timeout:
                    raise FlowerRuntimeFailed(
                        f"the SuperLink {address} refused client {partition_id}'s SuperNode for {waited:.0f} s "
                        f"(runtime.connect_timeout={params.connect_timeout:g}): its key "
                        f"{security.private_key or '(none)'} is not registered there; the server's "
                        "runtime.auth.public_keys must list its public key")
                if first:
                    log(f"the SuperLink refused this SuperNode's key (not registered there yet?); retrying for "
                        f"up to runtime.connect_timeout={params.connect_timeout:g} s")
                time.sleep(REFUSED_RETRY_S)
                continue
            refused_since = None
            if CERTIFICATE_FAILED in said:
                raise FlowerRuntimeFailed(
                    f"the TLS connection to the SuperLink {address} failed: {_reason(said)} (runtime.tls.ca must be "
                    "the CA that signed the SuperLink's certificate, and the certificate must name the address "
                    "connected to)")
            if time.time() - started >= RESTART_MIN_UPTIME_S:
                # A SuperNode ends itself when its SuperLink restarts (a new `fedguide serve`): it is not
                # registered there. A fresh one registers, so the client serves the next run too.
                log(f"the SuperNode stopped (exit code {code}); starting a new one")
                continue
            raise FlowerRuntimeFailed(f"the SuperNode of client {partition_id} stopped (exit code {code}) "
                                      f"right after it started; last lines of {log_path}:\n{log_tail(log_path)}")
    finally:
        restore()


def _reason(said: str) -> str:
    """The line after Flower's 'Failed to initialize the connection' in a SuperNode's log."""
    lines = said.splitlines()
    for i, line in enumerate(lines[:-1]):
        if CONNECT_FAILED in line:
            return lines[i + 1].strip()
    return "see its log"


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _run_supernode(address: str, node_config: Path, folder: Path, long_lived: bool,
                   log: Callable[[str], None], security: Optional[Security] = None) -> Optional[int]:
    """Run one SuperNode (and, long-lived, its tasks here) until it exits; its exit code."""
    runtime_port = free_port()
    args = [flower_command("flower-supernode"), *(security or Security()).args(), "--superlink", address,
            "--host", "127.0.0.1", "--port", str(runtime_port), "--node-config", str(node_config),
            "--isolation", "process" if long_lived else "subprocess"]
    supernode = start(args, flower_env(folder / "flwr_home"), folder / "supernode.log")
    try:
        if long_lived:
            serve_tasks(f"127.0.0.1:{runtime_port}", supernode, log)
        while supernode.poll() is None:
            time.sleep(0.5)
        return supernode.returncode
    finally:
        stop_tree(supernode)


def _stop_on_sigterm() -> Callable[[], None]:
    # SIGTERM would end the process without running `finally`; as an exception it stops the SuperNode.
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)
