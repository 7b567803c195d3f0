"""Evaluation of a weight vector on the held-out test set."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedguide.fl.weights import WeightLayout
from fedguide.models.split import SplitModel


class Evaluator:
    def __init__(self, model: SplitModel, layout: WeightLayout, x: torch.Tensor, y: torch.Tensor, batch_size: int):
        self.model, self.layout, self.x, self.y, self.batch_size = model, layout, x, y, batch_size

    @torch.no_grad()
    def evaluate(self, weights: torch.Tensor) -> dict[str, float]:
        self.layout.load(self.model, weights)
        self.model.eval()
        correct, loss_sum = 0, 0.0
        for start in range(0, len(self.y), self.batch_size):
            xb, yb = self.x[start: start + self.batch_size], self.y[start: start + self.batch_size]
            logits = self.model(xb)
            loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
        n = len(self.y)
        return {"accuracy": correct / n, "test_loss": loss_sum / n}

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
