"""Regularisers that compose with any method ("+DW" in FedDW's Table IV).

A regulariser adds a term to a method's local objective and may carry its own server payload, client
upload, server-side aggregation and server state. A method holds the regularisers it is trained with in
``Method.regularizers`` (``with_regularizers`` adds the config's ``regularizers:`` when the run is opened;
a method may bring its own, as FedDW brings DW) and never calls them itself: they are applied from that
list, as callbacks are.

- The local loop (``core.training.train_local``) adds each regulariser's ``loss`` to the method's
  ``local_loss``; that is the only place a term can go, so a method that trains in its own ``fit`` refuses
  regularisers when they are added.
- Everything else goes through ``Hooks``, the one object the engine, the client step and the analyses call
  for the hooks regularisers take part in (``setup``, ``server_payload``, ``client_upload``, ``aggregate``,
  ``server_state``, ``load_server_state``): it calls the method's hook and merges each regulariser's part.
  A call site wraps the method once (``Hooks(method)``) and calls the method itself for the rest, so it
  knows nothing of regularisers beyond that.

A regulariser's records travel and are checkpointed under the keys ``<name>.<key>`` so they never collide
with the method's. Being a list on the method (not a wrapper around it) keeps the method's type, its
attributes and its other hooks as they are for whoever holds it: the runtimes, the analyses, the tests.
"""
from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
from pydantic import BaseModel

from fedguide.methods.base import ClientContext, Method, Record
from fedguide.registry import ConfigError, NoParams, Parsed, Registry

REGULARIZERS: Registry = Registry("regularizer", plugins=("fedguide.methods",))
SERVER_PREFIX = "server_optimizer."  # the server optimiser's keys in the checkpointed server state


class Regularizer:
    """Override what the term needs; the defaults send and keep nothing."""

    Params: ClassVar[type[BaseModel]] = NoParams
    name: ClassVar[str] = ""
    model_requirements: ClassVar[dict[str, Any]] = {}  # as Method.model_requirements

    def __init__(self, params: BaseModel, run: Any):
        self.params = params
        self.run = run

    def own(self, record: Record) -> Record:
        """This regulariser's entries of a merged record (a payload, an upload, a server state), without the
        ``<name>.`` prefix."""
        prefix = f"{self.name}."
        return {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}

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


def with_regularizers(method: Method, regularizers: list[Regularizer]) -> Method:
    """``method`` trained with ``regularizers`` besides those it brings; refused where its clients train in
    their own loop."""
    if regularizers and type(method).fit is not Method.fit:
        # Its own loop calls its own loss: a regulariser's term would be dropped without a word.
        names = ", ".join(r.name for r in regularizers)
        raise ConfigError(f"regularizers [{names}] add a term to the local loop's objective, but method "
                          f"'{type(method).__name__}' trains its clients in its own loop (Method.fit), where the "
                          "term has no place; remove the regularizers or choose a method trained by the local loop")
    twice = sorted({r.name for r in regularizers} & {r.name for r in method.regularizers})
    if twice or len({r.name for r in regularizers}) < len(regularizers):
        # Two terms of one name would share their records (``<name>.<key>``) and silently add the term twice.
        names = ", ".join(twice) or ", ".join(sorted({r.name for r in regularizers
                                                      if sum(o.name == r.name for o in regularizers) > 1}))
        where = f"method '{type(method).__name__}' already trains with it" if twice else "it is listed twice"
        raise ConfigError(f"regularizers: [{names}] would apply twice ({where}); remove it from regularizers")
    method.regularizers = [*method.regularizers, *regularizers]
    return method


class Hooks:
    """The method's hooks with its regularisers' parts merged in: what the engine, the client step and the
    analyses call for ``setup``, ``server_payload``, ``client_upload``, ``aggregate`` and the server state.
    The method's part comes first in a record and regularisers' keys are ``<name>.<key>``."""

    def __init__(self, method: Method):
        self.method = method
        self.regularizers = list(method.regularizers)
        self.server_optimizer = method.server_optimizer

    def _merge(self, record: Record, parts) -> Record:
        out = dict(record)
        for r, part in zip(self.regularizers, parts):
            out.update({f"{r.name}.{k}": v for k, v in part.items()})
        return out

    def setup(self) -> None:
        self.method.setup()
        for r in self.regularizers:
            r.setup()

    def server_payload(self, round_: int, client_id: int, global_weights: torch.Tensor) -> Record:
        return self._merge(self.method.server_payload(round_, client_id, global_weights),
                           [r.server_payload(round_, client_id) for r in self.regularizers])

    def client_upload(self, model, ctx: ClientContext, state: Any) -> Record:
        upload = self.method.client_upload(model, ctx, state)
        return self._merge(upload, [r.client_upload(model, ctx, r.own(ctx.payload)) for r in self.regularizers])

    def aggregate(self, round_: int, global_weights: torch.Tensor, uploads: list[Record]) -> torch.Tensor:
        # The regularisers' server state follows this round's uploads before the method aggregates, as their
        # payloads of the next round are built from it.
        for r in self.regularizers:
            r.aggregate(round_, [{**r.own(u), "client_id": u["client_id"]} for u in uploads])
        aggregate = self.method.aggregate(round_, global_weights, uploads)
        # The server optimiser steps from the round's global model towards the method's aggregate (FedOpt).
        return aggregate if self.server_optimizer is None else self.server_optimizer.step(global_weights, aggregate)

    def server_state(self) -> dict[str, torch.Tensor]:
        state = self._merge(self.method.server_state(), [r.server_state() for r in self.regularizers])
        if self.server_optimizer is not None:
            state.update({f"{SERVER_PREFIX}{k}": v for k, v in self.server_optimizer.server_state().items()})
        return state

    def load_server_state(self, state: dict[str, torch.Tensor]) -> None:
        prefixes = (*(f"{r.name}." for r in self.regularizers), SERVER_PREFIX)
        for r in self.regularizers:
            r.load_server_state(r.own(state))
        if self.server_optimizer is not None:
            self.server_optimizer.load_server_state(
                {k[len(SERVER_PREFIX):]: v for k, v in state.items() if k.startswith(SERVER_PREFIX)})
        self.method.load_server_state({k: v for k, v in state.items() if not k.startswith(prefixes)})


def build_regularizers(regularizers: Sequence[Parsed], run: Any) -> list[Regularizer]:
    """The config's regularisers (``ResolvedConfig.regularizers``: entries with their parsed parameters) built
    over the opened run."""
    return [r.entry.obj(r.params, run) for r in regularizers]
