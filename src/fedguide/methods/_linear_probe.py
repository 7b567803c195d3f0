"""Linear-probe evaluation of a self-supervised encoder (FedDifRC Sec. 4.3's protocol, shared by its
self-supervised variant and the self-supervised baselines of its Table 5).

The global encoder h is frozen; a logistic regression (scikit-learn, on standardised features) is fitted on
h(x) of a seeded subset of the training pool (``samples`` images, the same subset every round) and scored on
the whole test set. The accuracy is reported as ``accuracy`` (the run's headline metric) and
``probe_accuracy``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch



def linear_probe(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
                 test_labels: np.ndarray, seed: int = 0) -> float:
    """Test accuracy of a logistic regression on standardised frozen features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000, random_state=seed))
    probe.fit(train_features, train_labels)
    return float(probe.score(test_features, test_labels))


class LinearProbe:
    """``probe(global_weights)`` -> {"accuracy", "probe_accuracy"} of the run's encoder under those weights."""

    def __init__(self, run: Any, samples: int):
        self.run, self.samples = run, samples
        self._model = None

    def _pool(self) -> np.ndarray:
        # every sample some client trains on (the clients' union, as the probe of a label-free federation)
        pool = np.unique(np.concatenate([np.asarray(i, dtype=np.int64) for i in self.run.data.client_indices]))
        if len(pool) > self.samples:
            rng = np.random.default_rng(np.random.SeedSequence([self.run.seed, 0xB0]))
            pool = np.sort(rng.choice(pool, self.samples, replace=False))
        return pool

    def _encode(self, x: torch.Tensor) -> np.ndarray:
        batch, device = self.run.train.eval_batch_size, self.run.device
        with torch.no_grad():
            parts = [self._model.encoder(x[s:s + batch].to(device)).float().cpu() for s in range(0, len(x), batch)]
        return torch.cat(parts).numpy()

    def __call__(self, global_weights: torch.Tensor) -> dict[str, float]:
        run = self.run
        if self._model is None:
            with torch.random.fork_rng(devices=[]):  # building a model leaves every random stream untouched
                self._model = run.make_model()
            self._model.to(run.device).eval()
        run.layout.load(self._model, global_weights.to(run.device))
        splits, pool = run.data.splits, self._pool()
        accuracy = linear_probe(self._encode(splits.train_x[torch.from_numpy(pool)]), splits.train_y[pool].numpy(),
                                self._encode(splits.test_x), splits.test_y.numpy(), seed=run.seed)
        return {"accuracy": accuracy, "probe_accuracy": accuracy}
