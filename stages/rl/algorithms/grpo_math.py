"""The GRPO family's math: advantages from grouped rewards, KL estimators, the clipped policy loss.

Pure torch, no Ray and no model: the policy worker feeds it tensors. Conventions (each chosen to
match TRL 1.16's ``GRPOTrainer`` or, where TRL has no such option, OpenRLHF):

* Rewards arrive flat and ordered group by group: the ``num_generations`` completions of prompt 0,
  then those of prompt 1, ... Every estimator compares completions of one prompt, so n >= 2.
* Standard deviations are the unbiased (Bessel-corrected) ones, as ``torch.std`` and TRL's
  ``nanstd`` give; ``eps`` (default 1e-4, TRL's) is added to the std, never to the variance.
* A group whose rewards are all equal (``uniform_groups``) gets advantage exactly 0 under every
  estimator: it carries no signal, and floating-point noise in its mean must not fake one.
* Everything is computed in float32 (float64 inputs stay float64); gradients flow to ``logp`` only.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch

from .registry import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES

# The estimators, losses and KL estimators are registered by name (stages/rl/algorithms/registry.py).
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# k3 exponentiates the log-ratio; clamping it to +-20 keeps exp() finite in float32 (e^20 ~ 5e8).
# Only tokens whose policy and reference disagree by a factor above e^20 are affected (their KL
# gradient is cut); TRL does not clamp, OpenRLHF clamps the result to +-10.
KL_LOG_RATIO_CLAMP = 20.0


def _as_float(x: torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(x)
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    rewards = _as_float(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be flat (one per completion), got shape {tuple(rewards.shape)}.")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}.")
    return rewards.view(-1, num_generations)


def uniform_groups(rewards: torch.Tensor, num_generations: int, atol: float = 1e-6) -> torch.Tensor:
    """Bool [num_groups]: True where a group's rewards all lie within ``atol`` of each other.

    Such a group has zero advantage under every estimator, so it teaches nothing; dynamic
    filtering (DAPO) drops it. Use ``.repeat_interleave(num_generations)`` for a per-completion mask.
    """
    grouped = _grouped(rewards, num_generations)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) <= atol


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    estimator: str,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Flat advantages [N] from flat rewards [N] (groups of ``num_generations`` in a row), by a
    registered group estimator (stages/rl/algorithms/advantage_estimators.py: group_norm, dr_grpo, rloo).
    ``scale_rewards`` ("group", "batch" or "none": group_norm's std) applies to group_norm only.
    Per-token estimators (reinforce_baseline, ...) are called through their entry's ``fn``.

    Groups whose rewards are all equal get exactly 0.
    """
    entry = ADVANTAGE_ESTIMATORS.get(estimator)
    if entry.kind != "group":
        raise ValueError(f"Unknown advantage estimator {estimator!r} for compute_advantages: it is a {entry.kind} "
                         "estimator; call its registered fn (or the critic's GAE) instead.")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS}.")
    grouped = _grouped(rewards, num_generations)
    if num_generations < 2:
        raise ValueError(f"advantage estimator {estimator!r} needs num_generations >= 2, got {num_generations}.")
    if not torch.isfinite(grouped).all():
        raise ValueError("rewards contain NaN or infinity; every completion needs a finite reward.")
    n = num_generations
    advantages = entry.fn(grouped, scale_rewards, eps)
    flat_groups = uniform_groups(grouped.flatten(), n)
    advantages = advantages.masked_fill(flat_groups.unsqueeze(1), 0.0)
    return advantages.flatten()


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k3",
    clamp: Optional[float] = KL_LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs (same shape out),
    by a registered KL estimator (stages/rl/algorithms/kl_estimators.py: k1, k2, k3). With log r = logp - ref_logp,
    k3 = exp(-log r) - 1 + log r clamps log r to +-``clamp`` first (None: no clamp) so exp() cannot
    overflow."""
    entry = KL_ESTIMATORS.get(estimator)
    return entry.fn(_as_float(logp) - _as_float(ref_logp), clamp)


def loss_normalizer(
    loss_type: str,
    completion_lengths: Union[Sequence[int], torch.Tensor],
    max_completion_length: int,
) -> float:
    """The denominator of the FULL batch's loss, from every sequence's number of loss tokens.

    ``completion_lengths`` covers the whole optimizer step: all micro-batches of all data-parallel
    ranks (e.g. ``mask.sum(-1)`` of the full batch, or ``len(sample.completion_ids)`` each).
    By the loss's registered aggregation: sequence_mean (grpo): the number of sequences; token_mean
    (dapo, cispo): the number of tokens; max_length (dr_grpo): sequences * max_completion_length.
    Floored at 1 so an empty batch gives 0 loss, not NaN.
    """
    aggregation = POLICY_LOSSES.get(loss_type).aggregation
    lengths = torch.as_tensor(completion_lengths).flatten()
    if aggregation == "sequence_mean":
        value = float(lengths.numel())
    elif aggregation == "token_mean":
        value = float(lengths.sum().item())
    else:
        value = float(lengths.numel() * max_completion_length)
    return max(value, 1.0)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    loss_type: str,
    max_completion_length: int,
    ref_logp: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    normalizer: Optional[float] = None,
    importance_sampling_level: str = "token",
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    rollout_weights: Optional[torch.Tensor] = None,
    loss_options: Optional[Mapping[str, float]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped-surrogate loss of a padded batch, and its metrics.

    ``logp`` / ``old_logp`` / ``ref_logp`` / ``mask`` are [B, T] (mask 1 on completion tokens);
    ``advantages`` is [B] (one per sequence, shared by its tokens: GRPO) or [B, T] (one per token:
    PPO's GAE; padding entries are ignored, even if NaN). Per token, with ratio =
    exp(logp - old_logp) and A the token's advantage:

        loss_tok = -min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * kl_tok

    ``loss_type`` names a registered policy loss (stages/rl/algorithms/policy_losses.py, sapo.py), which gives
    loss_tok's first term from ratio, A and logp (``loss_options``: the RLArguments keys its entry
    lists in ``options``, e.g. SAPO's temperatures) and its aggregation. Variants (TRL 1.16's):

    * ``importance_sampling_level="sequence"`` (GSPO): ratio = exp(mean over the row's completion
      tokens of logp - old_logp), one value on every token of the row; clipped as above. Its
      gradient is the ratio times the mean of the tokens' log-prob gradients.
    * ``loss_type="cispo"`` (MiniMax-M1's CISPO): loss_tok = -sg(min(ratio, epsilon_high)) * A * logp
      (sg: no gradient). The IS weight is capped at ``epsilon_high`` itself (ScaleRL's eps_max, e.g.
      5.0), not 1 + epsilon_high; no token loses its gradient, it only gets a bounded weight.
      Aggregated as dapo.
    * ``entropy_coef`` > 0: ``- entropy_coef * entropy_tok`` is added to every token's loss, so the
      bonus is aggregated exactly as the policy loss (verl's ``entropy_coeff``; under dapo, TRL's
      ``entropy_coef``). ``entropy`` [B, T] is each position's distribution entropy, with its graph.
    * ``rollout_weights`` [B, T] or [B, 1] (stages/rl/algorithms/rollout_correction.py): the sampler/trainer
      importance weights; they multiply the clipped surrogate (TRL's place: after clipping, before the
      entropy bonus and the KL term), detached.

    Aggregation: the loss is ``numerator / normalizer``, where the numerator is, by the loss's
    aggregation, sequence_mean (grpo): the sum over sequences of each sequence's token mean;
    token_mean and max_length (dapo, cispo, dr_grpo): the sum over all tokens. ``normalizer`` None
    uses this batch's own ``loss_normalizer``, giving grpo = mean over
    sequences of token means, dapo = token mean, dr_grpo = sum / (B * max_completion_length).

    Micro-batches: pass every micro-batch ``normalizer=loss_normalizer(loss_type, <lengths of the
    whole step>, max_completion_length)`` and the micro-batch losses SUM to the full-batch loss, so
    accumulated gradients equal the full batch's. DDP averages gradients over ranks, so under DDP
    divide that normalizer by the world size (each rank then holds 1/world of the sum).

    Metrics (this call's tokens; ``num_tokens`` lets callers weight them): ``clip_fraction`` share
    of tokens whose clip is active, i.e. the gradient is cut (ratio < 1 - eps_low with A < 0:
    ``clip_fraction_low``; ratio > 1 + eps_high with A > 0: ``clip_fraction_high``), ``ratio_mean``,
    and ``kl`` (token mean of the chosen estimator) when ``ref_logp`` is given, ``entropy`` (token
    mean) when ``entropy`` is, and ``rollout_is_loss_change`` (token mean of |weighted - unweighted|
    clipped surrogate: what the rollout weights changed in the loss, 0 if nothing) when
    ``rollout_weights`` is. Under cispo only the high side caps (ratio > epsilon_high, A > 0).
    """
    loss = POLICY_LOSSES.get(loss_type)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"Unknown importance_sampling_level {importance_sampling_level!r}; expected one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}.")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp, the reference model's log-probs of the same tokens.")
    if entropy_coef and entropy is None:
        raise ValueError("entropy_coef needs entropy, each completion position's distribution entropy [B, T].")
    logp = _as_float(logp)
    mask = torch.as_tensor(mask).to(device=logp.device, dtype=logp.dtype)
    old_logp = _as_float(old_logp).detach().to(logp.device)
    adv = _as_float(advantages).detach().to(device=logp.device, dtype=logp.dtype)
    per_sequence = adv.dim() == 1 and adv.shape[0] == logp.shape[0]
    if (not (logp.shape == old_logp.shape == mask.shape) or logp.dim() != 2
            or not (per_sequence or adv.shape == logp.shape)
            or (entropy is not None and tuple(entropy.shape) != tuple(logp.shape))):
        raise ValueError(f"policy_loss wants logp, old_logp, mask (and entropy) [B, T], advantages [B] or [B, T]; got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}, {tuple(adv.shape)}.")

    # Padding may hold any value (even -inf): zero it before exp so it cannot leak NaN into the grads.
    keep = mask > 0
    logp, old_logp = torch.where(keep, logp, 0.0), torch.where(keep, old_logp, 0.0)
    # Per-sequence advantages broadcast over the row; per-token ones get their padding zeroed too.
    adv = adv.unsqueeze(1) if per_sequence else torch.where(keep, adv, 0.0)
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":  # GSPO: the row's mean log-ratio on each of its tokens
        row_mean = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        log_ratio = row_mean.expand_as(logp)
    ratio = torch.exp(log_ratio)
    per_token = loss.fn(ratio, adv, logp, epsilon_low, epsilon_high, **(loss_options or {}))
    uncorrected = per_token
    if rollout_weights is not None:
        per_token = per_token * rollout_weights.detach().to(device=logp.device, dtype=logp.dtype)
    corrected = per_token  # the surrogate the loss takes (the entropy bonus and KL come next)
    ent_tok = None
    if entropy is not None:
        ent_tok = torch.where(keep, _as_float(entropy).to(logp.device), 0.0)
        if entropy_coef:
            per_token = per_token - entropy_coef * ent_tok
    kl_tok = None
    if ref_logp is not None:
        ref = torch.where(keep, _as_float(ref_logp).detach().to(logp.device), 0.0)
        kl_tok = kl_penalty(logp, ref, kl_estimator)
        if beta > 0:
            per_token = per_token + beta * kl_tok

    token_sums = (per_token * mask).sum(dim=1)
    if loss.aggregation == "sequence_mean":
        numerator = (token_sums / mask.sum(dim=1).clamp(min=1.0)).sum()
    else:
        numerator = token_sums.sum()
    if normalizer is None:
        normalizer = loss_normalizer(loss_type, mask.sum(dim=1), max_completion_length)
    total = numerator / normalizer

    with torch.no_grad():
        n_tok = mask.sum()
        denom = n_tok.clamp(min=1.0)
        low_bound, high_bound = loss.clip_bounds(epsilon_low, epsilon_high)  # None: that side never clips
        low = ((ratio < (low_bound if low_bound is not None else -1.0)) & (adv < 0)).to(mask.dtype)
        high = ((ratio > (high_bound if high_bound is not None else float("inf"))) & (adv > 0)).to(mask.dtype)
        metrics = {
            "clip_fraction": ((low + high) * mask).sum().item() / denom.item(),
            "clip_fraction_low": (low * mask).sum().item() / denom.item(),
            "clip_fraction_high": (high * mask).sum().item() / denom.item(),
            "ratio_mean": (ratio * mask).sum().item() / denom.item(),
            "num_tokens": n_tok.item(),
        }
        if kl_tok is not None:
            metrics["kl"] = (kl_tok * mask).sum().item() / denom.item()
        if ent_tok is not None:
            metrics["entropy"] = (ent_tok * mask).sum().item() / denom.item()
        if rollout_weights is not None:  # what the weights did to the loss: 0 if they changed nothing
            metrics["rollout_is_loss_change"] = ((corrected - uncorrected).abs() * mask).sum().item() / denom.item()
    return total, metrics
