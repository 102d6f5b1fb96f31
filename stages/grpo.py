"""GRPO (stage: grpo): the controller loop, one step top to bottom.

    prompts -> rollouts (num_generations per prompt) -> rewards -> advantages (per prompt group)
    -> [dynamic filtering] -> reference log-probs -> policy update(s) -> weight sync -> log

The roles (policy ranks, rollout engines, the reference inside the policy) come from fabric/
behind ``RLRoles``; this module only says what a step does. The math is in stages/rl/algorithms.py,
the reward functions in stages/rl/rewards.py.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Iterator

import torch

from .rl.algorithms import compute_advantages, loss_normalizer, uniform_groups
from .rl.rewards import RewardSet, load_reward_funcs
from .rl.roles import PromptRow, RLRun
from .rl.steplog import PhaseTimer, StepLog, write_results
from .rl.types import Completion, RolloutSample, SamplingSpec

logger = logging.getLogger(__name__)


def run_grpo(run: RLRun) -> dict:
    started = time.time()
    spec, rl, roles = run.spec, run.spec.rl, run.roles
    options = spec.training
    rewards = load_reward_funcs(rl.reward_funcs, rl.reward_weights)
    sampling = SamplingSpec(
        n=rl.num_generations, temperature=spec.generating.temperature, top_p=spec.generating.top_p,
        top_k=spec.generating.top_k, max_tokens=rl.max_completion_length,
        stop_token_ids=tuple(run.template.stop_token_ids(run.tokenizer)),
    )
    total_steps = count_steps(len(run.prompts), rl.rollout_batch_size, options)
    log = StepLog(options.output_dir, total_steps)
    batches = prompt_batches(run.prompts, rl.rollout_batch_size, options.seed)
    evaluate = _evaluator(run, rewards, sampling)
    log_every = every(options.logging_steps, total_steps) or 1
    # eval_strategy steps: every eval_steps (default: logging_steps), as the Trainer does; else at the end.
    eval_every = every(options.eval_steps or options.logging_steps, total_steps) if options.eval_strategy == "steps" else 0
    evaluated = False

    roles.sync_weights()  # the engines start from the policy's weights (a loaded adapter, a warm start)
    first_eval = evaluate()
    if first_eval:
        _emit(run, log.write(0, first_eval))
    for step in range(1, total_steps + 1):
        timer = PhaseTimer()
        batch = next(batches)
        # No per-request seed: the engines are seeded once at start (the run repeats as a whole), and
        # vLLM 0.32 on CPU fails on seeded requests whose prefill gets chunked ("CPU Generator does
        # not use offset"), which large rollout batches trigger.
        with timer("generate"):
            completions = roles.generate([p.input_ids for p in batch], sampling)
        samples = _samples(batch, completions, rl.num_generations)
        with timer("reward"):
            scores = rewards.score(
                [batch[s.group].prompt_text for s in samples],
                [run.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples],
                _columns(batch, samples),
            )
        reward = torch.tensor(scores.total, dtype=torch.float32)
        advantages = compute_advantages(reward, rl.num_generations, rl.advantage_estimator, rl.scale_rewards)
        for sample, r, a in zip(samples, scores.total, advantages.tolist()):
            sample.reward, sample.advantage = r, a
        kept = _filter(samples, reward, rl) if rl.dynamic_filtering else samples
        values = _reward_stats(reward, scores, samples, rl.num_generations)
        values["pass_rate"] = len(kept) / len(samples)
        if len(kept) >= roles.policy_size:
            values.update(_update(roles, kept, rl, sampling.temperature, timer))
        else:  # every group was uniform: nothing to learn from this batch
            values["skipped_update"] = 1
        with timer("sync"):
            values.update(roles.sync_weights())
        evaluated = eval_every and step % eval_every == 0
        if evaluated:
            values.update(evaluate())
        values.update(timer.seconds)
        if step % log_every == 0 or step == total_steps:
            _emit(run, log.write(step, values))
    final = evaluate() if run.eval_prompts and not evaluated else {}  # the trained policy, unless just done
    if final:
        _emit(run, log.write(total_steps, final))
    roles.save(options.output_dir)
    if spec.finetuning.plot_loss:
        from .outputs import plot_loss

        plot_loss(options.output_dir, keys=("loss", "reward", "eval_reward", "kl"))
    results = {"total_steps": total_steps, "train_runtime": round(time.time() - started, 3),
               **{f"before_{k}": v for k, v in first_eval.items()}, **final}
    write_results(options.output_dir, results)
    return results


def _update(roles, samples: list[RolloutSample], rl, temperature: float, timer: PhaseTimer) -> dict:
    """Reference and old-policy log-probs, then num_iterations optimizer steps on the same samples."""
    checks: dict = {}
    if rl.beta > 0:
        with timer("reference"):
            for sample, ref in zip(samples, roles.reference_logprobs(samples)):
                sample.ref_logprobs = ref
    # The sampling policy's log-probs: the ratio's denominator when the batch is reused
    # (num_iterations > 1; with one update the current log-probs, detached, are exact), and at
    # temperature 1 (where the sampler reports the same quantity) a check on the weight sync.
    if rl.num_iterations > 1 or temperature == 1.0:
        with timer("old_logprobs"):
            old = roles.policy_logprobs(samples)
        if rl.num_iterations > 1:
            for sample, logprobs in zip(samples, old):
                sample.old_logprobs = logprobs
        if temperature == 1.0:
            checks = _rollout_logprob_gap(samples, old)
    normalizer = loss_normalizer(rl.loss_type, [len(s.completion_ids) for s in samples], rl.max_completion_length)
    metrics: dict = {}
    with timer("update"):
        for _ in range(rl.num_iterations):
            metrics = roles.update(samples, normalizer)
    return {**metrics, **checks}


def _rollout_logprob_gap(samples: list[RolloutSample], policy_logprobs: list[list[float]]) -> dict:
    """How far the sampler's log-probs are from the policy's for the same tokens. Near 0 (float
    noise) when the engines serve the policy's current weights; a failed or skipped weight sync,
    or a precision mismatch, shows here first (verl's rule of thumb: investigate above ~0.01)."""
    gaps = [abs(a - b) for s, mine in zip(samples, policy_logprobs) if s.rollout_logprobs
            for a, b in zip(s.rollout_logprobs, mine)]
    return {"rollout_logprob_diff": sum(gaps) / len(gaps), "rollout_logprob_diff_max": max(gaps)} if gaps else {}


def _samples(batch: list[PromptRow], completions: list[Completion], n: int) -> list[RolloutSample]:
    """Completions grouped by prompt, in prompt order: the advantage estimators read n at a time."""
    ordered = sorted(completions, key=lambda c: c.prompt_index)  # stable: sampling order within a group
    if len(ordered) != len(batch) * n:
        raise RuntimeError(f"the rollout backend returned {len(ordered)} completions for {len(batch)} prompts x {n}")
    return [
        RolloutSample(batch[c.prompt_index].input_ids, c.token_ids, group=c.prompt_index,
                      truncated=c.finish_reason == "length", rollout_logprobs=c.logprobs)
        for c in ordered
    ]


def _columns(batch: list[PromptRow], samples: list[RolloutSample]) -> dict[str, list]:
    """What reward functions get besides prompts and completions, one entry per completion."""
    columns: dict[str, list] = {
        "reference": [batch[s.group].reference for s in samples],
        "completion_ids": [s.completion_ids for s in samples],
    }
    for name in batch[0].columns if batch else ():
        columns[name] = [batch[s.group].columns.get(name) for s in samples]
    return columns


def _filter(samples: list[RolloutSample], reward: torch.Tensor, rl) -> list[RolloutSample]:
    uniform = uniform_groups(reward, rl.num_generations)  # one flag per prompt group
    return [s for s in samples if not uniform[s.group]]


def _reward_stats(reward: torch.Tensor, scores, samples: list[RolloutSample], n: int) -> dict:
    lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
    stats = {
        "reward": reward.mean().item(),
        "reward_std": reward.std().item() if reward.numel() > 1 else 0.0,
        "reward_group_std": reward.view(-1, n).std(dim=1).mean().item() if n > 1 else 0.0,
        "completion_length": lengths.mean().item(),
        "truncated_ratio": sum(s.truncated for s in samples) / len(samples),
    }
    stats.update({f"rewards/{name}": mean for name, mean in scores.means().items()})
    return stats


def _evaluator(run: RLRun, rewards: RewardSet, sampling: SamplingSpec):
    """Greedy completions of the eval prompts, scored by the same reward functions."""
    def evaluate() -> dict:
        if not run.eval_prompts:
            return {}
        greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=sampling.max_tokens,
                              stop_token_ids=sampling.stop_token_ids)
        completions = sorted(run.roles.generate([p.input_ids for p in run.eval_prompts], greedy),
                             key=lambda c: c.prompt_index)
        samples = [RolloutSample(run.eval_prompts[c.prompt_index].input_ids, c.token_ids, group=c.prompt_index)
                   for c in completions]
        scores = rewards.score(
            [p.prompt_text for p in run.eval_prompts],
            [run.tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples],
            _columns(run.eval_prompts, samples),
        )
        out = {"eval_reward": sum(scores.total) / len(scores.total)}
        out.update({f"eval_rewards/{name}": mean for name, mean in scores.means().items()})
        return out

    return evaluate


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


def _emit(run: RLRun, record: dict) -> None:
    if run.on_log is not None:
        run.on_log(record)
