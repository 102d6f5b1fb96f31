"""SAPO, Soft Adaptive Policy Optimization (Gao et al., arXiv 2511.20347; TRL's ``loss_type="sapo"``).

Where the clipped surrogate cuts a token's gradient once its ratio leaves [1 - eps, 1 + eps], SAPO
weighs the advantage by a smooth gate of the ratio instead:

    gate(ratio) = sigmoid(tau * (ratio - 1)) * 4 / tau,   loss_tok = -gate(ratio) * A

whose slope is 4 s (1 - s) with s the sigmoid: 1 on-policy (ratio 1, the plain policy gradient) and
decaying smoothly as the ratio moves away, faster for a larger temperature tau. tau is
``sapo_temperature_pos`` where A > 0 and ``sapo_temperature_neg`` elsewhere (TRL's defaults 1.0 and
1.05: negative updates, which push probability onto the rest of the vocabulary, fade sooner).
Aggregated as grpo (TRL's): each completion's token mean, then the mean over completions. Nothing
is clipped, so its clip fractions are 0. No torch at module level (the config checks read the entry).
"""

from __future__ import annotations

from registries.errors import ArgumentError

from .registry import register_policy_loss


def sapo_loss(ratio, adv, logp, epsilon_low: float, epsilon_high: float, *, sapo_temperature_pos: float,
              sapo_temperature_neg: float):
    """Per-token SAPO loss [B, T] from the ratio [B, T] and advantages [B, 1] or [B, T]; the epsilons
    are not used (no clipping)."""
    tau = ratio.new_tensor(sapo_temperature_pos).where(adv > 0, ratio.new_tensor(sapo_temperature_neg))
    gate = (tau * (ratio - 1)).sigmoid() * 4 / tau
    return -gate * adv


def no_clipping(epsilon_low: float, epsilon_high: float):
    return None, None


def check_temperatures(rl) -> None:
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not getattr(rl, key) > 0:
            raise ArgumentError(
                key,
                f"loss_type sapo weighs each token by sigmoid(tau x (ratio - 1)) x 4 / tau, with tau = {key} for "
                f"{'positive' if key.endswith('pos') else 'other'} advantages, so it must be positive; got "
                f"{getattr(rl, key)}. TRL's defaults are sapo_temperature_pos 1.0 and sapo_temperature_neg 1.05; "
                "a larger tau fades off-policy tokens sooner.",
            )


register_policy_loss("sapo", "SAPO: -sigmoid(tau x (ratio - 1)) x 4 / tau x A, a soft gate instead of clipping; "
                     "tau = `sapo_temperature_pos` (A > 0) or `sapo_temperature_neg`", sapo_loss,
                     aggregation="sequence_mean", clip_bounds=no_clipping,
                     options=("sapo_temperature_pos", "sapo_temperature_neg"), check=check_temperatures)
