"""Pieces the personalised-FL methods share: which part of a SplitModel trains (``frozen``), the flat-vector
ranges of a model's body, head and top layers, and fine-tuning a weight vector on one client's training data
(the default personalisation step of ``eval.mode: personal``)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Literal, Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.dropout import _DropoutNd

from fedguide.core.device import autocast
from fedguide.core.evaluation import mean_metrics
from fedguide.core.seeding import torch_generator
from fedguide.core.training import train_local
from fedguide.core.weights import WeightLayout
from fedguide.data.federated import ClientData
from fedguide.methods.context import ClientContext, RunContext
from fedguide.models.split import SplitModel
from fedguide.registry import ConfigError

Part = Literal["full", "head", "body"]


@contextlib.contextmanager
def frozen(model: torch.nn.Module, part: str) -> Iterator[None]:
    """Within the block, the parameters of ``part`` ('head': ``model.head``; 'body': ``model.encoder``; 'none')
    take no gradient, so no optimiser (weight decay and momentum included) moves them."""
    module = {"head": getattr(model, "head", None), "body": getattr(model, "encoder", None), "none": None}[part]
    params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def head_span(layout: WeightLayout) -> slice:
    """The classification layer's range of the flat vector (SplitModel puts it last)."""
    span = layout.span("head.")
    if span.stop != layout.numel:
        raise ValueError("the head is not at the end of the weight vector")
    return span


def top_layers_start(layout: WeightLayout, model: torch.nn.Module, layers: int, key: str) -> int:
    """Where the top ``layers`` layers (modules owning parameters, counted from the output: the classification
    layer, then the mapping layers, ...) begin in the flat vector; they run to its end."""
    owners = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
    modules, offsets, offset = [], {}, 0
    for name, shape in zip(layout.names, layout.shapes):
        module = name.rsplit(".", 1)[0]
        if module in owners and module not in offsets:
            modules.append(module)
            offsets[module] = offset
        offset += int(torch.Size(shape).numel())
    if not 1 <= layers < len(modules):
        raise ConfigError(f"method.{key}: {layers} of the model's {len(modules)} layers would leave no shared layer; "
                          f"write a number from 1 to {len(modules) - 1}")
    return offsets[modules[-layers]]


class StepFrozen:
    """The local loop's hooks of one training phase: ``inner``'s (plain cross-entropy by default), and after each
    backward pass a zero gradient for ``params``, a part frozen in this phase, so that an optimiser kept across
    phases steps it as ``zero_grad()`` left it before torch 2: a zeroed gradient, not none, once the part has
    had one. SGD's momentum and weight decay and Adam's moments then keep moving it, and Adam counts the step
    (FedRep's and FedDW's released codes, on torch 0.4.1 and 1.12, train this way)."""

    def __init__(self, params: list[torch.nn.Parameter], inner: Any = None):
        self._params, self._inner = params, (_CrossEntropy() if inner is None else inner)

    def __getattr__(self, name: str) -> Any:  # the inner hooks' loss, regularisers and optimisers
        return getattr(self._inner, name)

    def local_loss(self, model: Any, x: torch.Tensor, y: torch.Tensor, ctx: Any, state: Any) -> torch.Tensor:
        return self._inner.local_loss(model, x, y, ctx, state)

    def after_backward(self, model: Any, ctx: Any, state: Any) -> None:
        self._inner.after_backward(model, ctx, state)
        for p in self._params:
            p.grad = torch.zeros_like(p)


class _CrossEntropy:
    """The local loop's hooks for plain cross-entropy (fine-tuning ignores the method's own objective)."""

    def local_loss(self, model: Any, x: torch.Tensor, y: torch.Tensor, ctx: Any, state: Any) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def after_backward(self, model: Any, ctx: Any, state: Any) -> None:
        pass


def fine_tune(run: RunContext, client_id: int, round_: int, weights: torch.Tensor, train: Any,
              part: Part = "full") -> torch.Tensor:
    """``weights`` after cross-entropy training on client ``client_id``'s training data with ``train``'s
    settings (epochs, or local_steps steps), only ``part`` trainable. Batch order is drawn from
    (seed, "personal", round, client) and the process's random state is left as it was, so scoring clients
    changes nothing in the run."""
    model = run.model
    run.layout.load(model, weights.to(run.device))
    ctx = ClientContext(client_id, round_, run.data.client(client_id), {}, {},
                        generator=torch_generator(run.seed, "personal", round_, client_id),
                        device_data=run.device_data)
    keep = {"full": "none", "head": "body", "body": "head"}[part]
    with torch.random.fork_rng(devices=[]), frozen(model, keep):
        if part == "head":
            train_head(model, ctx, train)
        else:
            train_local(model, _CrossEntropy(), ctx, train, ctx.generator)
    model.eval()
    return run.layout.flatten(model)


def features_reusable(model: torch.nn.Module, ctx: ClientContext) -> bool:
    """Whether a frozen body gives every training sample the same features in every pass: a plain SplitModel
    whose body is made of torch.nn layers that map each sample alone and deterministically (no batch
    statistics, no running statistics to update, no dropout) and inputs without ``train.augment``."""
    if type(model) is not SplitModel or (ctx.device_data is not None and ctx.device_data.augment is not None):
        return False
    for module in model.encoder.modules():
        if not type(module).__module__.startswith("torch.nn.") or isinstance(module, (_NormBase, _DropoutNd)):
            return False
        if isinstance(module, torch.nn.RNNBase) and module.dropout > 0:
            return False
    return True


def train_head(model: SplitModel, ctx: ClientContext, train: Any, optimizer: Optional[torch.optim.Optimizer] = None,
               hooks: Any = None, reuse: bool = True) -> tuple[float, int]:
    """Cross-entropy training of ``model.head`` on the client's data with the body frozen (the caller freezes
    it), batches drawn from ``ctx.generator``; (mean loss, steps) as ``train_local`` returns them. ``optimizer``
    and ``hooks`` go to ``train_local`` (a caller's optimiser kept across phases; the loop's hooks, plain
    cross-entropy by default); ``reuse`` False: through the body whatever ``features_reusable`` says (the
    caller's hooks may move the frozen body).

    Where ``features_reusable``, the body's features are computed once and the head trains on them instead of
    running the body in every epoch: the same batches in the same order (the client's samples renumbered
    0..n-1 keep their places in every shuffle), the same optimiser, the same generator draws, so the result
    equals training through the frozen body up to float rounding, at the cost of one pass of the body."""
    hooks = _CrossEntropy() if hooks is None else hooks
    if not (reuse and features_reusable(model, ctx)):
        return train_local(model, hooks, ctx, train, ctx.generator, optimizer=optimizer)
    idx = ctx.data.indices
    chunk = max(train.batch_size, 256)
    parts, labels = [], []
    with torch.no_grad(), autocast(ctx.device, getattr(train, "precision", "fp32")):
        for i in range(0, len(idx), chunk):
            x, y = ctx.batch(idx[i: i + chunk])
            parts.append(model.encoder(x))
            labels.append(y)
    feats, labels = torch.cat(parts), torch.cat(labels)
    data = ClientData(ctx.client_id, torch.arange(len(idx)), feats.float(), labels, ctx.data.num_classes)
    head_ctx = ClientContext(ctx.client_id, ctx.round, data, {}, {}, generator=ctx.generator)
    return train_local(model.head, hooks, head_ctx, train, ctx.generator, optimizer=optimizer)


def batch_stream(indices: torch.Tensor, batch_size: int, generator: torch.Generator, min_size: int = 1,
                 keep: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                 ) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Endless batches of ``indices``: one shuffled pass after another, the last batch of a pass short, and
    skipped when under ``min_size`` (BatchNorm cannot normalise a single sample) unless it is the whole pass.
    Each is (host indices, the same indices where the tensors are kept): ``keep`` (``DeviceData.indices``) takes
    a pass's order there once, so a batch copies nothing; None without it."""
    while True:
        order = indices[torch.randperm(len(indices), generator=generator)]
        kept = keep(order) if keep is not None else None
        for start in range(0, len(order), batch_size):
            batch = order[start: start + batch_size]
            if len(batch) >= min_size or start == 0:
                yield batch, (kept[start: start + batch_size] if kept is not None else None)


def client_batches(ctx: ClientContext, batch_size: int, generator: torch.Generator, min_size: int = 1
                   ) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``batch_stream`` over the client's training indices, each pass taken where the run's tensors are kept
    (``ctx.device_data``) once; ``batch_at(ctx, *batch)`` gathers a batch."""
    keep = ctx.device_data.indices if ctx.device_data is not None else None
    return batch_stream(ctx.data.indices, batch_size, generator, min_size, keep)


def batch_at(ctx: ClientContext, idx: torch.Tensor, kept: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of the client's training samples ``idx`` (host indices; ``kept``: the same where the
    tensors are kept, from ``batch_stream``), where the run computes."""
    if ctx.device_data is None:
        return ctx.data.x[idx], ctx.data.y[idx]
    return ctx.device_data.train_batch(kept if kept is not None else ctx.device_data.indices(idx))


def mean_client_metrics(run: RunContext, model_of: Callable[[int], torch.Tensor]) -> dict[str, Any]:
    """The mean over all clients of their models' metrics on the global test set (``local``'s report and FedDW's
    global test of personalised methods), with the spread (``client_accuracy_min``/``max``)."""
    with run.evaluator.encoder_reuse() as evaluator:  # clients under one shared body: one encoder pass
        return mean_metrics([evaluator.evaluate(model_of(cid)) for cid in range(run.num_clients)])
