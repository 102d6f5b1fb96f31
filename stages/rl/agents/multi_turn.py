"""Multi-turn rollouts: the policy and an environment take turns until an answer, ``max_turns`` or
the token budget; one ``RolloutSample`` per trajectory.

Token in, token out. A trajectory's ``completion_ids`` are the ids the policy sampled, turn after
turn, with the ids of each observation turn spliced in between, exactly as the engine returned
them: sampled ids are never decoded and encoded again (a re-encoding may split text differently,
and the policy would then be trained on tokens it never chose). The reply is decoded only to hand
the environment its text. Each next turn's prompt is the prompt plus everything so far.

What is appended after a policy turn is tokenized once, from the template: the rest of the
assistant turn after the stop token the model sampled (Qwen's "\\n" after ``<|im_end|>``), then
the template's observation turn, which ends with the next generation prompt. ``loss_mask`` is 1 on
the sampled ids and 0 on those appended ones; ``rollout_logprobs`` hold NaN there (what the rollout
correction reads as "no sampler log-prob").

Every still-active trajectory takes its turn in one ``generate`` call (n = 1 each: a prompt's n
samples are n trajectories), so any backend's batch generation (vLLM engines, HF) serves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from registries.templates.slots import CallerText, slots_to_ids

from stages.engines.types import Completion, SamplingSpec
from .environments import Environment, Observation, check_step
from .tools import tools_json
from stages.rl.config.types import RolloutSample

Generate = Callable[[list[list[int]], SamplingSpec], list[Completion]]  # RLRoles.generate
NO_LOGPROB = math.nan  # observation positions: the sampler gave no log-prob there


@dataclass
class _Trajectory:
    group: int
    env: Environment
    env_max_turns: Optional[int]
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    answer_start: int = 0  # where the last policy turn begins in ids
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    truncated: bool = False


def first_prompt_ids(template, tokenizer, first: Observation, tools: Sequence,
                     system: Optional[str] = None) -> list[int]:
    """The template's ids up to the first generation prompt, with ``tools`` in the system prompt."""
    messages = [{"role": "user", "content": first}] if isinstance(first, str) else list(first)
    prompt, _ = template.encode_oneturn(tokenizer, messages + [{"role": "assistant", "content": ""}], system,
                                        tools_json(tools) if tools else None)
    return prompt


def assistant_end_ids(template, tokenizer, tool_call: bool = False) -> list[int]:
    """The ids that close an assistant turn in the template, from its stop token on (e.g. Qwen's
    ``<|im_end|>`` and newline); [] when the format has no stop token. A reply with a tool call is a
    ``function`` turn in the template, so its end comes from that format."""
    if tool_call:
        slots = template.format_function.apply('[{"name": "f", "arguments": {}}]', thought_words=template.thought_words)
    else:
        slots = template.format_assistant.apply("")
    ids = slots_to_ids(tokenizer, slots)
    stops = set(template.stop_token_ids(tokenizer))
    last = max((i for i, t in enumerate(ids) if t in stops), default=None)
    return [] if last is None else ids[last:]


def assistant_tail_ids(template, tokenizer, tool_call: bool = False) -> list[int]:
    """What the template renders after a reply's stop token (the model stops at it, so the rest of
    the turn, e.g. Qwen's newline, is not sampled); [] when the stop token ends the turn."""
    return assistant_end_ids(template, tokenizer, tool_call)[1:]


def observation_ids(template, tokenizer, text: str) -> list[int]:
    """One observation turn as the template renders it after an assistant turn, generation prompt
    included (the observation role is a prompt role: its format opens the next reply)."""
    content = CallerText(text) if template.escape_special_tokens else text
    return slots_to_ids(tokenizer, template.format_observation.apply(content))


def multi_turn_rollout(
    rows: Sequence[dict[str, Any]],
    make_environment: Callable[[], Environment],
    template,
    tokenizer,
    generate: Generate,
    sampling: SamplingSpec,
    max_turns: int,
    max_total_tokens: Optional[int] = None,
    system: Optional[str] = None,
    environment_name: str = "environment",
) -> list[RolloutSample]:
    """``sampling.n`` trajectories per row, grouped by row in row order (what the advantage
    estimators read), each a RolloutSample with ``loss_mask``, ``turns``, ``tool_calls`` and the
    environment's summed step rewards (``environment_reward``).

    ``rows``: the environment's rows (``{"prompt", "reference", **extra columns}``); a row's
    ``system`` text, when it has one, replaces ``system``.
    ``make_environment()``: a fresh environment per trajectory. ``sampling.max_tokens`` caps one
    turn; ``max_total_tokens`` (default ``sampling.max_tokens``) caps a trajectory's whole
    completion, sampled and observation tokens together (the sequence the policy trains on). A
    reply cut by the trajectory's budget ends it as truncated, and so does reaching ``max_turns``
    (or the environment's own) with the environment still wanting another turn; a reply cut by the
    turn's cap goes to the environment (``truncated`` then says whether the last turn was cut).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1, got {max_turns}.")
    budget = max_total_tokens if max_total_tokens is not None else sampling.max_tokens
    ends = {call: assistant_end_ids(template, tokenizer, call) for call in (False, True)}
    trajectories = []
    for group, row in enumerate(rows):
        for _ in range(sampling.n):
            env = make_environment()
            first = env.reset(row)
            trajectories.append(_Trajectory(group, env, getattr(env, "max_turns", None),
                                            first_prompt_ids(template, tokenizer, first, getattr(env, "tools", ()),
                                                             row.get("system") or system)))
    turn = 0
    while True:
        active = [t for t in trajectories if not t.done]
        if not active:
            break
        # One call per turn for every active trajectory; each reply is cut to its own trajectory's
        # room. A seeded run seeds each turn apart, so turn 2 does not replay turn 1's draws.
        room = max(budget - len(t.ids) for t in active)
        turn_sampling = replace(sampling, n=1, max_tokens=max(1, min(sampling.max_tokens, room)),
                                seed=None if sampling.seed is None else sampling.seed + 1_000_003 * turn)
        turn += 1
        completions = _by_prompt(generate([t.prompt_ids + t.ids for t in active], turn_sampling), len(active))
        for t, c in zip(active, completions):
            _take_turn(t, c, budget, max_turns, template, tokenizer, ends, environment_name)
    return [_sample(t) for t in trajectories]


def _by_prompt(completions: list[Completion], count: int) -> list[Completion]:
    if len(completions) != count:
        raise RuntimeError(f"the rollout backend returned {len(completions)} completions for {count} prompts x 1")
    return sorted(completions, key=lambda c: c.prompt_index)


def _take_turn(t: _Trajectory, c: Completion, budget: int, max_turns: int, template, tokenizer,
               ends: dict[bool, list[int]], environment_name: str) -> None:
    """Append one sampled turn (cut to what the trajectory's budget leaves) and, unless it ends
    the trajectory, the environment's observation.

    A reply the trajectory's budget cut ends the trajectory (there is no room for more). A reply
    that only reached the turn's own cap (``sampling.max_tokens``) goes to the environment like any
    other, which decides what it is worth; if the episode goes on, the turn's closing ids (the stop
    token it did not sample, then the rest) come before the observation, masked out like it."""
    ids = list(c.token_ids[:max(budget - len(t.ids), 0)])
    cut = len(ids) < len(c.token_ids)
    unfinished = cut or c.finish_reason == "length"
    t.answer_start = len(t.ids)
    t.ids += ids
    t.mask += [1] * len(ids)
    t.logprobs += list(c.logprobs[:len(ids)]) if c.logprobs is not None else [NO_LOGPROB] * len(ids)
    t.turns += 1
    t.truncated = unfinished
    if cut:  # the budget ran out inside the reply: no answer to act on
        t.done = True
        return
    reply = tokenizer.decode(ids, skip_special_tokens=True)  # the environment's copy only; ids stay as sampled
    step = check_step(environment_name, t.env.step(reply))
    t.reward += step.reward
    if step.done or step.observation is None:
        t.done = True
        return
    calls = template.extract_tool_calls(reply)
    end = ends[isinstance(calls, list) and bool(calls)]
    appended = (end if unfinished else end[1:]) + observation_ids(template, tokenizer, step.observation)
    if t.turns >= min(max_turns, t.env_max_turns or max_turns) or len(t.ids) + len(appended) >= budget:
        # No next turn: end on the policy's own turn rather than on an observation it never answers.
        t.done = t.truncated = True
        return
    t.tool_calls += 1
    t.ids += appended
    t.mask += [0] * len(appended)
    t.logprobs += [NO_LOGPROB] * len(appended)


def _sample(t: _Trajectory) -> RolloutSample:
    return RolloutSample(t.prompt_ids, t.ids, group=t.group, rollout_logprobs=t.logprobs,
                         truncated=t.truncated, loss_mask=t.mask, turns=t.turns, tool_calls=t.tool_calls,
                         answer_start=t.answer_start, environment_reward=t.reward)


def rollout_stats(samples: Sequence[RolloutSample]) -> dict[str, float]:
    """Per-step figures of multi-turn samples: mean turns and tool calls per trajectory, the share
    truncated, and the share of completion tokens that are observations."""
    if not samples:
        return {}
    count = len(samples)
    tokens = sum(len(s.completion_ids) for s in samples)
    observed = sum(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
    return {"rollout/turns": sum(s.turns for s in samples) / count,
            "rollout/tool_calls": sum(s.tool_calls for s in samples) / count,
            "rollout/truncated": sum(s.truncated for s in samples) / count,
            "rollout/observation_token_fraction": observed / max(tokens, 1)}
