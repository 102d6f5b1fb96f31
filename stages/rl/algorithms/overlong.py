"""DAPO's soft overlong punishment (Yu et al., arXiv 2503.14476, Eq. 13): a reward term, not a loss.

A completion cut at ``max_completion_length`` is usually unfinished, and a hard "truncated gets -1"
is noisy: a nearly finished answer is punished as much as a rambling one. DAPO instead penalises
length linearly in a buffer of the last ``buffer_len`` tokens before the cap:

    0                                          if L <= max_len - buffer_len
    -factor * (L - (max_len - buffer_len)) / buffer_len    otherwise (reaching -factor at L = max_len)

verl's ``reward_model.overlong_buffer`` (``len``, ``penalty_factor``) computes exactly this (as
``min(-exceed / len * factor, 0)``); TRL's ``get_soft_overlong_punishment`` reward function is the
case factor = 1. The term is added to the weighted reward sum before advantages.
"""

from __future__ import annotations

from typing import Sequence

import torch


def overlong_penalty(lengths: Sequence[int], max_completion_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> list[float]:
    """The (non-positive) soft overlong punishment of each completion length; all 0 when
    ``buffer_len`` is 0 (off)."""
    if buffer_len <= 0:
        return [0.0] * len(lengths)
    expected = max_completion_length - buffer_len
    return [min(-(length - expected) / buffer_len * penalty_factor, 0.0) for length in lengths]


def with_overlong_penalty(reward: torch.Tensor, samples: Sequence, rl) -> tuple[torch.Tensor, dict]:
    """A training step's rewards [N] plus each sample's penalty under ``rl``'s overlong keys, and
    what to log (``rewards/overlong_penalty``, the mean); unchanged and nothing logged when off.
    Eval rewards are left alone: they measure the reward functions, not the shaping."""
    if not rl.overlong_buffer_len:
        return reward, {}
    penalty = overlong_penalty([len(s.completion_ids) for s in samples], rl.max_completion_length,
                               rl.overlong_buffer_len, rl.overlong_penalty_factor)
    shaped = reward + torch.tensor(penalty, dtype=reward.dtype)
    return shaped, {"rewards/overlong_penalty": sum(penalty) / len(penalty)}
