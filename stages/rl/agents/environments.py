"""Environments for multi-turn rollouts: OpenRLHF's reset/step agent API, in this project's terms.

One instance runs one episode (a trajectory); the rollout loop makes one per trajectory::

    env = load_environment(spec)(**environment_kwargs)
    first = env.reset(row)            # row: {"prompt", "reference", **extra dataset columns}
    while True:
        reply = <the policy's next turn, given the conversation so far>
        step = env.step(reply)        # StepResult(observation, reward, done); unpacks as a tuple
        if step.done: break           # else step.observation is appended as the next prompt turn

``reset`` returns the first prompt: a string (one user turn) or a list of ``{role, content}``
messages. ``step`` gets the policy's reply text (with any tool-call markup); its ``observation`` is
the text of the next turn (an ``observation`` turn in the template, for tool results) or None when
done; ``reward`` is added to the trajectory's reward: the episode's step rewards, summed, join the
reward functions' total (logged as ``rewards/environment``; the functions get the sum as the
column ``environment_reward``). An environment may give 0 and leave scoring to the reward
functions, or be the only scorer (no reward_funcs). ``tools`` are rendered into the
system prompt by the template. The loop stops at ``max_turns`` or its token budget whatever
``done`` says.

Configs name an environment as reward functions are named: a built-in (``tools``) or
``"module.path:Class"`` (any callable that makes an Environment).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from registries.errors import UserError
from registries.templates.tools import FunctionCall
from registries.unique import add_unique

from stages.rl.config.specs import resolve_spec
from .tools import Tool, observation_turn, run_tool_calls

Observation = Union[str, list[dict[str, Any]]]
ExtractCalls = Callable[[str], Union[str, list[FunctionCall]]]  # template.extract_tool_calls


class EnvironmentSpecError(UserError):
    """An environment spec that cannot be loaded, or an environment that broke the interface."""


class StepResult(NamedTuple):
    observation: Optional[str]
    reward: float
    done: bool


class Environment:
    """The interface; subclasses override ``reset`` and ``step``."""

    tools: Sequence[Tool] = ()  # what the template lists in the system prompt
    max_turns: Optional[int] = None  # the environment's own cap; the loop's max_turns also holds

    def reset(self, row: dict[str, Any]) -> Observation:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """The built-in: the prompt is the row's, each reply's tool calls run and their results come
    back as one observation turn; a reply without a tool call is the answer and ends the episode
    (reward 0 here: reward functions score it)."""

    def __init__(self, tools: Sequence[Tool], extract_calls: ExtractCalls, max_turns: Optional[int] = None):
        self.tools = list(tools)
        self.extract_calls = extract_calls
        self.max_turns = max_turns
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> Observation:
        if "prompt" not in row:
            raise EnvironmentSpecError(f"ToolEnvironment needs the row's 'prompt'; the row has {sorted(row)}.")
        self.row = row
        return row["prompt"]

    def step(self, action: str) -> StepResult:
        calls = self.extract_calls(action)
        if not isinstance(calls, list) or not calls:
            return StepResult(None, 0.0, True)
        return StepResult(observation_turn(run_tool_calls(calls, self.tools))["content"], 0.0, False)


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str, factory: Callable[..., Environment]) -> Callable[..., Environment]:
    """Make ``factory`` (a class or function) available as a built-in; a second ``name`` is a ValueError."""
    if not name or ":" in name:
        raise ValueError(f"Environment name {name!r} must be non-empty and free of ':' (that marks module:Class).")
    return add_unique(ENVIRONMENTS, name, factory, "Environment")


register_environment("tools", ToolEnvironment)


def load_environment(spec: str, run_module: bool = True) -> Optional[Callable[..., Environment]]:
    """The class (or factory) ``spec`` names; call it with the config's keyword arguments per episode."""
    return resolve_spec(spec, ENVIRONMENTS, "environment", EnvironmentSpecError,
                        "Point the spec at a class with reset(row) and step(action) (see stages.rl.agents.environments).",
                        run_module)


def check_step(spec: str, result: Any) -> StepResult:
    """``result`` as a StepResult, or an error naming the environment (for the loop to call on each step)."""
    try:
        observation, reward, done = result
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvironmentSpecError(
            f"Environment {spec!r}: step() returned {result!r}; it must return (observation, reward, done): the next "
            "turn's text (None when done), a number and a bool.") from None
    if observation is not None and not isinstance(observation, str):
        raise EnvironmentSpecError(f"Environment {spec!r}: step() returned an observation of type "
                                f"{type(observation).__name__}; it must be the next turn's text or None.")
    return StepResult(observation, reward, bool(done))
