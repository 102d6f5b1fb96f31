"""What flows between the RL roles: a sampling request and the completions that come back.

Plain dataclasses of Python numbers, so they cross Ray actor boundaries cheaply and both
rollout backends (vLLM engines, HF generate in the policy) speak the same language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: ``n`` completions per prompt, at most ``max_tokens`` new tokens each, ending
    at any of ``stop_token_ids`` (the template's stop words and eos; the stop token is kept)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    max_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None


@dataclass
class Completion:
    """One sampled continuation of prompt ``prompt_index`` (its position in the request).

    ``logprobs`` are the sampler's log-probabilities of each chosen token under the raw model
    distribution (before temperature / top-p), one per token, when the backend reports them.
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    finish_reason: Literal["stop", "length"] = "stop"


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
