"""FLOPs of one local training step of the run's method against FedAvg's on the same model and batch
(FedDifRC App. C.2.10 reports 187.6G vs 132.9G, 1.41x FedAvg, for training on CIFAR-10).

One step is the method's ``local_loss`` forward and its backward, plus ``after_backward``: the method's own
extra work is inside (MOON's frozen global and previous-model forwards, FedDifRC's similarities to its
cached targets, ...), the optimiser step is not. The count is torch's
``torch.utils.flop_counter.FlopCounterMode``: matrix products, convolutions and attention; elementwise work
(activations, norms, softmax) is not counted, for either method.

How the step is set up, as a client of the run's last round would be: the method is set up with its
server state of the last checkpoint, a client's context gets the server's payload for that round and its
stored client state (the first client that has any, so that e.g. MOON's step holds its previous local
model; client 0 when none has), ``begin_local`` runs outside the count, and the batch is the first
``train.batch_size`` samples of the client's data. The model holds ``client_start``'s weights.

Not counted: work a method does once and caches (FedDifRC's and SemanticFL's diffusion features,
extracted before round 1, are read from the cache in a step), and methods that train their own way
(one-shot methods, frozen-encoder heads: ``Method.fit`` overridden), for which there is no local step of
the run's model to count.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import new_figure, save_numbers, save_png
from fedguide.core.training import local_objective, regularizer_terms
from fedguide.methods.base import ClientContext, Method
from fedguide.methods.compose import Hooks
from fedguide.methods.classic.fedavg import FedAvg
from fedguide.registry import NoParams

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun

PAPER = {"source": "FedDifRC App. C.2.10 (CIFAR-10 training)", "fedavg_gflops": 132.9, "feddifrc_gflops": 187.6,
         "ratio": round(187.6 / 132.9, 3)}


def uses_local_loop(method: Method) -> bool:
    """Whether the method's clients train with the default loop over ``local_loss``."""
    return type(method).fit is Method.fit


def step_flops(method: Method, model: torch.nn.Module, ctx: ClientContext, batch: torch.Tensor
               ) -> tuple[int, dict[str, int]]:
    """(total, per aten op) FLOPs of one ``local_loss`` forward + backward (+ ``after_backward``) on the
    samples ``batch`` (global indices); ``begin_local`` runs first, outside the count."""
    from torch.utils.flop_counter import FlopCounterMode

    data = ctx.data
    device = next(model.parameters()).device
    model.train()
    state = method.begin_local(model, ctx)
    ctx.batch_indices = batch
    x, y = data.x[batch].to(device), data.y[batch].to(device)
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        loss = local_objective(method, regularizer_terms(method, ctx), model, x, y, ctx, state)
        loss.backward()
        method.after_backward(model, ctx, state)
    model.zero_grad(set_to_none=True)
    model.eval()
    per_op: dict[str, int] = defaultdict(int)
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        per_op[str(op).removeprefix("aten.")] += int(count)
    return int(counter.get_total_flops()), dict(sorted(per_op.items()))


def client_for_step(run: AnalysisRun) -> int:
    """The first client with stored state (its steady-state step), else client 0."""
    ctx = run.ctx
    return next((cid for cid in range(ctx.num_clients) if ctx.store.get(cid)), 0)


def client_context(run: AnalysisRun, method: Method, client_id: int) -> ClientContext:
    """The client's context of the run's last round, its payload and stored state on the run's device."""
    from fedguide.core.device import to_device

    ctx, round_ = run.ctx, run.config.train.rounds
    payload = Hooks(method).server_payload(round_, client_id, run.final_weights)
    return ClientContext(client_id, round_, ctx.data.client(client_id), to_device(payload, ctx.device),
                         to_device(ctx.store.get(client_id), ctx.device), device_data=ctx.device_data)


def measure(run: AnalysisRun, method: Method, client_id: int, batch: torch.Tensor) -> tuple[int, dict[str, int]]:
    ctx = run.ctx
    cctx = client_context(run, method, client_id)
    ctx.layout.load(ctx.model, method.client_start(cctx))
    try:
        return step_flops(method, ctx.model, cctx, batch)
    finally:
        ctx.layout.load(ctx.model, run.final_weights)


@FIGURES.register("flops", summary="FLOPs of one local training step of the method against FedAvg's")
class StepFlops(Figure):
    order = 50

    def applies(self, run: AnalysisRun) -> Optional[str]:
        if not uses_local_loop(run.built_method):
            return (f"{run.method_label} trains its clients in a loop of its own (Method.fit is overridden: FedRep's "
                    "head and body phases, Per-FedAvg's meta-steps, a one-shot client's own architecture, a head on a "
                    "frozen encoder, ...), so one step of the default local loop would not be its cost")
        if not any(len(c) for c in run.prepared.data.client_indices):
            return "no client holds any training sample"
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        method = run.method()
        client = client_for_step(run)
        data = run.ctx.data.client(client)
        if not len(data):
            client = next(cid for cid, c in enumerate(run.prepared.data.client_indices) if len(c))
            data = run.ctx.data.client(client)
        batch = data.indices[: run.config.train.batch_size]
        total, per_op = measure(run, method, client, batch)
        base_total, base_per_op = measure(run, FedAvg(NoParams(), run.ctx), client, batch)
        numbers = {
            "figure": "FLOPs of one local training step (local_loss forward + backward) against FedAvg's",
            "run": str(run.run_dir), "method": run.method_label, "model": run.config.model.name,
            "client": client, "batch_size": int(len(batch)),
            "flops": total, "fedavg_flops": base_total, "ratio": total / base_total if base_total else None,
            "per_op": per_op, "fedavg_per_op": base_per_op,
            "counted": "matrix products, convolutions and attention of local_loss forward + backward and after_backward "
                       "(torch.utils.flop_counter.FlopCounterMode); elementwise work, the optimiser step and begin_local "
                       "(work done once per client and round, e.g. FedDifRC's condition refresh) are not counted; "
                       "features a method caches once (diffusion features) are read, not recomputed, in a step",
            "paper": PAPER,
        }
        png = save_png(draw(numbers), run.out_dir / "flops.png")
        return [png, save_numbers(run.out_dir / "flops.json", numbers)]


def draw(numbers: dict):
    fig = new_figure((5.0, 4.0))
    ax = fig.add_subplot()
    names = ["fedavg", numbers["method"]]
    values = [numbers["fedavg_flops"] / 1e6, numbers["flops"] / 1e6]
    bars = ax.bar(names, values, color=["#9e9e9e", "#1f77b4"])
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize="small")
    ax.set_ylabel(f"MFLOPs per step (batch {numbers['batch_size']})")
    ratio = numbers["ratio"]
    ax.set_title(f"one local step on {numbers['model']}: {ratio:.2f}x FedAvg" if ratio else "one local step",
                 fontsize="medium")
    return fig
