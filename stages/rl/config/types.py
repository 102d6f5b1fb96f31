"""What flows between the RL roles after a rollout: a completion joined with what its update needs.

The rollout itself speaks the engines' language (stages/engines/types.py: ``SamplingSpec`` in,
``Completion`` out), whichever backend samples. Plain dataclasses of Python numbers, so they cross
Ray actor boundaries cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RolloutSample:
    """A completion joined with everything the update needs about it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    group: int  # index of its prompt group in the step (the n completions of one prompt share it)
    reward: float = 0.0
    advantage: float = 0.0
    old_logprobs: list[float] = field(default_factory=list)  # policy before this step's update(s)
    ref_logprobs: list[float] = field(default_factory=list)  # frozen reference; empty when beta is 0
    rollout_logprobs: Optional[list[float]] = None  # what the sampler reported (raw, temperature 1)
    truncated: bool = False
    # PPO with a critic: per-token advantages (GAE; when set they replace ``advantage``), the
    # critic's values at rollout time and the returns it learns to predict.
    token_advantages: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    # Multi-turn rollouts (stages/rl/agents/multi_turn.py): 1 on each completion token the policy sampled,
    # 0 on the observation turns appended between its turns; empty means all ones (single turn).
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 1  # policy turns in the trajectory
    tool_calls: int = 0  # environment steps that returned an observation (tool results)
    answer_start: int = 0  # where the last policy turn begins in completion_ids (what rewards score)
    environment_reward: float = 0.0  # the environment's step rewards, summed (added to the reward functions')
