"""The built-in advantage estimators, one ``register_adv_est`` each (stages/rl/algorithms/registry.py).

Group estimators get the rewards grouped [num_groups, n] (Bessel-corrected stds, ``eps`` on the
std) and return advantages of the same shape; ``grpo_math.compute_advantages`` checks the input and
zeroes uniform groups. Per-token ones return [B, T] from scores, the per-token KL (zeros where the
KL is in the loss) and the mask. No torch at module level: the config checks read these facts.
"""

from __future__ import annotations

from .registry import register_adv_est


def group_norm(grouped, scale_rewards: str, eps: float):
    """GRPO: (r - mean) / (std + eps); the std of the group, of the whole batch, or none (dr_grpo)."""
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        return centred / (grouped.std(dim=1, keepdim=True) + eps)
    if scale_rewards == "batch":
        return centred / (grouped.std() + eps)
    return centred


def dr_grpo(grouped, scale_rewards: str, eps: float):
    """Dr. GRPO: r - mean, no std division (which would favour easy and hard prompts)."""
    return grouped - grouped.mean(dim=1, keepdim=True)


def rloo(grouped, scale_rewards: str, eps: float):
    """r - the mean of the other completions of its prompt (= n/(n-1) (r - mean))."""
    return grouped - (grouped.sum(dim=1, keepdim=True) - grouped) / (grouped.shape[1] - 1)


def reinforce_baseline(scores, kl, mask, kl_coef: float, num_generations: int, gamma: float):
    from .reinforce_pp import reinforce_baseline_advantages

    return reinforce_baseline_advantages(scores, kl, mask, kl_coef, num_generations)


def reinforce_plus_plus(scores, kl, mask, kl_coef: float, num_generations: int, gamma: float):
    return _reinforce_pp("reinforce_plus_plus", scores, kl, mask, kl_coef, num_generations, gamma)


def reinforce_plus_plus_baseline(scores, kl, mask, kl_coef: float, num_generations: int, gamma: float):
    return _reinforce_pp("reinforce_plus_plus_baseline", scores, kl, mask, kl_coef, num_generations, gamma)


def _reinforce_pp(name, scores, kl, mask, kl_coef, num_generations, gamma):
    from .ppo_math import token_rewards
    from .reinforce_pp import reinforce_pp_advantages

    return reinforce_pp_advantages(name, token_rewards(scores, kl, mask, kl_coef), mask, num_generations, gamma)


register_adv_est("gae", "critic", "GAE from a critic's values (`gamma`, `lam`), whitened over the batch",
                 min_generations=1)
register_adv_est("group_norm", "group", "GRPO: (r - group mean) / (std + 1e-4); `scale_rewards` picks the std",
                 group_norm)
register_adv_est("dr_grpo", "group", "Dr. GRPO: r - group mean", dr_grpo)
register_adv_est("rloo", "group", "RLOO: r - mean of the prompt's other completions", rloo)
register_adv_est("reinforce_baseline", "per_token", "OpenRLHF's: r - group mean, then returns (gamma 1) "
                 "whitened over the batch's tokens", reinforce_baseline, fixed_gamma=1.0)
register_adv_est("reinforce_plus_plus", "per_token", "REINFORCE++: returns (discount `gamma`) of the token "
                 "rewards, whitened over the batch's tokens", reinforce_plus_plus, min_generations=1)
register_adv_est("reinforce_plus_plus_baseline", "per_token", "verl's: r - group mean on every token, whitened "
                 "over the batch's tokens", reinforce_plus_plus_baseline)
