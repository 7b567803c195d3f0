"""One client's part of a round, the same code in the server process and in worker processes."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from fedguide.config import TrainConfig
from fedguide.core import simulated
from fedguide.core.device import to_device
from fedguide.core.records import Record
from fedguide.core.seeding import derive_seed, torch_generator
from fedguide.fl.participation import client_train
from fedguide.methods.base import ClientContext, Method, RunContext
from fedguide.methods.compose import Hooks


@dataclass
class ClientResult:
    client_id: int
    upload: Record
    loss: Optional[float]  # None: the run's model took no step on this client (inference-only, one-shot)
    num_samples: int
    fit_seconds: float  # the client's whole work: Method.fit and its upload
    # What the simulated device counted during that work (train.device: simulated), else None.
    device_counts: Optional[simulated.Counters] = None


def run_client(ctx: RunContext, method: Method, train: TrainConfig, seed: int, round_: int, client_id: int,
               payload: Record) -> ClientResult:
    # Seeds derive from (seed, round, client) alone, so any worker, in any order, draws the same numbers.
    # Payload and state reach the client from the network, a worker's queue or the disk, on the CPU.
    device = ctx.device if method.on_device else torch.device("cpu")
    sim = simulated.current()
    counted = sim.counters.copy() if sim is not None else None
    cctx = ClientContext(client_id, round_, ctx.data.client(client_id), to_device(payload, device),
                         to_device(ctx.store.get(client_id), device),
                         generator=torch_generator(seed, "client", round_, client_id), device_data=ctx.device_data)
    ctx.layout.load(ctx.model, method.client_start(cctx))
    torch.manual_seed(derive_seed(seed, "client", round_, client_id))
    t0 = time.perf_counter()
    # The round's learning rate (train.schedule): methods read their settings from the run context too (SCAFFOLD's
    # control variates divide by it), so for this client's round the context holds the round's settings.
    train = client_train(train.at_round(round_), ctx.clients, seed, round_, client_id, ctx.num_clients)
    general, ctx.train = ctx.train, train
    try:
        loss, state = method.fit(ctx.model, cctx, train)
        upload = Hooks(method).client_upload(ctx.model, cctx, state)
    finally:
        ctx.train = general
    fit_seconds = time.perf_counter() - t0
    if cctx.state_dirty:
        ctx.store.put(client_id, round_, cctx.state)
    counts = sim.counters.since(counted) if sim is not None else None
    return ClientResult(client_id, upload, loss, len(cctx.data), fit_seconds, counts)
