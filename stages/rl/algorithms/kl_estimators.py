"""The built-in KL estimators, one ``register_kl_estimator`` each (stages/rl/algorithms/registry.py).

Per-token estimates of KL(policy || reference) from the sampled tokens' log r = logp - ref_logp
(Schulman's "Approximating KL divergence"); ``grpo_math.kl_penalty`` looks them up. No torch at
module level: the config checks read the names.
"""

from __future__ import annotations

from .registry import register_kl_estimator


def k1(log_ratio, clamp):
    return log_ratio


def k2(log_ratio, clamp):
    return log_ratio.pow(2) / 2


def k3(log_ratio, clamp):
    """exp(-log r) - 1 + log r; log r clamped to +-``clamp`` first (None: not) so exp() stays finite."""
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return (-log_ratio).exp() - 1 + log_ratio


register_kl_estimator("k1", "log r: unbiased, negative on many tokens (high variance)", k1)
register_kl_estimator("k2", "(log r)^2 / 2: >= 0, biased", k2)
register_kl_estimator("k3", "exp(-log r) - 1 + log r: unbiased and >= 0 (TRL's, GRPO's); log r clamped to +-20", k3)
