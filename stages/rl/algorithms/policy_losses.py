"""The built-in policy losses, one ``register_policy_loss`` each (stages/rl/algorithms/registry.py).

Each gives the per-token loss from ratio = exp(logp - old_logp), the advantage A ([B, 1] or [B, T])
and logp; ``grpo_math.policy_loss`` adds the rollout weights, entropy bonus and KL, and aggregates
by the entry's ``aggregation``. TRL 1.16's formulas. No torch at module level: the config checks
read these facts.
"""

from __future__ import annotations

from registries.errors import ArgumentError

from .registry import register_policy_loss


def clipped_surrogate(ratio, adv, logp, epsilon_low: float, epsilon_high: float):
    """PPO's: -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)."""
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    return -(ratio * adv).minimum(clipped * adv)


def ppo_clip_bounds(epsilon_low: float, epsilon_high: float):
    return 1 - epsilon_low, 1 + epsilon_high


def cispo(ratio, adv, logp, epsilon_low: float, epsilon_high: float):
    """MiniMax-M1's CISPO: -sg(min(ratio, epsilon_high)) * A * logp (sg: no gradient)."""
    return -ratio.clamp(max=epsilon_high).detach() * adv * logp


def cispo_clip_bounds(epsilon_low: float, epsilon_high: float):
    return None, epsilon_high


def check_cispo(rl) -> None:
    """Run before epsilon_high defaults to epsilon: unset must be refused too."""
    if rl.epsilon_high is None or rl.epsilon_high <= 1:
        raise ArgumentError(
            "epsilon_high",
            f"loss_type cispo caps each token's importance weight at epsilon_high itself (ScaleRL's eps_max, "
            f"as in TRL), not at 1 + epsilon_high, so it must be above 1; got {rl.epsilon_high} (unset means "
            "epsilon, 0.2, which would shrink every on-policy weight). Set epsilon_high: 5.0, the value the "
            "ScaleRL paper recommends, or another cap above 1.",
        )


register_policy_loss("grpo", "clipped surrogate, sequence mean (GRPO)", clipped_surrogate,
                     aggregation="sequence_mean", clip_bounds=ppo_clip_bounds)
register_policy_loss("dapo", "clipped surrogate, token mean (DAPO)", clipped_surrogate,
                     aggregation="token_mean", clip_bounds=ppo_clip_bounds)
register_policy_loss("dr_grpo", "clipped surrogate without length bias (Dr. GRPO)", clipped_surrogate,
                     aggregation="max_length", clip_bounds=ppo_clip_bounds)
register_policy_loss("cispo", "-sg(min(ratio, `epsilon_high`)) x A x logp (CISPO); `epsilon_high` > 1, e.g. 5.0",
                     cispo, aggregation="token_mean", clip_bounds=cispo_clip_bounds, check=check_cispo)
