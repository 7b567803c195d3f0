"""(ε, δ) of the Gaussian mechanism: the classic bound and the analytic one (Balle & Wang 2018) on
hand-computed cases, composition, and FedDISC's noised-mean sensitivity (on the features, and on
unCLIP's standardised embeddings)."""
import math

import pytest

from fedguide.guidance.privacy import (GaussianPrivacy, analytic_delta, analytic_epsilon, classic_epsilon, compose_mu,
                                       noised_mean_privacy, standardised_noised_mean_privacy)
from fedguide.registry import ConfigError


def test_classic_epsilon_hand_computed():
    # √(2 ln(1.25 / 1e-5)) = √(2 · 11.7360690) = √23.4721380 = 4.8448052
    assert classic_epsilon(1.0, 1e-5) == pytest.approx(4.8448052, abs=1e-6)
    assert classic_epsilon(0.5, 1e-5) == pytest.approx(4.8448052 / 2, abs=1e-6)


def test_analytic_delta_hand_computed():
    # ε = 1, μ = 1: Φ(0.5 − 1) − e·Φ(−0.5 − 1) = Φ(−0.5) − e·Φ(−1.5)
    #             = 0.30853754 − 2.71828183 · 0.06680720 = 0.30853754 − 0.18160081 = 0.12693673
    assert analytic_delta(1.0, 1.0) == pytest.approx(0.12693673, abs=1e-7)
    # ε = 0: Φ(μ/2) − Φ(−μ/2) = 2Φ(0.5) − 1 = 0.38292492
    assert analytic_delta(0.0, 1.0) == pytest.approx(0.38292492, abs=1e-7)


def test_analytic_epsilon_inverts_delta():
    assert analytic_epsilon(1.0, 0.12693673) == pytest.approx(1.0, abs=1e-6)
    for mu, eps in ((0.3, 0.2), (2.0, 3.0), (10.0, 40.0)):
        assert analytic_epsilon(mu, analytic_delta(eps, mu)) == pytest.approx(eps, rel=1e-6)
    assert analytic_epsilon(1.0, 0.5) == 0.0  # δ above δ(0): no ε needed


def test_analytic_is_tighter_than_classic_where_classic_holds():
    mu, delta = 0.1, 1e-5
    classic = classic_epsilon(mu, delta)
    assert classic < 1  # in the range the classic proof covers
    assert 0 < analytic_epsilon(mu, delta) < classic


def test_epsilon_grows_with_mu_and_stays_finite_for_weak_noise():
    eps = [analytic_epsilon(mu, 1e-5) for mu in (0.5, 1.0, 5.0, 50.0)]
    assert eps == sorted(eps) and len(set(eps)) == 4
    assert math.isfinite(eps[-1])  # log-space evaluation: no overflow of e^ε


def test_composition_of_gaussian_mechanisms():
    assert compose_mu([3.0, 4.0]) == pytest.approx(5.0)
    assert compose_mu([2.0]) == 2.0
    with pytest.raises(ConfigError):
        compose_mu([])


def test_noised_mean_sensitivity_hand_computed():
    # ᾱ = 0.75, B = 1, one sample: Δ = 2·1·√0.75 = 1.7320508, σ = √0.25 = 0.5, μ = 3.4641016
    single = noised_mean_privacy(0.75, 1.0, 1, 1e-5)
    assert single.sensitivity == pytest.approx(1.7320508, abs=1e-7)
    assert single.sigma == pytest.approx(0.5)
    assert single.mu == pytest.approx(3.4641016, abs=1e-7)
    # a mean over 4 samples moves 4 times less: μ = 0.8660254
    mean4 = noised_mean_privacy(0.75, 1.0, 4, 1e-5)
    assert mean4.mu == pytest.approx(0.8660254, abs=1e-7)
    assert mean4.epsilon < single.epsilon
    report = mean4.as_dict()
    assert report["epsilon"] == pytest.approx(analytic_epsilon(0.8660254, 1e-5), rel=1e-6)
    assert report["classic_valid"] is False  # classic ε = 4.196 is outside its proof's range


def test_standardised_noised_mean_sensitivity_hand_computed():
    # ᾱ = 0.64, B = 2, c = 3, smallest normaliser std 0.5, a mean of 4 features:
    # s = (c·z − μ)/σ moves by at most c·(2B/m)/min σ = 3·1/0.5 = 6, so Δ = 6·√0.64 = 4.8; σ = √0.36 = 0.6; μ = 8
    q = standardised_noised_mean_privacy(0.64, 2.0, 3.0, 0.5, 4, 1e-5)
    assert q.sensitivity == pytest.approx(4.8)
    assert q.sigma == pytest.approx(0.6)
    assert q.mu == pytest.approx(8.0)
    assert q.epsilon == pytest.approx(analytic_epsilon(8.0, 1e-5), rel=1e-9)
    # c = 1 and unit stds: the features' own figure
    assert standardised_noised_mean_privacy(0.64, 2.0, 1.0, 1.0, 4, 1e-5).mu == noised_mean_privacy(0.64, 2.0, 4, 1e-5).mu


@pytest.mark.parametrize("call", [
    lambda: classic_epsilon(1.0, 0.0),
    lambda: classic_epsilon(0.0, 1e-5),
    lambda: GaussianPrivacy(1.0, 0.0, 1e-5),
    lambda: noised_mean_privacy(1.0, 1.0, 1, 1e-5),  # ᾱ = 1 adds no noise
    lambda: noised_mean_privacy(0.5, 1.0, 0, 1e-5),
    lambda: standardised_noised_mean_privacy(0.5, 1.0, 1.0, 0.0, 2, 1e-5),  # a zero std: unbounded
    lambda: standardised_noised_mean_privacy(0.5, 1.0, 0.0, 1.0, 2, 1e-5),
])
def test_bad_input_is_a_config_error(call):
    with pytest.raises(ConfigError):
        call()
