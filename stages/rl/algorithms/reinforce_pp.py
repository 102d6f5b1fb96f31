"""REINFORCE++ advantages (Hu et al., arXiv 2501.03262), as verl computes them, and OpenRLHF's reinforce_baseline.

Unlike the group estimators of ``grpo_math.compute_advantages`` these are per token and normalised
over the whole batch: every completion token of the step is one sample of the whitening
(``ppo_math.masked_whiten``: mean and Bessel-corrected variance over all masked tokens,
(x - mean) / sqrt(var + 1e-8), verl's ``masked_whiten`` exactly). A long completion therefore
weighs more in the batch statistics than a short one, as in verl and OpenRLHF.

* ``reinforce_plus_plus``: returns G_t = r_t + gamma * G_{t+1} over each completion's per-token
  rewards, whitened. No baseline but the batch mean, so it works with one completion per prompt.
* ``reinforce_plus_plus_baseline``: each completion's summed reward minus its prompt group's mean
  (gamma is not used, as in verl), the same value on all its tokens, whitened.
* ``reinforce_baseline`` (``reinforce_baseline_advantages``): OpenRLHF's, from the scores rather
  than token rewards. Each score minus its prompt group's mean, then as REINFORCE++: on the token
  rewards of that centred score (and the KL), the returns with gamma 1 (OpenRLHF forces it), whitened
  over the batch with OpenRLHF's statistics (the variance divided by the token count, not count - 1;
  1 / sqrt(max(var, 1e-8))). Without a KL in the rewards (grpo) it is reinforce_plus_plus_baseline
  up to that variance.

The per-token rewards are ``ppo_math.token_rewards``: the score on the last token, and on stage ppo
(its KL in the reward) ``-kl_coef * KL`` on every token, OpenRLHF's REINFORCE++ shaping.

Because the whitening shifts every token by the batch mean, a prompt group whose rewards are all
equal does NOT get zero advantage here (it does under the group estimators): that is the estimator's
definition, not floating-point noise. Its centred rewards are set to exactly 0 before whitening.
"""

from __future__ import annotations

import torch

from .grpo_math import uniform_groups
from .ppo_math import masked_mean, masked_var, masked_whiten, token_rewards

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


@torch.no_grad()
def reinforce_pp_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    num_generations: int,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Per-token advantages [B, T] (0 on padding) from per-token rewards [B, T] and the completion
    ``mask`` [B, T]; rows ordered group by group (``num_generations`` completions per prompt)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"Unknown REINFORCE++ estimator {estimator!r}; expected one of {ESTIMATORS}.")
    rewards = torch.as_tensor(rewards)
    rewards = rewards if rewards.dtype in (torch.float32, torch.float64) else rewards.float()
    keep = torch.as_tensor(mask).to(rewards.device) > 0
    if rewards.dim() != 2 or keep.shape != rewards.shape:
        raise ValueError(f"reinforce_pp_advantages wants rewards and mask [B, T]; got {tuple(rewards.shape)} "
                         f"and {tuple(keep.shape)}.")
    rewards = torch.where(keep, rewards, 0.0)
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or infinity; every completion needs a finite reward.")
    if estimator == "reinforce_plus_plus":
        values = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            # The return restarts at each row's last completion token; masked-out tokens (padding,
            # multi-turn observations) are not steps, so they neither add nor discount.
            running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
            values[:, t] = running
    else:
        values = _centred_by_group(rewards.sum(dim=1), num_generations)[:, None].expand_as(rewards)
    return masked_whiten(values, keep)


@torch.no_grad()
def reinforce_baseline_advantages(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    num_generations: int,
) -> torch.Tensor:
    """OpenRLHF's reinforce_baseline per token [B, T] (0 on padding) from each completion's score [B],
    the per-token KL [B, T] (zeros where the KL is in the loss) and the completion ``mask`` [B, T]; rows
    ordered group by group. A uniform group's centred scores are exactly 0 before the whitening."""
    scores = torch.as_tensor(scores)
    scores = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    if scores.dim() != 1:
        raise ValueError(f"reinforce_baseline_advantages wants one score per completion; got {tuple(scores.shape)}.")
    if not torch.isfinite(scores).all():
        raise ValueError("rewards contain NaN or infinity; every completion needs a finite reward.")
    centred = _centred_by_group(scores, num_generations)
    rewards = token_rewards(centred, torch.as_tensor(kl).to(scores.dtype), mask, kl_coef)
    returns = rewards.flip(1).cumsum(dim=1).flip(1)  # gamma 1; masked-out tokens carry 0 reward
    mean, var = masked_mean(returns, mask), masked_var(returns, mask, unbiased=False)
    return torch.where(torch.as_tensor(mask).to(returns.device) > 0, (returns - mean) * var.clamp(min=1e-8).rsqrt(),
                       0.0)


def _centred_by_group(scores: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Each completion's score [B] minus its prompt group's mean; exactly 0 for a uniform group."""
    if num_generations < 2 or scores.numel() % num_generations:
        raise ValueError(f"{scores.numel()} completions do not split into prompt groups of "
                         f"num_generations={num_generations} (at least 2).")
    grouped = scores.view(-1, num_generations)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return centred.masked_fill(uniform_groups(scores, num_generations).unsqueeze(1), 0.0).flatten()
