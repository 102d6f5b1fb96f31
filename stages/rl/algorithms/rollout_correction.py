"""Rollout correction: importance weights for the gap between the sampler and the trainer.

The engines sample with their own kernels, precision and (with asynchronous rollouts) older
weights, so the distribution a completion was drawn from is not exactly the one the policy
update assumes. The sampler reports each token's log-prob; the trainer recomputes it before the
update (the "old" log-probs). Their ratio, per token or per completion, re-weights the policy loss.

TRL 1.16's ``GRPOTrainer`` semantics and key names (``vllm_importance_sampling_*``), whichever
backend samples:

* log-ratio per token: ``trainer - sampler`` on completion tokens; a token the sampler did not
  score (NaN) gets 0, i.e. weight 1. ``sequence_*`` modes use the SUM of a completion's token
  log-ratios (the sequence's likelihood ratio, not GSPO's length-normalised mean), one value per row.
* ``*_truncate`` (TIS): ratio clamped to [clip_min, clip_max]; ``*_mask`` (MIS): ratios outside
  it become 0. A bound of None is no bound on that side.
* The weight multiplies each token's clipped-surrogate loss (after PPO clipping, before the entropy
  bonus and the KL term, as TRL does) and is detached: it re-weights, it is not optimised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .grpo_math import kl_penalty
from .masks import pad_rows, sample_mask

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class RolloutCorrection:
    mode: str = "sequence_mask"
    clip_min: Optional[float] = None
    clip_max: Optional[float] = 3.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Unknown rollout correction mode {self.mode!r}; expected one of {MODES}.")

    @classmethod
    def from_args(cls, rl) -> Optional["RolloutCorrection"]:
        """The run's correction (its RLArguments), or None when it is off."""
        if not rl.vllm_importance_sampling_correction:
            return None
        return cls(rl.vllm_importance_sampling_mode, rl.vllm_importance_sampling_clip_min,
                   rl.vllm_importance_sampling_clip_max)

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")

    def _ratio(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """exp(trainer - sampler): [B, T] for token modes, [B, 1] for sequence modes (TRL's shapes)."""
        mask = mask.to(device=trainer_logp.device, dtype=torch.float32)
        diff = torch.nan_to_num((trainer_logp.detach().float() - sampler_logp.float()) * mask, nan=0.0)
        if self.sequence_level:
            diff = diff.sum(dim=-1, keepdim=True)
        return torch.exp(diff)

    def _outside(self, ratio: torch.Tensor) -> torch.Tensor:
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return (ratio < low) | (ratio > high)

    def weights(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The detached weights, [B, T] or [B, 1] (broadcasts over the row), from [B, T] log-probs
        of the same tokens (``trainer_logp`` the policy's before the update) and the completion mask."""
        with torch.no_grad():
            ratio = self._ratio(trainer_logp, sampler_logp, mask)
            if self.mode.endswith("truncate"):
                return torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
            return ratio.masked_fill(self._outside(ratio), 0.0)

    def metrics(self, trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """Per-step logging: the raw ratio's mean and max and the weights' mean (over tokens, or over
        completions in sequence modes), the share truncated or masked, and a k3 estimate of
        KL(sampler || trainer) per token (the samples come from the sampler)."""
        with torch.no_grad():
            mask = mask.to(trainer_logp.device)
            ratio = self._ratio(trainer_logp, sampler_logp, mask)
            weights = self.weights(trainer_logp, sampler_logp, mask)
            keep = torch.ones_like(ratio, dtype=torch.bool) if self.sequence_level else mask > 0
            if not keep.any():
                return {}
            share = self._outside(ratio)[keep].float().mean().item()
            scored = (mask > 0) & ~torch.isnan(sampler_logp)
            kl = kl_penalty(sampler_logp[scored], trainer_logp.detach()[scored].float(), "k3")
            return {
                "rollout_is_ratio_mean": ratio[keep].mean().item(),
                "rollout_is_ratio_max": ratio[keep].max().item(),
                "rollout_is_weight_mean": weights[keep].mean().item(),
                ("rollout_is_truncated_fraction" if self.mode.endswith("truncate") else "rollout_is_masked_fraction"):
                    share,
                "rollout_is_kl": kl.mean().item() if kl.numel() else 0.0,
            }

    # --- on rollout samples (the policy worker's side) ----------------------------------------------
    def sample_weights(self, samples: Sequence, trainer_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``weights`` of a micro-batch of RolloutSamples whose padded pre-update log-probs are ``trainer_logp``."""
        return self.weights(trainer_logp, sampler_logprobs([s.rollout_logprobs for s in samples], trainer_logp), mask)

    def sample_metrics(self, samples: Sequence, trainer_rows: Sequence[Sequence[float]]) -> dict[str, float]:
        """``metrics`` over all of a rank's samples at once (a max over micro-batches cannot be merged later)."""
        trainer = pad_rows([torch.tensor(row, dtype=torch.float32) for row in trainer_rows])
        mask = sample_mask(samples)
        return self.metrics(trainer, sampler_logprobs([s.rollout_logprobs for s in samples], trainer), mask)


def sampler_logprobs(rows: Sequence[Optional[Sequence[float]]], like: torch.Tensor) -> torch.Tensor:
    """The samples' ``rollout_logprobs`` padded to ``like``'s [B, T]; NaN where the sampler gave none
    (such tokens get weight 1, as in TRL)."""
    out = torch.full(like.shape, math.nan, dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            n = min(len(row), like.shape[1])
            out[i, :n] = torch.tensor(row[:n], dtype=torch.float32)
    return out.to(like.device)


def rollout_logprob_gap(samples: Sequence, policy_logprobs: list[list[float]]) -> dict:
    """How far the sampler's log-probs are from the policy's for the same tokens. Near 0 (float
    noise) when the engines serve the policy's current weights; a failed or skipped weight sync,
    or a precision mismatch, shows here first (verl's rule of thumb: investigate above ~0.01).
    Only meaningful at temperature 1, where the sampler reports the same quantity."""
    gaps = [abs(a - b) for s, mine in zip(samples, policy_logprobs) if s.rollout_logprobs
            for a, b in zip(s.rollout_logprobs, mine) if not math.isnan(a)]  # NaN: an observation token
    return {"rollout_logprob_diff": sum(gaps) / len(gaps), "rollout_logprob_diff_max": max(gaps)} if gaps else {}
