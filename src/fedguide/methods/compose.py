"""Regularisers that compose with any method ("+DW" in FedDW's Table IV).

A regulariser adds a term to a method's local objective and may carry its own server payload,
client upload and server-side aggregation. ``Composed`` wraps a method and its regularisers into one
Method: the engine, the worker pool and network runtimes see nothing new. A regulariser's records
travel under the keys ``<name>.<key>`` so they never collide with the method's.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from fedguide.methods.base import ClientContext, Method, Record
from fedguide.registry import ConfigError, NoParams, Registry

REGULARIZERS: Registry = Registry("regularizer", plugins=("fedguide.methods",))


class Regularizer:
    """Override what the term needs; the defaults send and keep nothing."""

    Params: ClassVar[type[BaseModel]] = NoParams
    name: ClassVar[str] = ""
    model_defaults: ClassVar[dict[str, Any]] = {}  # as Method.model_defaults

    def __init__(self, params: BaseModel, run: Any):
        self.params = params
        self.run = run

    def setup(self) -> None:
        pass

    def server_payload(self, round_: int, client_id: int) -> Record:
        return {}

    def loss(self, model, x: torch.Tensor, y: torch.Tensor, ctx: ClientContext, payload: Record) -> torch.Tensor:
        raise NotImplementedError

    def client_upload(self, model, ctx: ClientContext, payload: Record) -> Record:
        return {}

    def aggregate(self, round_: int, uploads: list[Record]) -> None:
        pass

    def server_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        pass


def _own(record: Record, prefix: str) -> Record:
    return {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}


class Composed(Method):
    """A method plus regularisers, itself a Method: every hook delegates to the base method and the
    regularisers add their terms and records."""

    def __init__(self, base: Method, regularizers: list[Regularizer]):
        if type(base).fit is not Method.fit:
            # Its own loop calls its own loss: a regulariser's term would be dropped without a word.
            names = ", ".join(r.name for r in regularizers)
            raise ConfigError(f"regularizers [{names}] add a term to the local loop's objective, but method "
                              f"'{type(base).__name__}' trains its clients in its own loop (Method.fit), where the "
                              "term has no place; remove the regularizers or choose a method trained by the local loop")
        super().__init__(base.params, base.run)
        self.base, self.regs = base, regularizers
        self.on_device = base.on_device
        self.prefixes = [f"{r.name}." for r in regularizers]

    def setup(self):
        self.base.setup()
        for r in self.regs:
            r.setup()

    def init_global(self, weights):
        return self.base.init_global(weights)

    def server_payload(self, round_, client_id, global_weights):
        payload = dict(self.base.server_payload(round_, client_id, global_weights))
        for r, pre in zip(self.regs, self.prefixes):
            payload.update({pre + k: v for k, v in r.server_payload(round_, client_id).items()})
        return payload

    def local_train(self, train):
        return self.base.local_train(train)

    def client_start(self, ctx):
        return self.base.client_start(ctx)


    def begin_local(self, model, ctx):
        self.base.begin_local(model, ctx)

    def local_loss(self, model, x, y, ctx):
        loss = self.base.local_loss(model, x, y, ctx)
        for r, pre in zip(self.regs, self.prefixes):
            loss = loss + r.loss(model, x, y, ctx, _own(ctx.payload, pre))
        return loss

    def after_backward(self, model, ctx):
        self.base.after_backward(model, ctx)

    def client_upload(self, model, ctx):
        upload = dict(self.base.client_upload(model, ctx))
        for r, pre in zip(self.regs, self.prefixes):
            upload.update({pre + k: v for k, v in r.client_upload(model, ctx, _own(ctx.payload, pre)).items()})
        return upload

    def aggregate(self, round_, global_weights, uploads):
        for r, pre in zip(self.regs, self.prefixes):
            r.aggregate(round_, [{**_own(u, pre), "client_id": u["client_id"]} for u in uploads])
        return self.base.aggregate(round_, global_weights, uploads)

    def evaluate(self, round_, global_weights):
        return self.base.evaluate(round_, global_weights)

    def personal_model(self, round_, client_id, global_weights):
        return self.base.personal_model(round_, client_id, global_weights)

    def server_state(self):
        state = dict(self.base.server_state())
        for r, pre in zip(self.regs, self.prefixes):
            state.update({pre + k: v for k, v in r.server_state().items()})
        return state

    def load_server_state(self, state):
        for r, pre in zip(self.regs, self.prefixes):
            r.load_server_state(_own(state, pre))
        self.base.load_server_state({k: v for k, v in state.items() if not any(k.startswith(p) for p in self.prefixes)})


def build_regularizers(specs: list, run: Any) -> list[Regularizer]:
    out = []
    for i, spec in enumerate(specs):
        raw = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = raw.pop("name", None)
        if name is None:
            raise ValueError(f"regularizers[{i}] has no name; write e.g. regularizers: [dw]")
        entry = REGULARIZERS.get(name)
        out.append(entry.obj(REGULARIZERS.parse_params(name, raw, f"regularizers[{i}]"), run))
    return out
