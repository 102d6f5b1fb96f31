"""Multi-turn episodes in the RL loop: the config's ``environment`` and ``tools`` turn each rollout
into a trajectory (stages/rl/agents/multi_turn.py) instead of one completion.

    environment: tools            # built-in: runs the tools the policy calls (tools: [calculator])
    environment: my_env:MathEnv   # any class with reset(row) and step(reply); environment_kwargs

Each prompt row resets one environment per sample (``PromptRow.environment_row``: its messages,
reference, system, tools and every extra dataset column). ``max_completion_length`` caps a
trajectory's whole completion and ``max_turn_tokens`` one policy turn; ``max_turns`` caps the
policy's turns. An asynchronous run (stages/rl/controller/rollouts.py) plays a batch's episodes on a thread of
the controller, so the engines still work while the policy trains; the turns of one episode may
then straddle a weight push (each token keeps the log-prob it was sampled with, which is what the
rollout correction reads), and the batch is stamped with the version it started from.

Reward functions score the final answer: ``completions`` holds each trajectory's last policy turn,
and the columns ``trajectory`` (the whole completion as text, observations included), ``turns``,
``tool_calls`` and ``environment_reward`` describe the episode. The environment's step rewards,
summed, are added to the functions' total (stages/rl/controller/loop.py, ``reward_totals``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Optional

from registries.errors import UserError

from stages.engines.types import SamplingSpec
from stages.rl.agents.environments import Environment, ToolEnvironment, load_environment
from stages.rl.agents.multi_turn import multi_turn_rollout
from .roles import Generation, PromptRow, RLRun
from stages.rl.agents.tools import load_tools
from stages.rl.config.types import RolloutSample


class Episodes:
    """Plays a batch of prompt rows as multi-turn episodes against the run's rollout backend."""

    def __init__(self, run: RLRun):
        rl = run.spec.rl
        self.run = run
        self.name = rl.environment
        self.make = environment_factory(rl.environment, rl.environment_kwargs, rl.tools, run.template, rl.sandbox)
        self.max_turns = rl.max_turns
        self.turn_tokens = rl.max_turn_tokens or rl.max_completion_length
        self.budget = rl.max_completion_length
        self._thread: Optional[ThreadPoolExecutor] = None

    def play(self, batch: list[PromptRow], sampling: SamplingSpec,
             on_first_turn: Callable[[], None] = lambda: None) -> list[RolloutSample]:
        """``sampling.n`` trajectories per row, grouped by row in row order; ``on_first_turn`` is
        called right before the first turn is sent to the backend."""
        announce = [on_first_turn]  # called once, as the first turn goes out

        def generate(prompt_ids, turn_sampling):
            if announce:
                announce.pop()()
            return self.run.roles.generate(prompt_ids, turn_sampling)

        return multi_turn_rollout(
            [p.environment_row() for p in batch], self.make, self.run.template, self.run.tokenizer,
            generate, replace(sampling, max_tokens=min(self.turn_tokens, sampling.max_tokens)),
            self.max_turns, max_total_tokens=sampling.max_tokens, environment_name=self.name,
        )

    def start(self, batch: list[PromptRow], sampling: SamplingSpec, version: Callable[[], int]) -> "Future[Generation]":
        """``play`` on the controller's rollout thread (batches run one after another, in the order
        sent). The Generation carries the samples, the span the thread was busy, and ``version()``
        read as the batch's first turn goes out: a batch waiting behind another starts later than
        it was sent, so the version at sending could understate how fresh it is. (A push sent
        between that read and the call can only make the batch fresher than its stamp.)"""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="episodes")

        def timed() -> Generation:
            start, first = time.time(), []
            samples = self.play(batch, sampling, on_first_turn=lambda: first.append(version()))
            return Generation(completions=[], busy=(start, time.time()), samples=samples, version=first[0])

        return self._thread.submit(timed)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
            self._thread = None


def episodes_for(run: RLRun) -> Optional[Episodes]:
    """The run's Episodes when its config names an environment (or tools), else None (single turn)."""
    return Episodes(run) if run.spec.rl.multi_turn else None


def environment_factory(spec: str, kwargs: dict, tool_specs: list[str], template,
                        sandbox: str = "isolated") -> Callable[[], Environment]:
    """A fresh environment per episode: the built-in ``tools`` with the listed tools (the python
    tool's programs run ``sandbox``), parsing replies in the template's tool format, or the class
    ``spec`` names called with ``kwargs``."""
    if spec == "tools":
        tools = load_tools(tool_specs, sandbox=sandbox)
        return lambda: ToolEnvironment(tools, template.extract_tool_calls)
    factory = load_environment(spec)

    def make() -> Environment:
        try:
            env = factory(**kwargs)
        except TypeError as exc:
            raise UserError(
                f"Environment {spec!r} could not be made with environment_kwargs {sorted(kwargs)}: {exc}. Make its "
                "constructor take exactly those keyword arguments, or change environment_kwargs.") from None
        if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
            raise UserError(f"Environment {spec!r} made a {type(env).__name__}, which lacks reset(row) or "
                            "step(reply); subclass stages.rl.agents.environments.Environment.")
        return env

    return make
