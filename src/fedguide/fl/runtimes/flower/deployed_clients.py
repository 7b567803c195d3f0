"""The client executor of a Flower deployment (``runtime.name: flower``): the server's view of the
SuperNodes, over the deployment's Grid, like sim.py's FlowerClients: one train message per sampled
client to the SuperNode whose partition-id is that client's id.

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
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fedguide.config import Config
from fedguide.core.records import Record
from fedguide.fl.client_step import ClientResult
from fedguide.fl.runtime import Executor
from fedguide.fl.runtimes.flower.messages import FlowerClientFailed, FlowerRuntimeFailed, decode_result, error_reason
from fedguide.fl.runtimes.flower.protocol import comparable, differences, fingerprint, run_key
from fedguide.fl.runtimes.flower.records import decode, encode
from fedguide.registry import ConfigError

POLL_MIN_S, POLL_MAX_S = 0.01, 0.1
FINISH_TIMEOUT_S = 60  # the clients' last commit after the final round


class DeployedClients(Executor):
    def __init__(self, grid, params, cfg: Config, run_dir: Path, num_clients: int, log: Callable[[str], None],
                 threads: int):
        self.grid = grid
        self.runtime = params
        self.threads = threads
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

    def tell_finished(self) -> None:
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

    # -- the engine's hooks ---------------------------------------------------------------------------
    @property
    def workers(self) -> int:
        return len(self.nodes)  # processes that trained clients: one per SuperNode

    def round_metrics(self, round_: int) -> dict[str, Any]:
        errors = self.failures.get(round_, {})
        return {"failed_clients": sorted(errors),
                "client_errors": {str(cid): why for cid, why in sorted(errors.items())}}

    def finish(self, metrics: list[dict[str, Any]]) -> dict[str, Any]:
        self.tell_finished()
        return {"runtime": "flower",
                "client_failures": [{"round": m["round"], "client": int(cid), "reason": why}
                                    for m in metrics for cid, why in m.get("client_errors", {}).items()]}

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


