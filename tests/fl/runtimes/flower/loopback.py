"""An in-process stand-in for Flower's Grid: every message is answered by a ClientApp function in this
process, as a SuperLink and its SuperNodes (deployed) or Ray's actors (flower-sim) would answer it.
Everything of fedguide's Flower path runs (messages, the record codec, the client step on decoded
payloads, client state on disk, the replies' order); only the transport is left out."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from fedguide.config import to_yaml


class LoopbackGrid:
    """``answer(message, context)`` is the reply of the node a message is addressed to. A node in
    ``silent`` never answers train messages from the given round on, like a machine that died."""

    def __init__(self, answer: Callable):
        from flwr.app import Context, RecordDict

        self._context, self._records = Context, RecordDict
        self.answer = answer
        self.contexts: dict[int, object] = {}
        self.silent: dict[int, int] = {}
        self.pending: dict[str, object] = {}
        self.delivered: list[tuple[int, str]] = []

    def add_node(self, node_id: int, node_config: dict) -> None:
        self.contexts[node_id] = self._context(run_id=7, node_id=node_id, state=self._records(), run_config={},
                                               node_config=node_config)

    def add_client(self, node_id: int, cid: int, folder: Path, cfg, num: int) -> None:
        """A deployed client: its own folder holding the config it was started with."""
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(to_yaml(cfg))
        self.add_node(node_id, {"partition-id": cid, "num-partitions": num,
                                "fedguide-config": str(folder / "config.yaml"), "fedguide-dir": str(folder)})

    def trains(self) -> int:
        """How many train messages the nodes answered."""
        return sum(kind == "train" for _, kind in self.delivered)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id  # what the SuperLink stamps on a pushed message
            self.pending[m.object_id] = m
            ids.append(m.object_id)
        return ids

    def _answers(self, m) -> bool:
        first = self.silent.get(m.metadata.dst_node_id)
        return first is None or "job" not in m.content or int(m.content["job"]["round"]) < first

    def pull_messages(self, ids):
        replies = []
        for mid in ids:
            m = self.pending.get(mid)
            if m is not None and self._answers(m):
                del self.pending[mid]
                self.delivered.append((m.metadata.dst_node_id, m.metadata.message_type))
                replies.append(self.answer(m, self.contexts[m.metadata.dst_node_id]))
        return replies


def as_a_server_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """The task identity a ServerApp process has, which Flower needs to build a message."""
    from flwr.supercore.task_identity import TaskIdentity

    for key, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, key, value)


def deployed_clients(monkeypatch: pytest.MonkeyPatch, folder: Path, cfg, client_cfg=None) -> LoopbackGrid:
    """A LoopbackGrid of ``cfg``'s clients as `fedguide client` runs them (each its own folder and config,
    ``client_cfg`` if given), answering with the deployment's ClientApp in this process."""
    from fedguide.fl.runtimes.flower import node

    as_a_server_app(monkeypatch)
    monkeypatch.setattr(node, "_NODES", {})  # the ClientApp's per-process state, dropped afterwards
    grid = LoopbackGrid(lambda message, context: node.answer(message, context)[0])
    for cid in range(cfg.clients.num):
        grid.add_client(9000 + 7 * cid, cid, folder / f"client-{cid}", client_cfg or cfg, cfg.clients.num)
    return grid


def simulation_without_ray(monkeypatch: pytest.MonkeyPatch) -> list:
    """Makes the flower-sim runtime's executor talk to a LoopbackGrid whose nodes answer with the
    simulation's own ClientApp functions (``client_query``, ``client_train``) in this process, instead
    of starting Ray. Returns the list the grids are appended to, one per run."""
    from flwr.app import MessageType

    from fedguide.fl.runtimes.flower import simulated_clients

    grids: list[LoopbackGrid] = []

    def answer(message, context):
        reply = (simulated_clients.client_query if message.metadata.message_type == MessageType.QUERY
                 else simulated_clients.client_train)
        return reply(message, context)

    def start(self) -> None:
        self.grid = LoopbackGrid(answer)
        for cid in range(self.num_clients):
            self.grid.add_node(100 + 7 * cid, {"partition-id": cid, "num-partitions": self.num_clients})
        grids.append(self.grid)
        self.nodes = self._learn_nodes(time.time() + 60)

    as_a_server_app(monkeypatch)
    monkeypatch.setattr(simulated_clients.FlowerClients, "_start", start)
    monkeypatch.setattr(simulated_clients, "_RUNS", {})  # the client side's cached run, dropped afterwards
    return grids
