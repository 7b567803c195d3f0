"""One client's part of a round, the same code in the server process and in worker processes."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from fedguide.config import TrainConfig
from fedguide.fl.context import RunContext
from fedguide.fl.seeding import derive_seed, torch_generator
from fedguide.fl.training import train_local
from fedguide.methods.base import ClientContext, Method, Record


@dataclass
class ClientResult:
    client_id: int
    upload: Record
    loss: float
    num_samples: int
    fit_seconds: float  # the local training loop alone (epochs of SGD), without the upload's work


def run_client(ctx: RunContext, method: Method, train: TrainConfig, seed: int, round_: int, client_id: int,
               payload: Record) -> ClientResult:
    cctx = ClientContext(client_id, round_, ctx.data.client(client_id), payload, ctx.store.get(client_id))
    ctx.layout.load(ctx.model, method.client_start(cctx))
    # Seeds derive from (seed, round, client) alone, so any worker, in any order, draws the same numbers.
    torch.manual_seed(derive_seed(seed, "client", round_, client_id))
    t0 = time.perf_counter()
    loss, cctx.steps = train_local(ctx.model, method, cctx, method.local_train(train), torch_generator(seed, "client", round_, client_id))
    if cctx.steps or math.isnan(cctx.train_loss):
        cctx.train_loss = loss  # a method that trains outside the loop (one-shot clients) reports its own
    upload = method.client_upload(ctx.model, cctx)
    # The client's whole work: one-shot and inference-only methods do theirs in begin_local/client_upload.
    fit_seconds = time.perf_counter() - t0
    if cctx.state_dirty:
        ctx.store.put(client_id, round_, cctx.state)
    return ClientResult(client_id, upload, cctx.train_loss, len(cctx.data), fit_seconds)
