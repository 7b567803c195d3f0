"""Evaluation of a weight vector on the held-out test set."""
from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from fedguide.core.device import autocast
from fedguide.core.weights import WeightLayout

# The largest number of images one CPU forward pass of the evaluator computes at once (see Evaluator._chunks).
CPU_CHUNK = 128


@dataclass
class _EncoderReuse:
    """The encoder span of the flat weight vector and the encoder outputs kept for the last encoder seen."""

    span: slice
    weights: Optional[torch.Tensor] = None
    encoded: list = field(default_factory=list)

    @classmethod
    def of(cls, model: torch.nn.Module, layout: WeightLayout) -> Optional["_EncoderReuse"]:
        if not (hasattr(model, "encoder") and hasattr(model, "head")):
            return None
        try:
            span = layout.span("encoder.")
        except ValueError:  # not one contiguous range: nothing to compare
            return None
        return cls(span)

    def lookup(self, weights: torch.Tensor) -> Optional[list]:
        if self.weights is not None and torch.equal(self.weights, weights[self.span]):
            return self.encoded
        return None

    def keep(self, weights: torch.Tensor, encoded: list) -> None:
        self.weights, self.encoded = weights[self.span].clone(), encoded


class Evaluator:
    """Scores weight vectors on the test set. With ``device_data`` the batches come from the run's tensors
    where it computes; the predictions are scored on the host against ``y``."""

    def __init__(self, model: torch.nn.Module, layout: WeightLayout, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                 domains: Optional[torch.Tensor] = None, domain_names: Optional[list[str]] = None,
                 device_data: Any = None, client_classes: Optional[dict[int, list[int]]] = None,
                 precision: str = "fp32", channels_last: bool = False):
        self.model, self.layout, self.x, self.y, self.batch_size = model, layout, x, y, batch_size
        self.domains, self.domain_names = domains, domain_names
        self.device_data = device_data
        self.client_classes = client_classes  # eval.client_classes: every score adds client_class_accuracy
        # The training's train.precision and train.channels_last: the test pass computes as the steps do.
        self.precision, self.channels_last = precision, channels_last
        self._reuse: Optional[_EncoderReuse] = None  # see encoder_reuse

    def _chunks(self, xb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``xb`` in the pieces one forward pass computes. A CPU forward pass over a whole eval batch (1024 by
        default) works on activations far larger than the caches: chunks of CPU_CHUNK are 1.2-1.8x faster
        (benchmarks/eval_chunks.py) and give the same logits up to float rounding (bit-identical on the FMNIST CNN
        at 1024; ~1e-7 apart at odd sizes, where the CPU kernels for another batch size add in another order).
        The batch stays the unit of the loss sums."""
        chunks = xb.split(CPU_CHUNK) if xb.device.type == "cpu" and len(xb) > CPU_CHUNK else (xb,)
        if self.channels_last and xb.dim() == 4:
            return tuple(c.contiguous(memory_format=torch.channels_last) for c in chunks)
        return chunks

    def _each(self, pieces, fn) -> list:
        """``fn`` of each piece, each call in an autocast region of the run's precision."""
        out = []
        for piece in pieces:
            with autocast(piece.device, self.precision):
                out.append(fn(piece))
        return out

    def _forward(self, xb: torch.Tensor, features: bool = False):
        outs = self._each(self._chunks(xb), self.model.forward_features if features else self.model)
        parts = [tuple(o.float() for o in out) if features else out.float() for out in outs]
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(p) for p in zip(*parts)) if features else torch.cat(parts)

    @contextmanager
    def encoder_reuse(self):
        """Within it, ``evaluate`` keeps the test set's encoder outputs of the last model it scored and reuses
        them for a model whose encoder weights are the same, bit for bit: clients that share a body and keep
        their own heads (FedRep's, scored under the averaged body) cost one encoder pass and a head pass each,
        with the logits a whole forward pass computes (the same ops on the same chunks). Dropped on exit."""
        self._reuse = _EncoderReuse.of(self.model, self.layout)
        try:
            yield self
        finally:
            self._reuse = None

    def _logits(self, weights: torch.Tensor):
        """(logits, labels) of every test batch under ``weights`` (already loaded into the model)."""
        reuse = self._reuse
        if reuse is None:
            for xb, yb in self._batches():
                yield self._forward(xb), yb
            return
        encoded = reuse.lookup(weights)
        if encoded is None:
            encoded = []
            for xb, yb in self._batches():
                encoded.append((self._each(self._chunks(xb), self.model.encoder), yb))
            reuse.keep(weights, encoded)
        for zs, yb in encoded:
            parts = [logits.float() for logits in self._each(zs, self.model.head)]
            yield (parts[0] if len(parts) == 1 else torch.cat(parts)), yb

    def _batches(self):
        """(inputs, labels) of the test set in order, where the model is."""
        for start in range(0, len(self.y), self.batch_size):
            stop = start + self.batch_size
            if self.device_data is None:
                yield self.x[start:stop], self.y[start:stop]
            else:
                yield self.device_data.test_batch(start, stop)

    def score(self, predictions: torch.Tensor, logits: Optional[torch.Tensor] = None) -> dict[str, Any]:
        """Accuracy of predicted labels for the whole test set, per domain too where the data has domains
        (``domain_accuracy``: domain name -> accuracy), per client's classes where the run asks for it
        (``client_class_accuracy``); ``test_loss`` when logits are given."""
        correct = predictions.cpu() == self.y  # scored on the host, where the domain ids are
        out: dict[str, Any] = {"accuracy": float(correct.double().mean())}
        if logits is not None:
            out["test_loss"] = float(F.cross_entropy(logits.cpu(), self.y))
        if self.domains is not None:
            out["domain_accuracy"] = {
                name: float(correct[self.domains == d].double().mean())
                for d, name in enumerate(self.domain_names) if bool((self.domains == d).any())}
        if self.client_classes is not None:
            out["client_class_accuracy"] = class_set_accuracy(correct, self.y, self.client_classes)
        return out

    @torch.no_grad()
    def evaluate(self, weights: torch.Tensor) -> dict[str, Any]:
        self.layout.load(self.model, weights)
        self.model.eval()
        preds, losses = [], []
        for logits, yb in self._logits(weights):
            losses.append(F.cross_entropy(logits, yb, reduction="sum").double())
            preds.append(logits.argmax(1))
        out = self.score(torch.cat(preds).cpu())
        # Read once at the end, not per batch: a per-batch float() would wait for the device each time. The
        # batch sums are added in float64 and in order, as the Python float sum before them was.
        out["test_loss"] = float(sum(losses[1:], losses[0])) / len(self.y) if losses else 0.0
        return out

    @torch.no_grad()
    def features(self, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z, logits, labels) of the whole test set, for methods that classify in feature space."""
        self.layout.load(self.model, weights)
        self.model.eval()
        zs, logits = [], []
        for xb, _ in self._batches():
            z, out = self._forward(xb, features=True)
            zs.append(z)
            logits.append(out)
        z = torch.cat(zs)
        return z, torch.cat(logits), self.y.to(z.device)

    @torch.no_grad()
    def correct(self, weights: torch.Tensor, indices: torch.Tensor) -> int:
        """How many of the test samples ``indices`` (host indices) the model ``weights`` classifies right."""
        self.layout.load(self.model, weights)
        self.model.eval()
        hits = []
        for start in range(0, len(indices), self.batch_size):
            part = indices[start: start + self.batch_size]
            if self.device_data is None:
                xb, yb = self.x[part], self.y[part]
            else:
                xb, yb = self.device_data.test_batch_at(part)
            hits.append((self._forward(xb).argmax(1) == yb).sum())
        return int(torch.stack(hits).sum()) if hits else 0


def class_set_accuracy(correct: torch.Tensor, labels: torch.Tensor, class_sets: dict[int, list[int]]
                       ) -> dict[str, float]:
    """Accuracy on the test samples of each client's classes (FedCADO Table 2's per-client columns): client id
    (as a string, as JSON keeps it) -> the share of ``correct`` among the samples whose label is one of the
    client's; a client whose classes have no test sample is left out."""
    out = {}
    for cid, classes in class_sets.items():
        mask = torch.isin(labels, torch.as_tensor(classes, dtype=labels.dtype, device=labels.device))
        if bool(mask.any()):
            out[str(cid)] = float(correct[mask].double().mean())
    return out


def mean_metrics(per_model: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over several models' test metrics (one model per client): every scalar, the per-domain
    accuracies too, plus the spread of accuracy over the models."""
    accs = [m["accuracy"] for m in per_model]
    out: dict[str, Any] = {k: statistics.fmean(m[k] for m in per_model)
                           for k, v in per_model[0].items() if isinstance(v, (int, float))}
    for key in ("domain_accuracy", "client_class_accuracy"):
        if key in per_model[0]:
            out[key] = {d: statistics.fmean(m[key][d] for m in per_model) for d in per_model[0][key]}
    out["client_accuracy_min"], out["client_accuracy_max"] = min(accs), max(accs)
    return out


# ---- personalised evaluation: every client's own model on its own test split ----------------------------
BOTTOM_SHARE = 0.1  # personal_accuracy_bottom10: the mean over the worst-scoring tenth of the clients


def personal_metrics(correct: list[int], sizes: list[int]) -> dict[str, Any]:
    """Personalised accuracy from each client's hits and test-split size: ``personal_accuracy`` (all hits over
    all test samples: the sample-weighted mean), ``personal_accuracy_min``, ``personal_accuracy_bottom10``
    (the plain mean over the ceil(10 %) worst clients) and ``personal_client_accuracy`` (per client; None for a
    client whose split is empty, which the minimum and the bottom tenth leave out)."""
    per = [c / n if n else None for c, n in zip(correct, sizes)]
    scored = sorted(a for a in per if a is not None)
    if not scored:
        raise ValueError("no client has a personal test sample; raise eval.personal_test_fraction")
    worst = scored[:max(1, math.ceil(BOTTOM_SHARE * len(scored)))]
    return {"personal_accuracy": sum(correct) / sum(sizes), "personal_accuracy_min": scored[0],
            "personal_accuracy_bottom10": statistics.fmean(worst), "personal_client_accuracy": per}


def evaluate_personal(evaluator: Evaluator, splits: list, personal_model: Callable[[int], torch.Tensor]
                      ) -> dict[str, Any]:
    """``personal_metrics`` of the models ``personal_model(client_id)`` on the clients' test splits
    (``splits[client_id]``: indices into the test set); clients with an empty split build no model."""
    correct, sizes = [], []
    for cid, idx in enumerate(splits):
        idx = torch.as_tensor(idx, dtype=torch.long)
        correct.append(evaluator.correct(personal_model(cid), idx) if len(idx) else 0)
        sizes.append(len(idx))
    return personal_metrics(correct, sizes)


def first_best(values) -> int:
    """Index of the first maximum of ``values`` (the round a run picks by a score: the earliest on ties)."""
    values = list(values)
    return max(range(len(values)), key=lambda i: (values[i], -i))


def rounds_since_best(values) -> int:
    """Rounds after the first maximum of ``values`` (0 when the last value is the best): how long a run has gone
    without improving its validation accuracy (``eval.early_stop``)."""
    values = list(values)
    return len(values) - 1 - first_best(values)
