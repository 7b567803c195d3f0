"""Linear-probe evaluation of a self-supervised encoder: FedEMA's, and FedDifRC's self-supervised variant's (its
Sec. 4.3 reports linear evaluation without defining its protocol, so the protocol followed is FedEMA's released
one, the source of FedDifRC Table 5's self-supervised baselines).

The global encoder h is frozen and its features computed once per evaluation, in eval mode, on the training
samples (``probe_samples``: all of them by default, the clients' union) and on the test set.

- ``probe: released`` (the default), EasyFL's applications/fedssl/linear_evaluation.py (lines 118-159): a single
  linear layer (``nn.Linear(d, classes)``) trained with Adam at lr 3e-3 for 200 epochs over the training features
  in batches of 2048, in a fixed order (its feature loader has ``shuffle=False``, line 49), cross-entropy; then
  scored on the test features. The released script reports the mean of per-batch test accuracies (line 76),
  which weighs a short last batch more; the share of all test samples classified right is reported here.
  Its features come from the test-time transform (eval_dataset.py line 10), as here (no augmentation).
- ``probe: sklearn``: a logistic regression (scikit-learn, on standardised features); ``probe_samples: 2000``
  was this project's earlier default.

The accuracy is reported as ``accuracy`` (the run's headline metric) and ``probe_accuracy``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from fedguide.core.seeding import derive_seed


class ProbeParams(BaseModel):
    """The probe's settings, shared by the methods that evaluate by linear probe."""

    probe: Literal["released", "sklearn"] = Field(
        "released", description="released: FedEMA's linear layer trained with Adam (EasyFL linear_evaluation.py); "
                                "sklearn: a logistic regression on standardised features")
    probe_samples: Optional[int] = Field(None, ge=10, description="training images the probe fits on (a seeded "
                                                                   "subset); null = every training sample")
    probe_epochs: int = Field(200, ge=1, description="released probe: epochs over the training features (EasyFL: 200)")
    probe_lr: float = Field(3e-3, gt=0.0, description="released probe: Adam's learning rate (EasyFL: 3e-3)")
    probe_batch: int = Field(2048, ge=1, description="released probe: batch size, in a fixed order (EasyFL: 2048)")


def linear_probe(train_features: np.ndarray, train_labels: np.ndarray, test_features: np.ndarray,
                 test_labels: np.ndarray, seed: int = 0) -> float:
    """Test accuracy of a logistic regression on standardised frozen features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000, random_state=seed))
    probe.fit(train_features, train_labels)
    return float(probe.score(test_features, test_labels))


def released_probe(train_features: torch.Tensor, train_labels: torch.Tensor, test_features: torch.Tensor,
                   test_labels: torch.Tensor, num_classes: int, epochs: int, lr: float, batch: int,
                   seed: int = 0) -> float:
    """Test accuracy of one linear layer trained on the features as EasyFL's linear_evaluation.py does: Adam,
    cross-entropy, ``epochs`` passes in batches of ``batch`` in the given order. Its initialisation is drawn from
    ``seed`` and the caller's random streams are left as they were."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = torch.nn.Linear(train_features.shape[1], num_classes)
    layer = layer.to(train_features.device)
    optimizer = torch.optim.Adam(layer.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(train_labels), batch):
            loss = F.cross_entropy(layer(train_features[start:start + batch]), train_labels[start:start + batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        hits = (layer(test_features).argmax(1) == test_labels).sum()
    return float(hits) / len(test_labels)


class LinearProbe:
    """``probe(global_weights)`` -> {"accuracy", "probe_accuracy"} of the run's encoder under those weights."""

    def __init__(self, run: Any, params: ProbeParams):
        self.run, self.params = run, params
        self._model = None

    def _pool(self) -> np.ndarray:
        # every sample some client trains on (the clients' union, as the probe of a label-free federation)
        pool = np.unique(np.concatenate([np.asarray(i, dtype=np.int64) for i in self.run.data.client_indices]))
        samples = self.params.probe_samples
        if samples is not None and len(pool) > samples:
            rng = np.random.default_rng(np.random.SeedSequence([self.run.seed, 0xB0]))
            pool = np.sort(rng.choice(pool, samples, replace=False))
        return pool

    def _encode(self, batches) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([self._model.encoder(x).float() for x in batches])

    # Through the run's device data (open_run always builds it): the inputs a training step or the test pass gets,
    # standardised where the tensors are kept, without augmentation.
    def _train_batches(self, pool: np.ndarray):
        data, size = self.run.device_data, self.run.train.eval_batch_size
        idx = torch.from_numpy(pool)
        for s in range(0, len(idx), size):
            yield data.train_batch(data.indices(idx[s:s + size]), augment=False)[0]

    def _test_batches(self):
        data, size, n = self.run.device_data, self.run.train.eval_batch_size, len(self.run.data.splits.test_y)
        for s in range(0, n, size):
            yield data.test_batch(s, s + size)[0]

    def __call__(self, global_weights: torch.Tensor) -> dict[str, float]:
        run, p = self.run, self.params
        if self._model is None:
            with torch.random.fork_rng(devices=[]):  # building a model leaves every random stream untouched
                self._model = run.make_model()
            self._model.to(run.device).eval()
        run.layout.load(self._model, global_weights.to(run.device))
        splits, pool = run.data.splits, self._pool()
        train_z, test_z = self._encode(self._train_batches(pool)), self._encode(self._test_batches())
        train_y = splits.train_y[torch.from_numpy(pool)]
        if p.probe == "sklearn":
            accuracy = linear_probe(train_z.cpu().numpy(), train_y.numpy(), test_z.cpu().numpy(),
                                    splits.test_y.numpy(), seed=run.seed)
        else:
            accuracy = released_probe(train_z, train_y.to(train_z.device), test_z, splits.test_y.to(test_z.device),
                                      splits.num_classes, p.probe_epochs, p.probe_lr, p.probe_batch,
                                      seed=derive_seed(run.seed, "probe"))
        return {"accuracy": accuracy, "probe_accuracy": accuracy}
