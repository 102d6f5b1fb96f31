"""PPO's math beyond the clipped policy loss: per-token rewards, GAE, the value loss, KL control.

Pure torch, no Ray and no model. The conventions are those of TRL 0.9's ``PPOTrainer``, which
LLaMA-Factory's ``stage: ppo`` drives, so a run here can be compared with one there:

* The reward is per token: ``-kl_coef * KL`` on every completion token, plus the reward model's
  sequence score on the last one (``token_rewards``); ``kl_coef`` comes from a fixed or adaptive
  controller (``kl_controller``; LLaMA-Factory's ``ppo_target`` sets the adaptive target).
* Advantages come from GAE over those rewards and the critic's values, whitened over every
  completion token of the batch (``gae``); the policy loss is ``grpo_math.policy_loss`` with
  those [B, T] advantages, the critic's loss is the clipped squared error of ``value_loss``.
* Sequence scores may be normalised by running moments first (``normalize_scores``).

Tensor conventions (as in ``algorithms``): [B, T] tensors are right-padded, ``mask`` is 1 on
completion tokens and 0 on padding, and padding may hold anything (even NaN): it is never read.
Everything is float32 (float64 inputs stay float64). Only ``value_loss`` builds a graph, and
gradients flow to its ``values`` only; everything else here returns detached tensors.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from registries.errors import UserError


def _float(x: torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(x)
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)


def _keep(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    mask = torch.as_tensor(mask).to(like.device)
    if mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but the values have {tuple(like.shape)}; "
                         f"they must match.")
    return mask > 0


# --- masked statistics -------------------------------------------------------------------------

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over the tokens where ``mask`` is 1 (over ``dim`` only, when given).

    Padding is excluded, not multiplied by 0, so garbage there cannot leak NaN. An empty mask
    gives 0 (its count is floored at 1) instead of TRL's NaN.
    """
    x = _float(x)
    keep = _keep(mask, x)
    total = torch.where(keep, x, 0.0)
    count = keep.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum().clamp(min=1.0)
    return total.sum(dim) / count.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked tokens; ``unbiased`` applies Bessel's n / (n - 1).

    With fewer than two tokens there is no spread to measure: the result is 0, where TRL's
    n / (n - 1) would turn a single token into NaN (and whitening it into NaN advantages).
    """
    x = _float(x)
    keep = _keep(mask, x)
    centred = torch.where(keep, x - masked_mean(x, mask), 0.0)
    var = masked_mean(centred.pow(2), mask)
    n = int(keep.sum().item())
    if unbiased and n >= 2:
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the masked mean and unbiased variance of ALL masked tokens.

    ``shift_mean=False`` adds the mean back: only the scale changes (TRL's ``whiten_rewards``).
    Padding comes out as exactly 0.
    """
    x = _float(x)
    keep = _keep(mask, x)
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, 0.0)


# --- rewards and advantages --------------------------------------------------------------------

def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards [B, T]: ``-kl_coef * kl`` on every completion token, plus each row's
    sequence score (``scores`` [B]) on its last completion token; 0 on padding.

    ``kl`` is the per-token KL estimate (``grpo_math.kl_penalty`` of the rollout's log-probs
    against the reference's). A row without completion tokens has no action to credit: all 0.
    """
    kl = _float(kl).detach()
    keep = _keep(mask, kl)
    scores = _float(scores).detach().to(device=kl.device, dtype=kl.dtype)
    if kl.dim() != 2 or scores.shape != (kl.shape[0],):
        raise ValueError(f"token_rewards wants scores [B] and kl, mask [B, T]; got {tuple(scores.shape)} "
                         f"and {tuple(kl.shape)}.")
    rewards = torch.where(keep, -kl_coef * kl, 0.0)
    positions = torch.arange(kl.shape[1], device=kl.device).expand_as(kl)
    last = torch.where(keep, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).flatten()
    rewards[rows, last[rows]] += scores[rows]
    return rewards


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten_rewards: bool = False,
    whiten_advantages: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation: (advantages, returns), both [B, T], detached, 0 on padding.

    Backwards over the masked tokens, with rewards and values zeroed on padding (so the value after
    a row's last completion token is 0: the episode ends there); masked-out tokens inside a row
    (multi-turn observations) are skipped, t + 1 being the next masked token:

        delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = delta_t + gamma * lam * A_{t+1}

    ``returns = A + V``, the critic's target, taken before whitening. Then (``whiten_advantages``)
    the advantages are whitened over all completion tokens of the batch (mean 0, unbiased var 1).
    ``whiten_rewards`` first rescales the rewards to unit variance keeping their mean (TRL's
    ``whiten_rewards``, LLaMA-Factory's ``ppo_whiten_rewards``). Whitening uses this call's tokens:
    pass the whole rollout batch, not a micro-batch.
    """
    rewards = _float(rewards)
    keep = _keep(mask, rewards)
    values = _float(values).to(device=rewards.device, dtype=rewards.dtype)
    if rewards.dim() != 2 or values.shape != rewards.shape:
        raise ValueError(f"gae wants rewards, values, mask [B, T]; got {tuple(rewards.shape)} "
                         f"and {tuple(values.shape)}.")
    rewards, values = torch.where(keep, rewards, 0.0), torch.where(keep, values, 0.0)
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)

    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(running)
    for t in reversed(range(rewards.shape[1])):
        # Masked-out tokens are skipped, not steps: a multi-turn sample's observation turn sits
        # between two policy turns, and the value after the first turn is the one at the start of
        # the next (padding, at the end, leaves next_value 0: the episode ends there).
        k = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(k, delta + gamma * lam * running, running)
        next_value = torch.where(k, values[:, t], next_value)
        advantages[:, t] = running
    returns = torch.where(keep, advantages + values, 0.0)
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return torch.where(keep, advantages, 0.0), returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: Optional[float],
    normalizer: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped squared error over a padded batch, and its metrics.

    Per token, with v the new value, v_old the rollout's and R the return:

        0.5 * max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2)

    (just 0.5 * (v - R)^2 when ``clip`` is None). The loss is the sum over completion tokens
    divided by ``normalizer``; None uses this batch's token count (floored at 1), i.e. the token
    mean. Micro-batches: give each the whole step's token count (as ``loss_normalizer("dapo",
    ...)`` does for the policy) and their losses SUM to the full batch's.

    Metrics (this call's tokens): ``value_clipfrac`` share of tokens whose clipped term is strictly
    the larger (its gradient is cut), ``value_mean``, ``value_error`` mean of (v - R)^2, ``num_tokens``.
    """
    if clip is not None and clip < 0:
        raise ValueError(f"value clip must be >= 0 or None, got {clip}.")
    values = _float(values)
    keep = _keep(mask, values)
    old_values = _float(old_values).detach().to(device=values.device, dtype=values.dtype)
    returns = _float(returns).detach().to(device=values.device, dtype=values.dtype)
    if not (values.shape == old_values.shape == returns.shape) or values.dim() != 2:
        raise ValueError(f"value_loss wants values, old_values, returns, mask [B, T]; got {tuple(values.shape)}, "
                         f"{tuple(old_values.shape)}, {tuple(returns.shape)}.")
    # where(), not a multiply: NaN in padding must reach neither the loss nor the gradient.
    values = torch.where(keep, values, 0.0)
    old_values, returns = torch.where(keep, old_values, 0.0), torch.where(keep, returns, 0.0)

    unclipped = (values - returns).pow(2)
    if clip is None:
        clipped = unclipped
    else:
        clipped = (torch.clamp(values, old_values - clip, old_values + clip) - returns).pow(2)
    per_token = 0.5 * torch.max(unclipped, clipped)
    n_tok = float(keep.sum().item())
    if normalizer is None:
        normalizer = max(n_tok, 1.0)
    loss = torch.where(keep, per_token, 0.0).sum() / normalizer

    with torch.no_grad():
        metrics = {
            "value_clipfrac": masked_mean((clipped > unclipped).to(values.dtype), keep).item(),
            "value_mean": masked_mean(values, keep).item(),
            "value_error": masked_mean(unclipped, keep).item(),
            "num_tokens": n_tok,
        }
    return loss, metrics


# --- KL coefficient controllers ----------------------------------------------------------------

class FixedKLController:
    """A constant KL coefficient (TRL's default when ``adap_kl_ctrl`` is off)."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; here so both controllers are driven alike."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al.'s adaptive KL coefficient, TRL's rule: after each step,

        err = clip(current_kl / target - 1, -0.2, 0.2);    value *= 1 + err * n_steps / horizon

    so the coefficient grows while the policy drifts further than ``target`` nats and shrinks
    while it stays closer. ``n_steps`` is how many samples the step consumed (TRL passes the
    batch size). Only ``value`` is state; ``target`` and ``horizon`` come from the config.
    """

    def __init__(self, init_value: float, target: float, horizon: float):
        self.value = float(init_value)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def kl_controller(
    init_value: float, target: Optional[float], horizon: float = 10000.0,
) -> Union[FixedKLController, AdaptiveKLController]:
    """Fixed at ``init_value`` when ``target`` is None, else adaptive towards ``target`` nats
    (TRL's defaults: init 0.2, target 6, horizon 10000)."""
    if init_value < 0:
        raise UserError(f"The initial KL coefficient must be >= 0, got {init_value}. Set it to 0 for no KL "
                        f"penalty, or a small positive value such as 0.2 (TRL's default).")
    if target is None:
        return FixedKLController(init_value)
    if target <= 0 or horizon <= 0:
        raise UserError(f"The adaptive KL controller needs a positive target KL and horizon, got target={target} "
                        f"and horizon={horizon}. Set ppo_target to the KL (in nats) the policy may drift from "
                        f"the reference, e.g. 6, or leave it unset for a fixed KL coefficient.")
    return AdaptiveKLController(init_value, target, horizon)


# --- score normalisation -----------------------------------------------------------------------

class RunningMoments:
    """Running mean and standard deviation of every score seen so far (TRL's ``RunningMoments``).

    Starts at mean 0, var 1, std 1 and a vanishing count (1e-24) so the first batch sets the
    statistics almost alone. ``update`` merges a batch's mean and population variance into the
    totals (Chan et al.'s parallel formula), then sets ``std`` to the unbiased std of all scores
    seen. Kept in Python floats (float64), so ``state_dict`` is JSON-ready. Under data parallelism
    pass every rank's scores of the step, so every rank keeps the same moments.
    """

    def __init__(self):
        self.mean = 0.0
        self.std = 1.0
        self.var = 1.0
        self.count = 1e-24

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Merge ``xs`` (1-D) into the moments; returns the batch's own (mean, unbiased std),
        the std being NaN for a single score, as ``torch.std`` gives."""
        xs = torch.as_tensor(xs).detach().to(torch.float64).flatten()
        n = xs.numel()
        if n == 0:
            raise ValueError("RunningMoments.update needs at least one score.")
        batch_var, batch_mean = torch.var_mean(xs, unbiased=False)
        batch_mean, batch_var = batch_mean.item(), batch_var.item()

        delta = batch_mean - self.mean
        total = self.count + n
        # Squared deviations about the merged mean: the old ones, shifted; plus the batch's.
        old_sum = self.var * self.count + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = (old_sum + batch_var * n) / total
        # With a single score seen there is no spread yet (TRL divides 0 by 0 here): keep std.
        if total > 1.0:
            self.std = math.sqrt(self.var * total / (total - 1.0))
        self.count = total
        batch_std = math.sqrt(batch_var * n / (n - 1)) if n > 1 else float("nan")
        return batch_mean, batch_std

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.std = float(state["mean"]), float(state["std"])
        self.var, self.count = float(state["var"]), float(state["count"])


def normalize_scores(
    scores: torch.Tensor, moments: RunningMoments, shift_mean: bool, eps: Optional[float] = None,
) -> torch.Tensor:
    """Scale (and with ``shift_mean`` centre) sequence scores [B] by the running moments.

    TRL 0.9's order: the moments are updated with this batch FIRST, then the updated ones are
    used: ``(scores - mean) / (std + eps)`` with ``shift_mean`` (TRL's ``use_score_norm``), else
    ``scores / (std + eps)`` (``use_score_scaling`` alone). ``eps`` None is the machine epsilon of
    the scores' dtype, as in TRL. LLaMA-Factory's ``ppo_score_norm`` turns on both TRL flags, so
    it means ``shift_mean=True``.
    """
    scores = _float(scores).detach()
    moments.update(scores)
    if eps is None:
        eps = torch.finfo(scores.dtype).eps
    scale = moments.std + eps
    if shift_mean:
        return (scores - moments.mean) / scale
    return scores / scale
