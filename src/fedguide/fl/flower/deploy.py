"""The server side of a Flower deployment (``runtime.name: flower``): what ``fedguide serve`` runs.

``fedguide serve CONFIG`` writes a Flower app into ``<run dir>/flower/app`` (a pyproject.toml whose
ServerApp and ClientApp are fedguide's and whose run config names the run directory), starts
``flower-superlink`` (one HTTP port for SuperNodes, the ``flwr`` command and the ServerApp) and
submits the app with ``flwr run``. The SuperLink starts the ServerApp in a process of its own; that
ServerApp runs fedguide's round loop (``DeployedExperiment``) and writes the run directory exactly as
a local run does (config.yaml, partition.json, metrics.jsonl, checkpoints, model.safetensors,
summary.json). ``serve`` prints the ServerApp's log lines as they come and stops the SuperLink, and
every process under it, by their ids when the run ends, fails or is interrupted.

``DeployedClients`` is the client executor over the deployment's Grid, like sim.py's FlowerClients:
one train message per sampled client to the SuperNode whose partition-id is that client's id.

Decisions:
- Before round 1 the server waits (``runtime.connect_timeout``) until one SuperNode per client has
  said which partition it is and shown the same experiment config (protocol.py); a mismatch stops
  the run with the differing keys named.
- A client fails in a round when its reply carries an error, when Flower reports its SuperNode
  gone (its heartbeats stopped: about a minute after a crash), or when ``runtime.round_timeout``
  passes. The round counts when at least ``runtime.min_clients`` of its sampled clients replied
  (default: all of them); failed clients are left out of aggregation and recorded per round in
  metrics.jsonl (``failed_clients``, ``client_errors``) and in summary.json (``client_failures``).
  A failed client is not asked again in this run (so no round waits twice for a dead machine, and
  a slow one does not pile up stale work); resuming the run asks every client again.
- Client state stays on the clients. The server's ``ctx.store`` becomes ``ClientStatesOnClients``:
  its commits are messages' "settled-round" (protocol.py), and a server-side read (``local`` and
  personal-model FedProto evaluate every client's own model) fetches all reachable clients' state
  of the round with one batch of state queries, kept until the round commits.
- Replies are polled from the SuperLink at 10 ms, backing off to 100 ms (Grid.send_and_receive
  polls every 3 s).
- The SuperLink and the clients run without TLS (``--insecure``): fine on localhost or a trusted
  network; see README "Running on several machines".
"""
from __future__ import annotations

import json
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import fedguide
from fedguide.config import Config, load_config, to_yaml
from fedguide.fl.atomic import write_json, write_text
from fedguide.fl.checkpoint import load_checkpoint
from fedguide.fl.client_step import ClientResult
from fedguide.fl.engine import Experiment, load_run_config, prepare
from fedguide.fl.flower.messages import FlowerClientFailed, FlowerRuntimeFailed, decode_result, error_reason
from fedguide.fl.flower.processes import (command_line, descendants, flower_command, flower_env, log_tail,
                                          port_open, start, stop_tree)
from fedguide.fl.flower.protocol import APP_NAME, APP_PUBLISHER, comparable, differences, fingerprint, run_key
from fedguide.fl.flower.records import decode, encode
from fedguide.methods.base import Record
from fedguide.registry import ConfigError

POLL_MIN_S, POLL_MAX_S = 0.01, 0.1
START_TIMEOUT_S = 300  # the SuperLink up, the ServerApp process started; a busy machine takes a while
FINISH_TIMEOUT_S = 60  # the clients' last commit after the final round
SUBMIT_TIMEOUT_S = 120
CONNECTION = "fedguide"  # the SuperLink connection's name in the run's FLWR_HOME/config.toml


# ---- the client executor ------------------------------------------------------------------------
class DeployedClients:
    def __init__(self, grid, cfg: Config, run_dir: Path, num_clients: int, log: Callable[[str], None]):
        self.grid = grid
        self.runtime = cfg.runtime
        self.fingerprint = fingerprint(cfg)
        self.config = comparable(cfg)
        self.run_key = run_key(run_dir)
        self.num_clients = num_clients
        self.log = log
        self.nodes: dict[int, int] = {}  # client id -> node id
        self.lost: dict[int, str] = {}  # client id -> why it is no longer asked
        self.failures: dict[int, dict[int, str]] = {}  # round -> client id -> reason
        self.accepted: dict[int, list[int]] = {}  # client id -> rounds whose upload was aggregated
        self._states: tuple[Optional[int], dict[int, Any]] = (None, {})

    # -- bookkeeping -----------------------------------------------------------------------------
    def restore(self, metrics: list[dict]) -> None:
        """The accepted rounds of a resumed run, from its checkpointed metrics."""
        for m in metrics:
            failed = set(m.get("failed_clients", []))
            for cid in m["clients"]:
                if cid not in failed:
                    self.accepted.setdefault(int(cid), []).append(int(m["round"]))

    def settled(self, client_id: int, before: Optional[int] = None) -> int:
        """The last round before ``before`` whose upload of this client was aggregated (0: none)."""
        rounds = [r for r in self.accepted.get(client_id, []) if before is None or r < before]
        return max(rounds, default=0)

    def _message(self, client_id: int, content: dict, kind):
        from flwr.app import Message, RecordDict

        return Message(RecordDict(content), dst_node_id=self.nodes[client_id], message_type=kind)

    def _exchange(self, messages: list, deadline: Optional[float]) -> tuple[dict[int, Any], set[int]]:
        """Push the messages; pull replies until all are in or ``deadline`` passes. Returns
        (message index -> reply, indices the SuperLink refused)."""
        ids = list(self.grid.push_messages(messages)) if messages else []
        ids += [None] * (len(messages) - len(ids))
        waiting = {mid: i for i, mid in enumerate(ids) if mid}
        refused = {i for i, mid in enumerate(ids) if not mid}
        replies: dict[int, Any] = {}
        pause = POLL_MIN_S
        while waiting:
            for reply in self.grid.pull_messages(list(waiting)):
                i = waiting.pop(reply.metadata.reply_to_message_id, None)
                if i is not None:
                    replies[i] = reply
            if waiting:
                if deadline is not None and time.time() > deadline:
                    break
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
        return replies, refused

    def _deadline(self) -> Optional[float]:
        return time.time() + self.runtime.round_timeout if self.runtime.round_timeout else None

    def _why(self, reply, refused: bool) -> str:
        if refused:
            return "the SuperLink did not accept the message (SuperNode gone)"
        if reply is None:
            return f"no reply within runtime.round_timeout={self.runtime.round_timeout:g} s"
        return error_reason(reply.error.reason)

    # -- start: which SuperNode is which client -----------------------------------------------------
    def connect(self) -> None:
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        timeout = self.runtime.connect_timeout
        deadline = time.time() + timeout
        asked: dict[str, int] = {}  # hello message id -> node id
        seen: set[int] = set()
        reported = None
        while len(self.nodes) < self.num_clients:
            new = [n for n in self.grid.get_node_ids() if n not in seen]
            if new:
                hello = [Message(RecordDict({"fedguide": ConfigRecord({"kind": "hello"})}), dst_node_id=n,
                                 message_type=MessageType.QUERY) for n in new]
                for node, mid in zip(new, self.grid.push_messages(hello)):
                    if mid:
                        asked[mid] = node
                seen.update(new)
            for reply in (self.grid.pull_messages(list(asked)) if asked else []):
                node = asked.pop(reply.metadata.reply_to_message_id, None)
                if node is not None:
                    self._greet(node, reply)
            missing = [c for c in range(self.num_clients) if c not in self.nodes]
            if missing != reported:
                self.log(f"clients connected: {self.num_clients - len(missing)} of {self.num_clients}"
                         + (f" (waiting for {missing})" if missing else ""))
                reported = missing
            if missing and time.time() > deadline:
                raise FlowerRuntimeFailed(
                    f"clients {missing} did not connect within runtime.connect_timeout={timeout:g} s; start "
                    "each with: fedguide client --partition-id I CONFIG (the server's config)")
            if missing:
                time.sleep(0.2)

    def _greet(self, node: int, reply) -> None:
        if reply.has_error():
            self.log(f"SuperNode {node} is not a fedguide client, ignored: {error_reason(reply.error.reason)}")
            return
        hello = reply.content["fedguide"]
        cid = int(hello["partition-id"])
        if str(hello["fingerprint"]) != self.fingerprint:
            diff = differences(self.config, json.loads(str(hello["config"])))
            raise ConfigError(f"client {cid} holds another experiment config than the server:\n  "
                              + "\n  ".join(diff) + "\nstart every client with the server's config")
        if cid >= self.num_clients:
            self.log(f"client {cid} is not part of this run ({self.num_clients} clients), ignored")
        elif cid in self.nodes and self.nodes[cid] != node:
            raise ConfigError(f"two SuperNodes ({self.nodes[cid]} and {node}) say they are client {cid}; "
                              "start each 'fedguide client' with its own --partition-id")
        else:
            self.nodes[cid] = node

    # -- rounds --------------------------------------------------------------------------------------
    def run_round(self, round_: int, jobs: list[tuple[int, Record]], global_weights: torch.Tensor) -> list[ClientResult]:
        from flwr.app import ConfigRecord, MessageType

        failed: dict[int, str] = {cid: f"failed earlier in this run ({self.lost[cid]})" for cid, _ in jobs if cid in self.lost}
        live = [(cid, payload) for cid, payload in jobs if cid not in self.lost]
        messages = []
        for cid, payload in live:
            arrays, scalars = encode(payload)
            job = ConfigRecord({"client-id": int(cid), "round": int(round_), "run-key": self.run_key,
                                "fingerprint": self.fingerprint, "settled-round": self.settled(cid, round_)})
            messages.append(self._message(cid, {"job": job, "payload-arrays": arrays, "payload-scalars": scalars},
                                          MessageType.TRAIN))
        replies, refused = self._exchange(messages, self._deadline())
        results: dict[int, ClientResult] = {}
        for i, (cid, _) in enumerate(live):
            reply = replies.get(i)
            if reply is None or reply.has_error():
                failed[cid] = self._why(reply, i in refused)
            else:
                results[cid] = decode_result(reply.content)
        self._record(round_, failed)
        need = len(jobs) if self.runtime.min_clients is None else min(self.runtime.min_clients, len(jobs))
        if len(results) < need:
            lines = "\n".join(f"client {cid}: {why}" for cid, why in sorted(failed.items()))
            if self.runtime.min_clients is None and len(failed) == 1:
                (cid, why), = failed.items()
                raise FlowerClientFailed(f"client {cid} failed in round {round_}:\n{why}")
            rule = ("runtime.min_clients" if self.runtime.min_clients is not None else
                    "every sampled client; set runtime.min_clients to go on with fewer")
            raise FlowerClientFailed(f"round {round_}: {len(results)} of {len(jobs)} clients replied, "
                                     f"{need} needed ({rule}):\n{lines}")
        for cid in results:
            self.accepted.setdefault(cid, []).append(round_)
        return [results[cid] for cid, _ in jobs if cid in results]

    def _record(self, round_: int, failed: dict[int, str]) -> None:
        self.failures[round_] = dict(sorted(failed.items()))
        for cid, why in failed.items():
            if cid not in self.lost:
                self.lost[cid] = f"round {round_}: {why}"
                self.log(f"round {round_}: client {cid} failed: {why}")

    # -- client state, read where it lives ------------------------------------------------------------
    def client_state(self, client_id: int, round_: int) -> dict[str, Any]:
        if self._states[0] != round_:
            self._states = (round_, self._fetch_states(round_))
        states = self._states[1]
        if client_id not in states:
            why = self.lost.get(client_id, "it did not answer")
            raise FlowerClientFailed(f"round {round_}: the method reads client {client_id}'s state on the server, "
                                     f"but the client cannot be reached ({why})")
        return states[client_id]

    def _fetch_states(self, round_: int) -> dict[int, Any]:
        from flwr.app import ConfigRecord, MessageType

        cids = [c for c in range(self.num_clients) if c not in self.lost]
        messages = [self._message(c, {"fedguide": ConfigRecord(
            {"kind": "state", "client-id": c, "round": round_, "run-key": self.run_key,
             "fingerprint": self.fingerprint, "settled-round": self.settled(c, round_)})}, MessageType.QUERY)
            for c in cids]
        replies, refused = self._exchange(messages, self._deadline())
        states: dict[int, Any] = {}
        for i, cid in enumerate(cids):
            reply = replies.get(i)
            if reply is None or reply.has_error():
                self.lost[cid] = f"round {round_}: {self._why(reply, i in refused)}"
                continue
            state = json.loads(str(reply.content["state-json"]["json"]))
            state.update(decode(reply.content["state-arrays"], {}))
            states[cid] = state
        return states

    def forget_states(self) -> None:
        self._states = (None, {})

    def finish(self) -> None:
        """Tell every reachable client the run is complete, so it commits its accepted rounds' state."""
        from flwr.app import ConfigRecord, MessageType

        cids = [c for c in sorted(self.nodes) if c not in self.lost]
        messages = [self._message(c, {"fedguide": ConfigRecord(
            {"kind": "finish", "client-id": c, "run-key": self.run_key, "fingerprint": self.fingerprint,
             "settled-round": self.settled(c)})}, MessageType.QUERY) for c in cids]
        replies, refused = self._exchange(messages, time.time() + FINISH_TIMEOUT_S)
        for i, cid in enumerate(cids):
            reply = replies.get(i)
            if reply is None or reply.has_error():
                self.log(f"client {cid} did not confirm the end of the run ({self._why(reply, i in refused)}); "
                         "its last round's state stays pending on its disk")

    def close(self) -> None:
        pass  # the SuperLink and the SuperNodes outlive the run; `serve` stops its own processes


class ClientStatesOnClients:
    """The server's ``ctx.store`` in a deployment: client state is read from the clients, never kept."""

    def __init__(self, clients: DeployedClients):
        self.clients = clients

    def get(self, client_id: int, round_: Optional[int] = None) -> dict[str, Any]:
        if round_ is None:
            raise RuntimeError("deployed client state is read per round: pass the round")
        return self.clients.client_state(client_id, round_)

    def put(self, client_id: int, round_: int, state) -> None:
        raise RuntimeError("client state is written by the clients, on their own machines")

    def commit(self, round_: int) -> None:
        self.clients.forget_states()  # the clients commit on their side (settled-round)

    def recover(self, checkpoint_round: int) -> None:
        pass  # likewise: the next message to each client settles its pending state

    def disk_bytes(self) -> int:
        return 0


class DeployedExperiment(Experiment):
    """fedguide's round loop with the clients on SuperNodes of a Flower deployment."""

    def __init__(self, prepared, run_dir: Path, grid, log: Callable[[str], None] = print):
        super().__init__(prepared, run_dir, log=log)
        self.clients = DeployedClients(grid, prepared.config, self.run_dir, prepared.data.num_clients, log)

    def build_context(self):
        ctx, method = super().build_context()
        for folder in (self.run_dir / "client_state" / "committed", self.run_dir / "client_state"):
            try:
                folder.rmdir()  # made empty by the base; client state lives on the clients
            except OSError:
                pass
        ctx.store = ClientStatesOnClients(self.clients)  # methods hold ctx itself, so they see this
        return ctx, method

    def run(self, resume: bool = False) -> dict[str, Any]:
        if resume:
            ckpt = load_checkpoint(self.run_dir / "checkpoints")
            if ckpt is not None:
                self.clients.restore(ckpt.metrics)
        self.clients.connect()
        return super().run(resume=resume)

    def make_clients(self, ctx, method, workers):
        return self.clients

    def _round(self, r, ctx, method, clients, global_w):
        global_w, m = super()._round(r, ctx, method, clients, global_w)
        errors = self.clients.failures.get(r, {})
        m["failed_clients"] = sorted(errors)
        m["client_errors"] = {str(cid): why for cid, why in sorted(errors.items())}
        return global_w, m

    def _finish(self, ctx, global_w, metrics, wall):
        self.clients.finish()
        self.workers = len(self.clients.nodes)  # processes that trained clients: one per SuperNode
        summary = super()._finish(ctx, global_w, metrics, wall)
        summary["runtime"] = "flower"
        summary["client_failures"] = [{"round": m["round"], "client": int(cid), "reason": why}
                                      for m in metrics for cid, why in m.get("client_errors", {}).items()]
        write_json(self.run_dir / "summary.json", summary)
        return summary


# ---- the ServerApp ----------------------------------------------------------------------------------
def _appender(path: Path) -> Callable[[str], None]:
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    return log


def server_main(grid, context) -> None:
    run_dir = Path(str(context.run_config["run-dir"]))
    resume = bool(context.run_config["resume"])
    flower_dir = run_dir / "flower"
    log = _appender(flower_dir / "server.log")
    outcome: dict[str, Any] = {"status": "failed", "error": "the ServerApp stopped before the run began"}
    try:
        cfg = load_run_config(run_dir) if resume else load_config(flower_dir / "requested-config.yaml")
        summary = DeployedExperiment(prepare(cfg), run_dir, grid, log).run(resume=resume)
        outcome = {"status": "completed", "final_accuracy": summary["final_accuracy"]}
    except BaseException as err:
        outcome = {"status": "failed", "error": str(err), "type": type(err).__name__,
                   "config_error": isinstance(err, ConfigError),
                   "resumable": (run_dir / "config.yaml").is_file()}
        log(f"error: {type(err).__name__}: {err}")
        _appender(flower_dir / "server-traceback.log")(traceback.format_exc())
        raise
    finally:
        write_json(flower_dir / "outcome.json", outcome)


def _server_app():
    from flwr.serverapp import ServerApp

    app = ServerApp()
    app.main()(server_main)
    return app


server_app = _server_app()  # named in the Flower app's pyproject.toml (serverapp = "...deploy:server_app")


def write_app(run_dir: Path, resume: bool) -> Path:
    """The Flower app of a run: a pyproject.toml naming fedguide's ServerApp/ClientApp and the run."""
    import tomli_w

    app = Path(run_dir) / "flower" / "app"
    pyproject = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": APP_NAME, "version": fedguide.__version__, "license": "Apache-2.0",
                    "description": "a fedguide run on a Flower deployment", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": APP_PUBLISHER,
            "components": {"serverapp": "fedguide.fl.flower.deploy:server_app",
                           "clientapp": "fedguide.fl.flower.node:client_app"},
            "config": {"run-dir": str(Path(run_dir).resolve()), "resume": bool(resume)},
        }}},
    }
    write_text(app / "pyproject.toml", tomli_w.dumps(pyproject))
    return app


# ---- the SuperLink and `fedguide serve` -------------------------------------------------------------
def superlink_port(cfg: Config) -> int:
    return int(cfg.runtime.superlink.rpartition(":")[2])


class SuperLink:
    """A ``flower-superlink`` process (and the ServerApps it starts) serving runs from ``folder``."""

    def __init__(self, folder: Path, port: int, host: str = "127.0.0.1"):
        self.folder = Path(folder).resolve()
        self.home = self.folder / "home"
        self.log_path = self.folder / "superlink.log"
        self.env = flower_env(self.home)
        reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.address = f"{reach}:{port}"
        if port_open(reach, port):
            raise ConfigError(f"port {port} on {reach} is already in use; set runtime.superlink to a free port")
        self.proc = start([flower_command("flower-superlink"), "--insecure", "--host", host, "--port", str(port),
                           "--disable-runtime-dependency-installation"], self.env, self.log_path)
        try:
            deadline = time.time() + START_TIMEOUT_S
            while not port_open(reach, port):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise FlowerRuntimeFailed(f"the SuperLink did not start; last lines of {self.log_path}:\n"
                                              f"{log_tail(self.log_path)}")
                time.sleep(0.1)
            self.home.mkdir(parents=True, exist_ok=True)
            # `flwr run` finds the SuperLink through FLWR_HOME/config.toml.
            write_text(self.home / "config.toml", f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                                                  f'[superlink.{CONNECTION}]\naddress = "{self.address}"\ninsecure = true\n')
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SuperLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        stop_tree(self.proc)

    def submit(self, app_dir: Path) -> str:
        """``flwr run`` the app; returns Flower's run id."""
        try:
            out = subprocess.run([flower_command("flwr"), "run", str(app_dir), CONNECTION, "--format", "json"],
                                 env=self.env, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FlowerRuntimeFailed(f"flwr run did not return within {SUBMIT_TIMEOUT_S} s") from None
        try:
            answer = json.loads(out.stdout[out.stdout.index("{"):])
        except ValueError:
            answer = {}
        if not answer.get("success"):
            raise FlowerRuntimeFailed(f"flwr run failed: {answer.get('error-message') or out.stderr or out.stdout}")
        return str(answer["run-id"])

    def _serverapps(self) -> set[int]:
        return {p for p in descendants(self.proc.pid) if "flwr-serverapp" in command_line(p)}

    def wait(self, run_dir: Path, log: Callable[[str], None], poll_s: float = 0.2) -> dict[str, Any]:
        """Echo the ServerApp's log until its outcome is written; the outcome."""
        flower_dir = Path(run_dir) / "flower"
        outcome_path, log_path = flower_dir / "outcome.json", flower_dir / "server.log"
        offset, seen, gone_since = 0, False, None
        deadline = time.time() + START_TIMEOUT_S
        while True:
            offset = _echo(log_path, offset, log)
            if outcome_path.is_file():
                _echo(log_path, offset, log)
                return json.loads(outcome_path.read_text())
            if self.proc.poll() is not None:
                raise FlowerRuntimeFailed(f"the SuperLink stopped (exit code {self.proc.returncode}); last lines "
                                          f"of {self.log_path}:\n{log_tail(self.log_path)}")
            running = bool(self._serverapps())
            seen = seen or running
            if seen and not running:
                gone_since = gone_since or time.time()
                if time.time() - gone_since > 5:  # its outcome file would be there by now
                    raise FlowerRuntimeFailed(f"the ServerApp process ended without a result; last lines of "
                                              f"{self.log_path}:\n{log_tail(self.log_path, 30)}")
            elif not seen and time.time() > deadline:
                raise FlowerRuntimeFailed(f"the SuperLink did not start the ServerApp within {START_TIMEOUT_S} s; "
                                          f"see {self.log_path}")
            time.sleep(poll_s)


def _echo(path: Path, offset: int, log: Callable[[str], None]) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            fh.seek(offset)
            text = fh.read()
    except OSError:
        return offset
    complete = text[:text.rfind("\n") + 1]  # a line still being written waits for the next look
    for line in complete.splitlines():
        log(line)
    return offset + len(complete.encode())


def start_run(link: SuperLink, run_dir: Path, cfg: Optional[Config], resume: bool,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Submit one run to a running SuperLink and wait for it; its summary, or the run's error raised."""
    run_dir = Path(run_dir).resolve()
    flower_dir = run_dir / "flower"
    flower_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_text(flower_dir / "requested-config.yaml", to_yaml(cfg))
    for stale in ("outcome.json", "server.log"):
        (flower_dir / stale).unlink(missing_ok=True)
    link.submit(write_app(run_dir, resume))
    outcome = link.wait(run_dir, log)
    if outcome["status"] != "completed":
        error = ConfigError if outcome.get("config_error") else FlowerRuntimeFailed
        raise error(outcome.get("error", "the run failed"))
    return json.loads((run_dir / "summary.json").read_text())


def serve(run_dir: Path, cfg: Optional[Config] = None, resume: bool = False, host: str = "127.0.0.1",
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """``fedguide serve``: a SuperLink for one run, the run, and every process stopped at the end."""
    if resume:
        cfg = load_run_config(run_dir)
    elif cfg is None:
        raise ValueError("a new run needs its config")
    if cfg.runtime.name != "flower":
        raise ConfigError(f"fedguide serve runs runtime.name=flower; this config has {cfg.runtime.name!r} "
                          "(set runtime.name=flower, or use fedguide run)")
    flower_dir = Path(run_dir).resolve() / "flower"
    with SuperLink(flower_dir, superlink_port(cfg), host) as link:
        log(f"SuperLink listening on {host}:{superlink_port(cfg)} (log {link.log_path}); clients connect to "
            f"{cfg.runtime.superlink}")
        return start_run(link, run_dir, cfg, resume, log)
