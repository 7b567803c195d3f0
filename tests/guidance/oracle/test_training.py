"""The oracle's fit: its features separate the pool's classes on the part of the pool held out from training,
better than the same network untrained; the fit is deterministic whatever the caller's thread count, its seed
matters, and the caller's torch stream is left alone."""
import numpy as np
import pytest
import torch

from fedguide.guidance.oracle.network import OracleNet, oracle_input
from fedguide.guidance.oracle.training import OracleSettings, holdout_positions, pool_features, train_oracle

# A quick fit for the tests: sklearn's 1797 handwritten 8x8 digits stand in for a pool.
QUICK = OracleSettings(epochs=1, min_steps=40, width=64, channels=(8, 16, 32))


@pytest.fixture(scope="module")
def digits_pool():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy((bunch.images / 16.0).astype(np.float32)).unsqueeze(1) * 2 - 1
    return oracle_input(x), torch.from_numpy(bunch.target.astype(np.int64))


def probe_accuracy(train_x, train_y, test_x, test_y) -> float:
    from sklearn.linear_model import LogisticRegression

    probe = LogisticRegression(max_iter=2000).fit(train_x.numpy(), train_y.numpy())
    return float(probe.score(test_x.numpy(), test_y.numpy()))


def nearest_mean_accuracy(train_x, train_y, test_x, test_y) -> float:
    means = torch.stack([train_x[train_y == c].mean(0) for c in range(10)])
    return float((torch.cdist(test_x, means).argmin(1) == test_y).float().mean())


def test_features_separate_the_pools_classes_on_its_held_out_part(digits_pool):
    images, labels = digits_pool
    trained = train_oracle(images, labels, 10, QUICK)
    held = torch.from_numpy(holdout_positions(labels.numpy(), QUICK.holdout_fraction, QUICK.seed))
    fit = torch.from_numpy(np.setdiff1d(np.arange(len(labels)), held.numpy()))
    assert trained.report["holdout_images"] == len(held) > 150 and trained.report["train_images"] == len(fit)
    features = pool_features(trained.net, images)
    parts = (features[fit], labels[fit], features[held], labels[held])
    trained_probe = probe_accuracy(*parts)
    assert trained_probe >= 0.9  # chance: 0.1
    assert trained.report["holdout_accuracy"] >= 0.85 and trained.report["pool_accuracy"] >= 0.85
    assert nearest_mean_accuracy(*parts) >= 0.85
    # the same network untrained: its features separate the digits far less (measured: probe 0.77, trained 0.98)
    torch.manual_seed(0)
    raw = pool_features(OracleNet(10, QUICK.width, QUICK.channels).eval(), images)
    assert trained_probe > probe_accuracy(raw[fit], labels[fit], raw[held], labels[held]) + 0.1
    # prototypes: the class means over the whole pool
    torch.testing.assert_close(trained.prototypes[3], features[labels == 3].mean(0))


def test_training_is_deterministic_and_its_seed_matters(digits_pool):
    images, labels = digits_pool[0][:300], digits_pool[1][:300]
    settings = OracleSettings(min_steps=15, epochs=1, width=32, channels=(8, 16, 32))
    reseeded = OracleSettings(min_steps=15, epochs=1, width=32, channels=(8, 16, 32), seed=1)
    a = train_oracle(images, labels, 10, settings)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's thread count changes nothing: the fit runs on one thread
    try:
        b = train_oracle(images, labels, 10, settings)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    other = train_oracle(images, labels, 10, reseeded)
    state_a, state_b = a.net.state_dict(), b.net.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(pool_features(a.net, images), pool_features(b.net, images))
    assert torch.equal(a.prototypes, b.prototypes)
    assert not torch.equal(pool_features(other.net, images), pool_features(a.net, images))


def test_training_leaves_the_callers_torch_stream_alone(digits_pool):
    images, labels = digits_pool[0][:100], digits_pool[1][:100]
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    train_oracle(images, labels, 10, OracleSettings(min_steps=2, epochs=1, width=8))
    assert torch.equal(torch.rand(3), want)
