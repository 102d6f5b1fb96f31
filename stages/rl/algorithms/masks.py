"""Rollout samples as the tensors of a loss: padded rows and the mask of the tokens the policy learns from.

What the policy and critic workers, the recipes' steps and rollout correction all lay out the same
way: right-padded [B, T] rows, 1.0 on each completion token the policy sampled (a multi-turn
rollout's observation turns are 0: stages/rl/agents/multi_turn.py), and the counts loss
normalisers divide by. Samples are anything with ``completion_ids``, ``loss_mask`` and
``prompt_ids`` (stages/rl/config/types.py ``RolloutSample``).
"""

from __future__ import annotations

from typing import Optional

import torch


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-padded [B, T] float32 from 1-D rows of different lengths (zeros after each row's end)."""
    return torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)


def completion_mask(completions: list[list[int]], loss_masks: Optional[list[list[int]]] = None) -> torch.Tensor:
    """1.0 on every completion token the policy learns from, 0.0 on the padding after it, as [B, T].

    ``loss_masks`` (RolloutSample.loss_mask, one per completion) zero the tokens the policy did
    not sample (a multi-turn rollout's observation turns), so they leave the loss, the KL and
    every token mean; an empty one means all ones (single-turn samples)."""
    masks = loss_masks or [[] for _ in completions]
    if len(masks) != len(completions):
        raise ValueError(f"{len(masks)} loss masks for {len(completions)} completions.")
    rows = []
    for c, m in zip(completions, masks):
        if m and len(m) != len(c):
            raise ValueError(f"a loss_mask of {len(m)} tokens for a completion of {len(c)}: they must align.")
        rows.append(torch.tensor(m, dtype=torch.float32) if m else torch.ones(len(c)))
    return pad_rows(rows)


def sample_mask(samples: list) -> torch.Tensor:
    """``completion_mask`` of rollout samples, honouring each one's ``loss_mask``."""
    return completion_mask([s.completion_ids for s in samples], [s.loss_mask for s in samples])


def loss_token_counts(samples: list) -> list[int]:
    """Tokens each sample contributes to the loss (its sampled tokens): what loss_normalizer and
    token means count in place of ``len(completion_ids)``."""
    return [sum(s.loss_mask) if s.loss_mask else len(s.completion_ids) for s in samples]


def sample_ids(samples: list) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) of rollout samples, in order."""
    return [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
