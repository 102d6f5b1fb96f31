"""GRPO (stage: grpo): the controller loop, one step top to bottom.

    prompts -> rollouts (num_generations per prompt) -> rewards (+ a multi-turn environment's)
    [+ overlong penalty]
    -> [dynamic filtering] -> advantages (per prompt group; REINFORCE++: per token, whitened over
    the kept batch) -> reference log-probs -> policy update(s) -> weight sync -> log
    -> [checkpoint]

The roles (policy ranks, rollout engines, the reference inside the policy) come from fabric/
behind ``RLRoles``; this module only says what a step does. The math is in stages/rl/algorithms/grpo_math.py,
the reward functions in stages/rl/controller/rewards.py, what every RL loop shares in stages/rl/controller/loop.py.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from stages.rl.algorithms.registry import ADVANTAGE_ESTIMATORS
from stages.rl.algorithms.grpo_math import compute_advantages, loss_normalizer, uniform_groups
from stages.rl.controller.loop import RunProgress, count_steps, reward_totals
from stages.rl.controller.rollouts import greedy_samples, sampling_spec
from stages.rl.algorithms.overlong import with_overlong_penalty
from stages.rl.controller.rewards import RewardSet, load_reward_funcs
from stages.rl.controller.roles import RLRun
from stages.rl.controller.steplog import PhaseTimer
from stages.rl.algorithms.masks import loss_token_counts, sample_mask
from stages.rl.algorithms.rollout_correction import rollout_logprob_gap
from stages.engines.types import SamplingSpec
from stages.rl.config.types import RolloutSample

logger = logging.getLogger(__name__)


def run_grpo(run: RLRun) -> dict:
    spec, rl, roles = run.spec, run.spec.rl, run.roles
    # None: a custom environment's step rewards alone score the run (multi_turn.py)
    rewards = load_reward_funcs(rl.reward_funcs, rl.reward_weights) if rl.reward_funcs else None
    sampling = sampling_spec(run)
    progress = RunProgress(run, count_steps(len(run.prompts), rl.rollout_batch_size, spec.training), sampling,
                           evaluate=_evaluator(run, rewards, sampling))
    for step, batch in progress.steps(rl.rollout_batch_size):
        timer = PhaseTimer()
        samples = progress.rollout(step, batch, timer)
        reward, values = _score(run, rewards, batch, samples, timer)
        kept = _filter(samples, reward, rl)
        values["pass_rate"] = len(kept) / len(samples)
        batches = 1
        # DAPO's dynamic sampling: refill with more prompt batches until rollout_batch_size groups
        # with a signal are kept, or max_num_gen_batches were generated; then trim to that size.
        while rl.dynamic_filtering and len(kept) < len(samples) and batches < rl.max_num_gen_batches:
            extra, more = progress.rollouts.refill(step, batches, timer)
            more_reward, _ = _score(run, rewards, extra, more, timer)
            kept += _filter(more, more_reward, rl)
            batches += 1
        if batches > 1:
            kept = kept[: len(samples)]
            values.update({"dynamic/gen_batches": batches, "dynamic/kept_groups": len(kept) // rl.num_generations})
        if len(kept) >= roles.policy_size:
            # Advantages once, over the batch trained on: REINFORCE++ whitens over the whole batch, so
            # dropped groups must not be in its statistics, nor a refill whitened on its own.
            _set_advantages(kept, torch.tensor([s.reward for s in kept]), rl)
            values.update(_update(roles, kept, rl, sampling.temperature, timer))
        else:  # every group was uniform: nothing to learn from this batch
            values["skipped_update"] = 1
        progress.end_step(step, values, timer, recipe_state=dict)
    return progress.finish(plot_keys=("loss", "reward", "eval_reward", "kl"))


def _score(run: RLRun, rewards: Optional[RewardSet], batch, samples: list[RolloutSample], timer: PhaseTimer):
    """The reward each sample is trained on (the reward functions' plus a multi-turn environment's,
    with the overlong penalty), and the step's reward statistics (of the raw reward, as eval_reward is)."""
    with timer("reward"):
        total, means = reward_totals(rewards, batch, samples, run.tokenizer)
    raw = torch.tensor(total, dtype=torch.float32)
    reward, shaping = with_overlong_penalty(raw, samples, run.spec.rl)
    return reward, {**_reward_stats(raw, means, samples, run.spec.rl.num_generations), **shaping}


def _set_advantages(samples: list[RolloutSample], reward: torch.Tensor, rl) -> None:
    """Each sample's reward and advantage: one per completion from its prompt group, or for a per-token
    estimator (REINFORCE++, reinforce_baseline) one per token (the KL being in the loss here: none in
    the rewards)."""
    estimator = ADVANTAGE_ESTIMATORS.get(rl.advantage_estimator)
    if estimator.kind == "per_token":
        mask = sample_mask(samples)  # a multi-turn trajectory's observation tokens carry no reward
        per_token = estimator.fn(reward, torch.zeros_like(mask), mask, 0.0, rl.num_generations, rl.gamma)
        for sample, r, row in zip(samples, reward.tolist(), per_token):
            sample.reward, sample.token_advantages = r, row[: len(sample.completion_ids)].tolist()
        return
    advantages = compute_advantages(reward, rl.num_generations, rl.advantage_estimator, rl.scale_rewards)
    for sample, r, a in zip(samples, reward.tolist(), advantages.tolist()):
        sample.reward, sample.advantage = r, a


def _update(roles, samples: list[RolloutSample], rl, temperature: float, timer: PhaseTimer) -> dict:
    """Reference and old-policy log-probs, then num_iterations optimizer steps on the same samples."""
    checks: dict = {}
    if rl.beta > 0:
        with timer("reference"):
            for sample, ref in zip(samples, roles.reference_logprobs(samples)):
                sample.ref_logprobs = ref
    # The sampling policy's log-probs, the ratio's denominator when the batch is reused
    # (num_iterations > 1), and at temperature 1 (where the sampler reports the same quantity) a
    # check on the weight sync. With one update the current log-probs, detached, are exact, and
    # the update itself reports the check (PolicyWorker.update): no pass of its own.
    if rl.num_iterations > 1:
        with timer("old_logprobs"):
            old = roles.policy_logprobs(samples)
        for sample, logprobs in zip(samples, old):
            sample.old_logprobs = logprobs
        if temperature == 1.0:
            checks = rollout_logprob_gap(samples, old)
    normalizer = loss_normalizer(rl.loss_type, loss_token_counts(samples), rl.max_completion_length)
    metrics: dict = {}
    with timer("update"):
        for _ in range(rl.num_iterations):
            metrics = roles.update(samples, normalizer)
    return {**metrics, **checks}


def _filter(samples: list[RolloutSample], reward: torch.Tensor, rl) -> list[RolloutSample]:
    """The samples, each with its reward; under dynamic_filtering only the prompt groups whose
    rewards differ (the others carry no signal)."""
    for sample, r in zip(samples, reward.tolist()):
        sample.reward = r
    if not rl.dynamic_filtering:
        return samples
    uniform = uniform_groups(reward, rl.num_generations)  # one flag per prompt group
    return [s for s in samples if not uniform[s.group]]


def _reward_stats(reward: torch.Tensor, means: dict, samples: list[RolloutSample], n: int) -> dict:
    lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
    stats = {
        "reward": reward.mean().item(),
        "reward_std": reward.std().item() if reward.numel() > 1 else 0.0,
        "reward_group_std": reward.view(-1, n).std(dim=1).mean().item() if n > 1 else 0.0,
        "completion_length": lengths.mean().item(),
        "truncated_ratio": sum(s.truncated for s in samples) / len(samples),
    }
    stats.update(means)
    return stats


def _evaluator(run: RLRun, rewards: Optional[RewardSet], sampling: SamplingSpec):
    """Greedy completions (or episodes) of the eval prompts, scored as the training ones."""
    def evaluate() -> dict:
        if not run.eval_prompts:
            return {}
        samples = greedy_samples(run, sampling.max_tokens, sampling.stop_token_ids)
        total, means = reward_totals(rewards, run.eval_prompts, samples, run.tokenizer)
        out = {"eval_reward": sum(total) / len(total)}
        out.update({f"eval_{key}": mean for key, mean in means.items()})
        return out

    return evaluate
