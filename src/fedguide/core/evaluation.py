"""Evaluation of a weight vector on the held-out test set."""
from __future__ import annotations

import statistics
from typing import Any, Optional

import torch
import torch.nn.functional as F

from fedguide.core.weights import WeightLayout


class Evaluator:
    def __init__(self, model: torch.nn.Module, layout: WeightLayout, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                 domains: Optional[torch.Tensor] = None, domain_names: Optional[list[str]] = None):
        self.model, self.layout, self.x, self.y, self.batch_size = model, layout, x, y, batch_size
        self.domains, self.domain_names = domains, domain_names

    def score(self, predictions: torch.Tensor, logits: Optional[torch.Tensor] = None) -> dict[str, Any]:
        """Accuracy of predicted labels for the whole test set, per domain too where the data has domains
        (``domain_accuracy``: domain name -> accuracy); ``test_loss`` when logits are given."""
        correct = predictions == self.y
        out: dict[str, Any] = {"accuracy": float(correct.double().mean())}
        if logits is not None:
            out["test_loss"] = float(F.cross_entropy(logits, self.y))
        if self.domains is not None:
            out["domain_accuracy"] = {
                name: float(correct[self.domains == d].double().mean())
                for d, name in enumerate(self.domain_names) if bool((self.domains == d).any())}
        return out

    @torch.no_grad()
    def evaluate(self, weights: torch.Tensor) -> dict[str, Any]:
        self.layout.load(self.model, weights)
        self.model.eval()
        preds, loss_sum = [], 0.0
        for start in range(0, len(self.y), self.batch_size):
            xb, yb = self.x[start: start + self.batch_size], self.y[start: start + self.batch_size]
            logits = self.model(xb)
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            preds.append(logits.argmax(1))
        out = self.score(torch.cat(preds))
        out["test_loss"] = loss_sum / len(self.y)
        return out

    @torch.no_grad()
    def features(self, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z, logits, labels) of the whole test set, for methods that classify in feature space."""
        self.layout.load(self.model, weights)
        self.model.eval()
        zs, logits = [], []
        for start in range(0, len(self.y), self.batch_size):
            z, out = self.model.forward_features(self.x[start: start + self.batch_size])
            zs.append(z)
            logits.append(out)
        return torch.cat(zs), torch.cat(logits), self.y


def mean_metrics(per_model: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over several models' test metrics (one model per client): every scalar, the per-domain
    accuracies too, plus the spread of accuracy over the models."""
    accs = [m["accuracy"] for m in per_model]
    out: dict[str, Any] = {k: statistics.fmean(m[k] for m in per_model)
                           for k, v in per_model[0].items() if isinstance(v, (int, float))}
    if "domain_accuracy" in per_model[0]:
        out["domain_accuracy"] = {d: statistics.fmean(m["domain_accuracy"][d] for m in per_model)
                                  for d in per_model[0]["domain_accuracy"]}
    out["client_accuracy_min"], out["client_accuracy_max"] = min(accs), max(accs)
    return out
