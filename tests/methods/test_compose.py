"""Regularisers applied from the method's list: their records merged under ``<name>.`` by ``Hooks``, their server
state checkpointed under the same keys, and a method that trains in its own loop refusing them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fedguide.methods.base import ClientContext, Method
from fedguide.methods.compose import Hooks, Regularizer, with_regularizers
from fedguide.registry import ConfigError


class Keeper(Method):
    """A method with a payload, an upload and server state of its own."""

    def __init__(self):
        super().__init__(None, SimpleNamespace())
        self.kept = torch.tensor(1.0)
        self.seen: list = []

    def server_payload(self, round_, client_id, global_weights):
        return {"weights": global_weights, "v": self.kept}

    def client_upload(self, model, ctx, state):
        return {"weights": torch.zeros(2), "num_samples": 3, "v": state}

    def aggregate(self, round_, global_weights, uploads):
        self.seen = uploads
        return global_weights

    def server_state(self):
        return {"v": self.kept}

    def load_server_state(self, state):
        self.kept = state["v"]


class Counter(Regularizer):
    name = "count"

    def __init__(self):
        super().__init__(None, None)
        self.total = torch.tensor(0.0)
        self.set_up = False

    def setup(self):
        self.set_up = True

    def server_payload(self, round_, client_id):
        return {"v": self.total + round_}

    def client_upload(self, model, ctx, payload):
        return {"v": payload["v"] * 2}

    def aggregate(self, round_, uploads):
        self.total = sum(u["v"] for u in uploads) + sum(u["client_id"] for u in uploads)

    def server_state(self):
        return {"v": self.total}

    def load_server_state(self, state):
        self.total = state["v"]


def composed():
    return with_regularizers(Keeper(), [Counter()])


def test_records_merge_the_regularisers_parts_under_their_names():
    method = composed()
    hooks = Hooks(method)
    hooks.setup()
    assert method.regularizers[0].set_up
    payload = hooks.server_payload(3, 0, torch.ones(2))
    assert set(payload) == {"weights", "v", "count.v"} and payload["count.v"].item() == 3.0
    ctx = ClientContext(0, 3, None, payload, {})
    upload = hooks.client_upload(None, ctx, "round state")
    assert upload["v"] == "round state" and upload["count.v"].item() == 6.0


def test_aggregate_gives_each_regulariser_its_part_and_the_method_everything():
    method = composed()
    uploads = [{"weights": torch.zeros(2), "num_samples": 1, "count.v": torch.tensor(2.0), "client_id": 4}]
    Hooks(method).aggregate(1, torch.ones(2), uploads)
    assert method.regularizers[0].total.item() == 6.0
    assert method.seen is uploads


def test_server_state_keys_are_prefixed_and_load_back():
    method = composed()
    method.regularizers[0].total = torch.tensor(7.0)
    state = Hooks(method).server_state()
    assert set(state) == {"v", "count.v"}  # the checkpoint's keys (method.count.v in the file)
    again = composed()
    Hooks(again).load_server_state({"v": torch.tensor(5.0), "count.v": torch.tensor(7.0)})
    assert again.kept.item() == 5.0 and again.regularizers[0].total.item() == 7.0


def test_a_method_with_its_own_fit_refuses_regularisers():
    class OwnLoop(Method):
        def fit(self, model, ctx, train):
            return None, None

    with pytest.raises(ConfigError, match=r"regularizers \[count\].*'OwnLoop' trains its clients in its own loop"):
        with_regularizers(OwnLoop(None, None), [Counter()])
    assert not with_regularizers(OwnLoop(None, None), []).regularizers
