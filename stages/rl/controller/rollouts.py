"""How a step gets its samples: generated at the step (``async_rollout: off``), or ahead of it
while the policy trains (``one_step``, ``bounded``).

Versions. The engines' weights have a version: the number of training steps whose result they
hold (0: the weights the run started from, or a resumed run's checkpoint step). A batch is stamped
with the version it is sampled with: that of the last weight push sent before its generation, since
an engine runs its calls in the order they were sent. Step t trains the policy of version t - 1,
so a batch of version v is ``t - 1 - v`` versions stale.

- off: generate at step t, push the weights at its end and wait for every engine to load them:
  staleness 0, the synchronous loop exactly.
- one_step: at step t the batch of step t + 1 is sent before the update runs, so the engines
  generate it while the policy trains; the push at the end of the step is not waited for (the
  engines load it after that generation, before the next). Staleness 1 (verl's one-step-off).
- bounded: up to ``max_staleness`` (k) batches ahead; staleness k once the pipeline is full.

A batch found older than ``max_staleness`` when its step comes is dropped, generated again with
the current weights, and counted (``async/dropped_stale``). The schedule above never produces one;
the guard keeps the bound a promise rather than a consequence, should versions ever advance
another way.

Logged per step when asynchronous: ``async/staleness``, ``time/generate`` (what the controller
waited for the batch), ``time/generate_engine`` (the engines' own time on it) and ``time/overlap``
(how much of that ran while the policy was busy with reference, old log-prob, value or update
passes); with ``partial_rollout``, ``async/tokens_after_push`` (the share of the batch's tokens
sampled by weights pushed while it was generating: the stamp is its oldest tokens' version).
A checkpoint holds the policy, not the queue: a resumed run generates its first batches
again from the restored weights (staleness 0, then back to k).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from typing import Callable, Optional

from stages.engines.types import Completion, SamplingSpec
from .episodes import Episodes, episodes_for
from stages.rl.agents.multi_turn import rollout_stats
from .roles import Generation, Pending, PromptRow, RLRun
from .steplog import PhaseTimer
from stages.rl.config.types import RolloutSample

logger = logging.getLogger(__name__)

# Phases in which the policy ranks are busy (the spans the engines' generation may overlap).
POLICY_PHASES = ("reference", "old_logprobs", "values", "update")


def sampling_spec(run: RLRun) -> SamplingSpec:
    """How an RL run samples: num_generations per prompt with the generating options, at most
    max_completion_length tokens, ending at the template's stop tokens."""
    spec = run.spec
    return SamplingSpec(
        n=spec.rl.num_generations, temperature=spec.generating.temperature, top_p=spec.generating.top_p,
        top_k=spec.generating.top_k, max_tokens=spec.rl.max_completion_length,
        stop_token_ids=tuple(run.template.stop_token_ids(run.tokenizer)),
    )


def rollout(run: RLRun, batch: list[PromptRow], sampling: SamplingSpec, step: int, timer: PhaseTimer,
            episodes: Optional[Episodes] = None) -> list[RolloutSample]:
    """This step's completions of the batch, grouped by prompt (the synchronous loop's rollout);
    with ``episodes``, multi-turn trajectories instead."""
    with timer("generate"):
        if episodes is not None:
            return episodes.play(batch, step_sampling(sampling, run, step))
        completions = run.roles.generate([p.input_ids for p in batch], step_sampling(sampling, run, step))
    return group_samples(batch, completions, sampling.n)


def step_sampling(sampling: SamplingSpec, run: RLRun, step: int) -> SamplingSpec:
    """The HF backend samples with a seed per step, so a resumed run draws what an unbroken one
    would. vLLM engines are seeded once at start instead: vLLM 0.32 on CPU fails on seeded
    requests whose prefill gets chunked ("CPU Generator does not use offset")."""
    if run.spec.rl.rollout_backend != "hf":
        return sampling
    return replace(sampling, seed=run.spec.training.seed * 1_000_003 + step * 7_919)


def group_samples(batch: list[PromptRow], completions: list[Completion], n: int) -> list[RolloutSample]:
    """Completions grouped by prompt, in prompt order: the advantage estimators read n at a time."""
    ordered = sorted(completions, key=lambda c: c.prompt_index)  # stable: sampling order within a group
    if len(ordered) != len(batch) * n:
        raise RuntimeError(f"the rollout backend returned {len(ordered)} completions for {len(batch)} prompts x {n}")
    return [
        RolloutSample(batch[c.prompt_index].input_ids, c.token_ids, group=c.prompt_index,
                      truncated=c.finish_reason == "length", rollout_logprobs=c.logprobs)
        for c in ordered
    ]


def greedy_samples(run: RLRun, max_tokens: int, stop_token_ids: tuple[int, ...]) -> list[RolloutSample]:
    """One greedy completion (or multi-turn trajectory) of each eval prompt, in order."""
    greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    episodes = episodes_for(run)
    if episodes is not None:
        return episodes.play(run.eval_prompts, greedy)
    completions = run.roles.generate([p.input_ids for p in run.eval_prompts], greedy)
    return group_samples(run.eval_prompts, completions, 1)


@dataclass
class InFlight:
    """A batch sent to the engines and not yet taken: its prompts, the weights' version it is
    sampled with, and the pending generation."""

    batch: list[PromptRow]
    version: int
    pending: Pending[Generation]


class RolloutSource:
    """The samples of each step and the weights pushed after it, on the run's schedule (above).

    ``batch_of(step)`` gives any later step's prompt batch (the run's order), so batches can be sent
    ahead; ``version`` starts at the step the run starts from."""

    def __init__(self, run: RLRun, sampling: SamplingSpec, batch_of: Callable[[int], list[PromptRow]],
                 total_steps: int, version: int):
        rl = run.spec.rl
        self.run, self.sampling, self.batch_of, self.total_steps = run, sampling, batch_of, total_steps
        self.ahead = int(rl.max_staleness) if rl.asynchronous else 0
        self.episodes = episodes_for(run)  # None: one completion per sample
        self.version = version
        self.in_flight: dict[int, InFlight] = {}
        self.pushes: list[Pending[dict]] = []
        self.policy_busy: list[tuple[float, float]] = []  # recent spans of POLICY_PHASES

    @property
    def asynchronous(self) -> bool:
        return self.ahead > 0

    def take(self, step: int, batch: list[PromptRow], timer: PhaseTimer) -> tuple[list[RolloutSample], dict]:
        """Step ``step``'s samples and its rollout figures; when asynchronous, the batches of the
        next ``ahead`` steps are sent first, so the engines work on them while the policy trains."""
        if not self.asynchronous:
            samples = rollout(self.run, batch, self.sampling, step, timer, self.episodes)
            return samples, self._episode_figures(samples)
        for ahead in range(step, min(step + self.ahead, self.total_steps) + 1):
            if ahead not in self.in_flight:
                self.in_flight[ahead] = self._send(ahead, batch if ahead == step else self.batch_of(ahead))
        entry = self.in_flight.pop(step)
        with timer("generate"):
            generation = entry.pending.result()
        if generation.version is not None:
            entry.version = generation.version
        figures: dict = {}
        if step - 1 - entry.version > self.ahead:
            logger.warning("step %d: its batch was sampled with weights %d versions old, more than max_staleness %d; "
                           "generating it again with the current weights", step, step - 1 - entry.version, self.ahead)
            figures["async/dropped_stale"] = len(entry.batch)
            entry = self._send(step, entry.batch)
            with timer("generate"):
                generation = entry.pending.result()
            if generation.version is not None:
                entry.version = generation.version
        figures["async/staleness"] = step - 1 - entry.version
        if generation.tokens_after_push is not None:  # partial rollouts: fresher than the stamp
            figures["async/tokens_after_push"] = generation.tokens_after_push
        figures.update(self._engine_time(generation))
        samples = (generation.samples if generation.samples is not None
                   else group_samples(entry.batch, generation.completions, self.sampling.n))
        return samples, {**figures, **self._episode_figures(samples)}

    def publish(self, step: int, timer: PhaseTimer) -> dict:
        """After step ``step``'s update: the engines get its weights (version ``step``). The
        synchronous loop waits until every engine has loaded them; an asynchronous one only sends
        the push, and reports the load time of the pushes that have finished."""
        if not self.asynchronous:
            self.version = step
            with timer("sync"):
                return self.run.roles.sync_weights()
        self._note_policy_busy(timer)
        with timer("sync"):
            self.pushes.append(self.run.roles.push_weights())
        self.version = step  # after the push is sent: a rollout thread that reads it sends behind the push
        return self._finished_pushes(wait=False)

    def refill(self, step: int, k: int, timer: PhaseTimer) -> tuple[list[PromptRow], list[RolloutSample]]:
        """Dynamic sampling's ``k``-th extra batch of ``step`` (k >= 1): prompts drawn by a seeded
        RNG of (seed, step, k), so a resumed run draws the same ones, sampled now with the current
        weights. The run's own prompt order is untouched."""
        prompts, size = self.run.prompts, self.run.spec.rl.rollout_batch_size
        rng = random.Random(f"{self.run.spec.training.seed}:{step}:{k}")
        picks = rng.sample(range(len(prompts)), size) if size <= len(prompts) else rng.choices(range(len(prompts)), k=size)
        batch = [prompts[i] for i in picks]
        return batch, rollout(self.run, batch, self.sampling, step, timer, self.episodes)

    def drain(self) -> dict:
        """Wait for every push sent (raising an engine's failure); the last one's figures."""
        if self.episodes is not None:
            self.episodes.close()
        return self._finished_pushes(wait=True)

    def _send(self, step: int, batch: list[PromptRow]) -> InFlight:
        sampling = step_sampling(self.sampling, self.run, step)
        if self.episodes is not None:
            return InFlight(batch, self.version, self.episodes.start(batch, sampling, lambda: self.version))
        return InFlight(batch, self.version, self.run.roles.generate_async([p.input_ids for p in batch], sampling))

    def _episode_figures(self, samples: list[RolloutSample]) -> dict:
        return rollout_stats(samples) if self.episodes is not None else {}

    def _finished_pushes(self, wait: bool) -> dict:
        figures: dict = {}
        while self.pushes and (wait or self.pushes[0].done()):
            figures = self.pushes.pop(0).result()
        return figures

    def _note_policy_busy(self, timer: PhaseTimer) -> None:
        """Keep the policy's busy spans of the last few steps: a batch taken later may have been
        generated during any of them."""
        self.policy_busy += [(start, end) for phase, start, end in timer.spans if phase in POLICY_PHASES]
        self.policy_busy = self.policy_busy[-8 * (self.ahead + 1):]

    def _engine_time(self, generation: Generation) -> dict:
        if generation.busy is None:
            return {}
        start, end = generation.busy
        overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.policy_busy)
        return {"time/generate_engine": end - start, "time/overlap": overlap}

