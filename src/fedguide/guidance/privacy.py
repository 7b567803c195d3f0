"""(ε, δ) of a Gaussian mechanism: the classic bound and the analytic Gaussian mechanism.

A release M(D) = q(D) + N(0, σ²I) of a query q whose L2 sensitivity (the largest ‖q(D) − q(D')‖ over
neighbouring data sets) is Δ is characterised by the one number μ = Δ/σ:

- Classic bound (Dwork & Roth 2014, Thm. A.1): M is (ε, δ)-DP for ε = √(2 ln(1.25/δ))·μ, a statement
  proven for ε < 1 only; ``classic_epsilon`` returns the formula's value and ``GaussianPrivacy`` says
  whether it lies in the proven range.
- Analytic Gaussian mechanism (Balle & Wang 2018, Thm. 8): M is (ε, δ)-DP exactly when
  δ ≥ Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ); ``analytic_epsilon`` solves this for the smallest ε (the tight
  value, valid for every ε). The second term is evaluated in log space, so large ε (small σ) neither
  overflows nor cancels.
- Composition: k Gaussian releases of the same data with ratios μ_i compose exactly into one with
  μ = √(Σ μ_i²) (Gaussian differential privacy, Dong, Roth & Su 2019), so a client's whole upload is
  one Gaussian mechanism too (``compose_mu``).

``noised_mean_privacy`` applies this to the diffusion-style noising z̄ = √ᾱ·z + √(1−ᾱ)·ε of a mean z
over m samples whose norms are at most B (FedDISC Eq. 5): replacing one sample moves the mean by at
most 2B/m, so Δ = 2B√ᾱ/m and σ = √(1−ᾱ). The assumption stated there, and in the FedDISC method, is
that the grouping of samples into the mean (the pseudo-class and the k-means cluster) is held fixed;
the clustering itself is data-dependent and is not covered by this figure.

``standardised_noised_mean_privacy`` is the same for unCLIP's noising of image embeddings (FedDISC's
released code): the mean is mapped to the embedding scale by a public factor c and standardised
coordinate-wise with the image normaliser's public mean μ and std σ, s = (c·z − μ)/σ, and s is noised,
√ᾱ·s + √(1−ᾱ)·ε (unstandardising afterwards is post-processing). Replacing one sample moves s by at most
c·(2B/m)/min_i σ_i, so Δ = 2Bc√ᾱ/(m·min σ): a coordinate of small std magnifies a change along it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from fedguide.registry import ConfigError


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"δ must lie in (0, 1), got {delta}; 1e-5 is a common choice")


def _check_mu(mu: float) -> None:
    if not (mu > 0.0 and math.isfinite(mu)):
        raise ConfigError(f"μ = sensitivity / noise std must be a positive finite number, got {mu}")


def classic_epsilon(mu: float, delta: float) -> float:
    """ε = √(2 ln(1.25/δ))·μ (Dwork & Roth Thm. A.1; a proven guarantee only where it is below 1)."""
    _check_mu(mu)
    _check_delta(delta)
    return math.sqrt(2.0 * math.log(1.25 / delta)) * mu


def analytic_delta(epsilon: float, mu: float) -> float:
    """The smallest δ for which a Gaussian mechanism of ratio μ is (ε, δ)-DP (Balle & Wang 2018, Thm. 8)."""
    from scipy.special import log_ndtr, ndtr

    _check_mu(mu)
    if epsilon < 0:
        raise ConfigError(f"ε must be non-negative, got {epsilon}")
    first = float(ndtr(mu / 2.0 - epsilon / mu))
    second = math.exp(epsilon + float(log_ndtr(-mu / 2.0 - epsilon / mu)))
    return max(first - second, 0.0)


def analytic_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with analytic_delta(ε, μ) ≤ δ (δ(ε) falls monotonically in ε)."""
    from scipy.optimize import brentq

    _check_mu(mu)
    _check_delta(delta)
    if analytic_delta(0.0, mu) <= delta:
        return 0.0
    high = 1.0
    while analytic_delta(high, mu) > delta:
        high *= 2.0
        if high > 1e7:  # μ of the order of 1e3 already needs ε near 5e5; beyond, nothing is protected
            return math.inf
    return float(brentq(lambda e: analytic_delta(e, mu) - delta, 0.0, high, xtol=1e-12, rtol=1e-10))


def compose_mu(mus: Sequence[float]) -> float:
    """One Gaussian mechanism equivalent to several on the same data: μ = √(Σ μ_i²)."""
    if not mus:
        raise ConfigError("compose_mu needs at least one mechanism")
    for mu in mus:
        _check_mu(mu)
    return math.sqrt(sum(mu * mu for mu in mus))


@dataclass(frozen=True)
class GaussianPrivacy:
    """The (ε, δ) of one Gaussian mechanism of sensitivity Δ and noise std σ."""

    sensitivity: float
    sigma: float
    delta: float

    def __post_init__(self) -> None:
        if not (self.sensitivity > 0 and math.isfinite(self.sensitivity)):
            raise ConfigError(f"sensitivity must be a positive finite number, got {self.sensitivity}")
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ConfigError(f"the noise std σ must be positive (no noise protects nothing), got {self.sigma}")
        _check_delta(self.delta)

    @property
    def mu(self) -> float:
        return self.sensitivity / self.sigma

    @property
    def epsilon(self) -> float:
        """The tight ε of the analytic Gaussian mechanism."""
        return analytic_epsilon(self.mu, self.delta)

    @property
    def epsilon_classic(self) -> float:
        return classic_epsilon(self.mu, self.delta)

    @property
    def classic_valid(self) -> bool:
        """Whether the classic bound's ε lies in the range its proof covers (ε < 1)."""
        return self.epsilon_classic < 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "mu": self.mu, "epsilon": self.epsilon, "epsilon_classic": self.epsilon_classic,
                "classic_valid": self.classic_valid}


def noised_mean_privacy(alpha_bar: float, norm_bound: float, count: int, delta: float) -> GaussianPrivacy:
    """z̄ = √ᾱ·mean(z_1..z_m) + √(1−ᾱ)·ε with ‖z_i‖ ≤ B, one sample replaced: Δ = 2B√ᾱ/m, σ = √(1−ᾱ)."""
    if not 0.0 < alpha_bar < 1.0:
        raise ConfigError(f"ᾱ must lie in (0, 1) for the noising to add noise, got {alpha_bar}")
    if not norm_bound > 0:
        raise ConfigError(f"the feature norm bound must be positive, got {norm_bound}")
    if count < 1:
        raise ConfigError(f"a mean is over at least one sample, got {count}")
    return GaussianPrivacy(2.0 * norm_bound * math.sqrt(alpha_bar) / count, math.sqrt(1.0 - alpha_bar), delta)


def standardised_noised_mean_privacy(alpha_bar: float, norm_bound: float, scale: float, std_min: float, count: int,
                                     delta: float) -> GaussianPrivacy:
    """√ᾱ·(c·mean(z_1..z_m) − μ)/σ + √(1−ᾱ)·ε with ‖z_i‖ ≤ B, one sample replaced: Δ = 2Bc√ᾱ/(m·min σ)."""
    if not (scale > 0 and math.isfinite(scale)):
        raise ConfigError(f"the embedding scale c must be a positive finite number, got {scale}")
    if not (std_min > 0 and math.isfinite(std_min)):
        raise ConfigError(f"the normaliser's smallest std must be positive, got {std_min}; a zero std makes the "
                          "standardised embedding unbounded")
    return noised_mean_privacy(alpha_bar, norm_bound * scale / std_min, count, delta)
