"""What every RL recipe's loop shares: step counts, prompt batches, grouping completions into
samples, greedy evaluation, and where the run stands (its log, its checkpoints, its resume).

A recipe (stages/recipes/grpo.py, stages/recipes/ppo.py) asks ``RunProgress`` for the step to start from and the
prompt batches from there, and hands it each finished step to log and, every ``save_steps``, to
checkpoint. Resuming replays nothing but the prompt order: the roles load their weights,
optimizers, schedules and RNG, the recipe its own counters (KL coefficient, score statistics),
and trainer_log.jsonl drops the records of steps after the checkpoint, which run again.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Callable, Iterator, Optional

from stages.training.callbacks import truncate_log
from stages.training.checkpoints import commit_checkpoint, staging_folder, uncommit_after
from stages.rl.workers import checkpoint as ckpt
from .rewards import RewardSet
from .roles import PromptRow, RLRun
from .rollouts import RolloutSource
from .steplog import PhaseTimer, StepLog, write_results
from .trackers import StepReporter
from stages.engines.types import SamplingSpec
from stages.rl.config.types import RolloutSample

logger = logging.getLogger(__name__)


class RunProgress:
    """One RL run's course: the first evaluation, the steps and their prompt batches, the end of a
    step (weight sync, periodic eval, log, checkpoint) and the end of the run (final eval, the saved
    model, plots, all_results.json). A recipe fills in what happens inside a step."""

    def __init__(self, run: RLRun, total_steps: int, sampling: SamplingSpec, evaluate: Callable[[], dict]):
        self.run = run
        self.total_steps = total_steps
        self.evaluate = evaluate
        self.started = time.time()
        options = run.spec.training
        self.output_dir = options.output_dir
        self.state: dict = {}
        self.start_step = 0
        if run.resume_from:
            self.state = ckpt.read_state(run.resume_from)
            self.start_step = int(self.state["global_step"])
            run.roles.load_checkpoint(run.resume_from)
            dropped = truncate_log(self.output_dir, self.start_step)
            logger.info("resumed from %s at step %d of %d (%d logged steps after it will run again)",
                        run.resume_from, self.start_step, total_steps, dropped)
            if self.state.get("total_steps") not in (None, total_steps):
                logger.warning("the checkpoint was taken in a run of %s steps, this one has %d: the learning-rate "
                               "schedule continues from the saved one", self.state.get("total_steps"), total_steps)
        uncommit_after(self.output_dir, self.start_step, kind="rl")  # a replaced run's: auto must not pick them up
        self.log = StepLog(self.output_dir, total_steps, append=bool(run.resume_from))
        self.reporter = StepReporter(run.spec)  # report_to: each log record also goes to the trackers
        save_every = options.save_steps if options.save_strategy not in ("no", "epoch") else 0
        self.save_every = every(save_every, total_steps)
        self.log_every = every(options.logging_steps, total_steps) or 1
        # eval_strategy steps: every eval_steps (default: logging_steps), as the Trainer does; else at the end.
        self.eval_every = (every(options.eval_steps or options.logging_steps, total_steps)
                           if options.eval_strategy == "steps" else 0)
        self.evaluated_last = False
        self.first_eval: dict = {}
        self._batches: Iterator[list[PromptRow]] = iter(())
        self._ahead: dict[int, list[PromptRow]] = {}  # prompt batches drawn, by step, not yet trained on
        self._drawn = self.start_step
        self.rollouts = RolloutSource(run, sampling, self._batch, total_steps, version=self.start_step)
        self._rollout_figures: dict = {}

    @property
    def resumed(self) -> bool:
        return self.start_step > 0

    def steps(self, batch_size: int) -> Iterator[tuple[int, list[PromptRow]]]:
        """(step, prompt batch) for every step still to run, after the engines got the policy's
        weights (a warm start, a loaded adapter, a checkpoint) and a fresh run's first evaluation.
        A resumed run skips the batches its checkpoint already consumed, so it sees the same
        prompts in the same order (the next epoch's shuffle included)."""
        self.run.roles.sync_weights()
        if not self.resumed:
            self.first_eval = self.evaluate()
            if self.first_eval:
                self.emit(0, self.first_eval)
        self._batches = prompt_batches(self.run.prompts, batch_size, self.run.spec.training.seed)
        for _ in range(self.start_step):
            next(self._batches)
        self._ahead, self._drawn = {}, self.start_step
        for step in range(self.start_step + 1, self.total_steps + 1):
            yield step, self._batch(step)
            self._ahead.pop(step, None)

    def _batch(self, step: int) -> list[PromptRow]:
        """The prompt batch of ``step`` (this one or a later one), drawn in the run's order."""
        while self._drawn < step:
            self._drawn += 1
            self._ahead[self._drawn] = next(self._batches)
        return self._ahead[step]

    def rollout(self, step: int, batch: list[PromptRow], timer: PhaseTimer) -> list[RolloutSample]:
        """The step's samples (stages/rl/controller/rollouts.py: generated now, or while the last step trained);
        its rollout figures (staleness, overlap) join the step's log record."""
        samples, self._rollout_figures = self.rollouts.take(step, batch, timer)
        return samples

    def end_step(self, step: int, values: dict, timer: PhaseTimer, recipe_state: Callable[[], dict]) -> None:
        """Weight sync, the periodic eval, the log record, and a checkpoint when save_steps says so
        and at the last step."""
        values.update(self._rollout_figures)
        values.update(self.rollouts.publish(step, timer))
        self.evaluated_last = bool(self.eval_every) and step % self.eval_every == 0
        if self.evaluated_last:
            values.update(self.evaluate())
        values.update(timer.seconds)
        if step % self.log_every == 0 or step == self.total_steps:
            self.emit(step, values)
        # ... and at the last step, as the HF Trainer saves at the end: a rerun of the finished run
        # then resumes at its end and trains nothing (cluster/finished_run.py)
        if self.save_every and (step % self.save_every == 0 or step == self.total_steps):
            self._checkpoint(step, recipe_state)

    def finish(self, plot_keys: tuple[str, ...]) -> dict:
        """The trained policy's eval (unless the last step just ran it), the saved model, plots and
        all_results.json; returns the results."""
        self.rollouts.drain()  # an engine that failed to load the last weights says so here
        final = self.evaluate() if self.run.eval_prompts and not self.evaluated_last else {}
        if final:
            self.emit(self.total_steps, final)
        self.run.roles.save(self.output_dir)
        if self.run.spec.finetuning.plot_loss:
            from stages.training.outputs import plot_loss

            plot_loss(self.output_dir, keys=plot_keys)
        results = {"total_steps": self.total_steps, "train_runtime": round(time.time() - self.started, 3),
                   **{f"before_{k}": v for k, v in self.first_eval.items()}, **final}
        write_results(self.output_dir, results)
        self.reporter.close()
        return results

    def emit(self, step: int, values: dict) -> dict:
        record = self.log.write(step, values)
        self.reporter.log(record)
        if self.run.on_log is not None:
            self.run.on_log(record)
        return record

    def _checkpoint(self, step: int, recipe_state: Callable[[], dict]) -> str:
        staging = staging_folder(self.output_dir, step)
        self.run.roles.save_checkpoint(staging)
        ckpt.write_state(staging, {"global_step": step, "total_steps": self.total_steps,
                                   "stage": self.run.spec.finetuning.stage, **recipe_state()})
        path = commit_checkpoint(staging, step, self.total_steps, self.run.spec.training.save_total_limit)
        logger.info("saved checkpoint %s", path)
        return path


def every(value, total_steps: int) -> int:
    """A step interval as the trainer options give it: N steps, or a fraction (< 1) of the run."""
    if not value:
        return 0
    return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)


def count_steps(num_prompts: int, rollout_batch_size: int, options) -> int:
    """max_steps when set, else num_train_epochs passes over the prompts (the last batch rounds up)."""
    if options.max_steps and options.max_steps > 0:
        return int(options.max_steps)
    return max(1, math.ceil(float(options.num_train_epochs) * num_prompts / rollout_batch_size))


def prompt_batches(prompts: list[PromptRow], size: int, seed: int) -> Iterator[list[PromptRow]]:
    """Endless fixed-size batches; each pass over the prompts is a fresh seeded shuffle."""
    if not prompts:
        raise ValueError("no prompts to train on")
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < size:
            epoch = list(range(len(prompts)))
            rng.shuffle(epoch)
            order += epoch
        yield [prompts[i] for i in order[:size]]
        order = order[size:]


def completion_texts(tokenizer, samples: list[RolloutSample]) -> list[str]:
    """What reward functions score as each completion: its text, or a multi-turn trajectory's
    final policy turn (its answer; stages/rl/controller/episodes.py)."""
    return [tokenizer.decode(s.completion_ids[s.answer_start:], skip_special_tokens=True) for s in samples]


def reward_totals(rewards: Optional[RewardSet], batch: list[PromptRow], samples: list[RolloutSample],
                  tokenizer) -> tuple[list[float], dict]:
    """Each sample's reward: the weighted reward functions' total (0 without any) plus the summed
    step rewards of its environment (0 for a single-turn completion), and what to log: each
    function's mean (``rewards/<function>``) and, for multi-turn samples, ``rewards/environment``."""
    total, stats = [0.0] * len(samples), {}
    if rewards is not None:
        scores = rewards.score([batch[s.group].prompt_text for s in samples], completion_texts(tokenizer, samples),
                               reward_columns(batch, samples, tokenizer))
        total, stats = scores.total, {f"rewards/{name}": mean for name, mean in scores.means().items()}
    if any(s.loss_mask or s.environment_reward for s in samples):
        total = [t + s.environment_reward for t, s in zip(total, samples)]
        stats["rewards/environment"] = sum(s.environment_reward for s in samples) / len(samples)
    return total, stats


def reward_columns(batch: list[PromptRow], samples: list[RolloutSample], tokenizer=None) -> dict[str, list]:
    """What reward functions get besides prompts and completions, one entry per completion: every
    extra dataset column (None where a row lacks it), then ``reference`` and ``completion_ids``
    (which win over columns of those names), and for multi-turn samples ``trajectory`` (the whole
    completion as text; needs ``tokenizer``), ``turns``, ``tool_calls`` and ``environment_reward``
    (the environment's summed step rewards, which the trajectory's reward includes as well)."""
    names = dict.fromkeys(name for row in batch for name in row.columns)
    columns: dict[str, list] = {name: [batch[s.group].columns.get(name) for s in samples] for name in names}
    columns["reference"] = [batch[s.group].reference for s in samples]
    columns["completion_ids"] = [s.completion_ids for s in samples]
    if tokenizer is not None and any(s.loss_mask for s in samples):
        columns["trajectory"] = [tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
        columns["turns"] = [s.turns for s in samples]
        columns["tool_calls"] = [s.tool_calls for s in samples]
        columns["environment_reward"] = [s.environment_reward for s in samples]
    return columns
