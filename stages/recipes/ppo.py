"""PPO (stage: ppo): the controller loop, one step top to bottom, in OpenRLHF's order.

    prompts -> rollouts -> scores (reward model and/or reward functions) [-> running score norm]
    -> policy log-probs, reference log-probs, critic values -> per-token rewards (score at the last
    token, minus kl_coef x KL on every token) -> GAE advantages (whitened) and returns
    -> ppo_epochs x ppo_buffer_size mini-batches: critic step (clipped value loss), policy step
    (clipped surrogate) -> KL controller update -> weight sync -> log -> [checkpoint]

The keys keep LLaMA-Factory's meaning (it runs PPO on TRL 0.9, whose conventions stages/rl/algorithms/ppo_math.py
follows): ppo_epochs, ppo_buffer_size, ppo_target (adaptive KL target, starting from beta),
ppo_score_norm, ppo_whiten_rewards. With a group estimator (advantage_estimator rloo, group_norm...)
no critic is built: each completion's advantage comes from its score minus its KL, compared within
its prompt's group, the same for all its tokens; with reinforce_plus_plus(_baseline) (OpenRLHF's
REINFORCE++) the per-token rewards' returns are whitened over the batch instead, and with
reinforce_baseline (OpenRLHF's) those of the group-centred scores.
"""

from __future__ import annotations

import logging
import os
import random

import torch

from stages.rl.algorithms.registry import ADVANTAGE_ESTIMATORS
from stages.rl.algorithms.grpo_math import compute_advantages, kl_penalty, loss_normalizer
from stages.rl.controller.loop import RunProgress, completion_texts, count_steps, reward_totals
from stages.rl.controller.shards import split_evenly
from stages.rl.controller.rollouts import greedy_samples, sampling_spec
from stages.rl.algorithms.overlong import with_overlong_penalty
from stages.rl.algorithms.ppo_math import RunningMoments, gae, kl_controller, normalize_scores, token_rewards
from stages.rl.controller.remote_reward import HTTPOptions, JudgeReward, RemoteReward, api_reward
from stages.rl.controller.rewards import load_reward_funcs
from stages.rl.controller.roles import PPORoles, PromptRow, RLRun
from stages.rl.controller.steplog import PhaseTimer
from stages.rl.algorithms.masks import loss_token_counts, pad_rows, sample_mask
from stages.rl.algorithms.rollout_correction import rollout_logprob_gap
from stages.engines.types import SamplingSpec
from stages.rl.config.types import RolloutSample

logger = logging.getLogger(__name__)


def run_ppo(run: RLRun) -> dict:
    spec, rl, roles = run.spec, run.spec.rl, run.roles
    score = Scorer(run)
    sampling = sampling_spec(run)
    progress = RunProgress(run, count_steps(len(run.prompts), rl.rollout_batch_size, spec.training), sampling,
                           evaluate=lambda: score.evaluate(sampling))
    kl_ctl = kl_controller(rl.beta, rl.ppo_target if rl.adaptive_kl else None, rl.kl_horizon)
    moments = RunningMoments() if rl.ppo_score_norm else None
    if progress.resumed:
        kl_ctl.load_state_dict(progress.state["kl_controller"])
        if moments is not None:
            moments.load_state_dict(progress.state["score_moments"])

    def recipe_state() -> dict:
        state = {"kl_controller": kl_ctl.state_dict()}
        if moments is not None:
            state["score_moments"] = moments.state_dict()
        return state

    for step, batch in progress.steps(rl.rollout_batch_size):
        timer = PhaseTimer()
        samples = progress.rollout(step, batch, timer)
        with timer("reward"):
            scores, values = score(batch, samples)
        scores_t, shaping = with_overlong_penalty(torch.tensor(scores, dtype=torch.float32), samples, rl)
        values.update(shaping)
        if moments is not None:
            scores_t = normalize_scores(scores_t, moments, shift_mean=True)
        values.update(_experience(roles, samples, scores_t, kl_ctl.value, rl, timer))
        if sampling.temperature == 1.0:  # the sampler's log-probs are comparable: a check on the weight sync
            values.update(rollout_logprob_gap(samples, [s.old_logprobs for s in samples]))
        with timer("update"):
            values.update(_train(roles, samples, rl, random.Random(spec.training.seed * 1_000_003 + step)))
        values["kl_coef"] = kl_ctl.value  # the coefficient this step's rewards were shaped with
        kl_ctl.update(values.get("kl", 0.0), len(samples))
        progress.end_step(step, values, timer, recipe_state)
    return progress.finish(plot_keys=("loss", "value_loss", "reward", "eval_reward", "kl"))


def _experience(roles: PPORoles, samples: list[RolloutSample], scores: torch.Tensor, kl_coef: float, rl,
                timer: PhaseTimer) -> dict:
    """Fill every sample with what the update needs: old and reference log-probs, values,
    advantages and returns. Returns the step's statistics of them."""
    with timer("old_logprobs"):
        old = roles.policy_logprobs(samples)
    ref = None
    if rl.beta > 0:
        with timer("reference"):
            ref = roles.reference_logprobs(samples)
    values = None
    if rl.uses_critic:
        with timer("values"):
            values = roles.critic_values(samples)
    mask = sample_mask(samples)  # multi-turn observation tokens: no KL, reward, advantage or loss
    old_t = pad_rows([torch.tensor(x) for x in old])
    if ref is not None:
        kl_tok = kl_penalty(old_t, pad_rows([torch.tensor(x) for x in ref]), rl.kl_estimator) * mask
    else:
        kl_tok = torch.zeros_like(mask)
    seq_kl = kl_tok.sum(dim=1)
    estimator = ADVANTAGE_ESTIMATORS.get(rl.advantage_estimator)
    stats = {"kl": seq_kl.mean().item(), "score": scores.mean().item()}
    if values is not None:
        values_t = pad_rows([torch.tensor(v) for v in values])
        rewards = token_rewards(scores, kl_tok, mask, kl_coef)
        advantages, returns = gae(rewards, values_t, mask, rl.gamma, rl.lam, whiten_rewards=rl.ppo_whiten_rewards)
        stats.update(values_mean=_masked_mean(values_t, mask), returns_mean=_masked_mean(returns, mask))
    elif estimator.kind == "per_token":  # REINFORCE++, reinforce_baseline: OpenRLHF's KL-shaped token rewards
        advantages = estimator.fn(scores, kl_tok, mask, kl_coef, rl.num_generations, rl.gamma)
        returns = None
    else:  # a group estimator on the KL-shaped sequence reward, the same advantage on every token
        advantages = compute_advantages(scores - kl_coef * seq_kl, rl.num_generations, rl.advantage_estimator,
                                        rl.scale_rewards)[:, None] * mask
        returns = None
    stats["advantages_mean"] = _masked_mean(advantages, mask)
    for i, sample in enumerate(samples):
        n = len(sample.completion_ids)
        sample.reward = float(scores[i])
        sample.old_logprobs = old[i]
        sample.ref_logprobs = ref[i] if ref is not None else []
        sample.token_advantages = advantages[i, :n].tolist()
        if values is not None:
            sample.values, sample.returns = values[i], returns[i, :n].tolist()
    return stats


def _train(roles: PPORoles, samples: list[RolloutSample], rl, rng: random.Random) -> dict:
    """ppo_epochs passes over the rollout batch, each in ppo_buffer_size shuffled mini-batches; a
    mini-batch is one optimizer step of the critic, then one of the policy. Metrics: the mean over
    all of the step's mini-batches."""
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(rl.ppo_epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for part in split_evenly(order, rl.ppo_buffer_size):  # exactly ppo_buffer_size, as the schedule counts
            mini = [samples[i] for i in part]
            metrics: dict = {}
            if rl.uses_critic:
                tokens = float(sum(loss_token_counts(mini)))
                critic = roles.critic_update(mini, max(tokens, 1.0))
                metrics.update({("value_loss" if k == "loss" else f"critic/{k}"): v for k, v in critic.items()})
            normalizer = loss_normalizer(rl.loss_type, loss_token_counts(mini), rl.max_completion_length)
            metrics.update(roles.update(mini, normalizer))
            for key, value in metrics.items():
                if value is not None:
                    sums[key] = sums.get(key, 0.0) + value
            updates += 1
    return {key: value / updates for key, value in sums.items()}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return (x * mask).sum().item() / max(mask.sum().item(), 1.0)


class Scorer:
    """A completion's score: the reward model's (reward_model) plus the weighted reward functions'
    (reward_funcs), either or both, plus a multi-turn environment's step rewards. Also scores
    greedy completions of the eval prompts. With reward_model_type api the reward model is a server
    (or LLM judge) at the URL reward_model, called from here, the controller
    (stages/rl/controller/remote_reward.py); no reward actors exist."""

    def __init__(self, run: RLRun):
        self.run = run
        rl, tuning = run.spec.rl, run.spec.finetuning
        self.rules = load_reward_funcs(rl.reward_funcs, rl.reward_weights) if rl.reward_funcs else None
        self.use_model = bool(tuning.reward_model)
        self.remote = None
        if self.use_model and tuning.reward_model_type == "api":
            self.remote = api_reward(tuning.reward_model, HTTPOptions(
                timeout=rl.reward_api_timeout, retries=rl.reward_api_retries,
                concurrency=rl.reward_api_concurrency, batch_size=rl.reward_api_batch_size,
                api_key=os.environ.get("REWARD_API_KEY") or None),  # never in the config (it is saved)
                rubric=rl.reward_judge_rubric, model=rl.reward_judge_model, max_score=rl.reward_judge_max_score)

    def _remote_scores(self, batch: list[PromptRow], samples: list[RolloutSample]) -> list:
        """The API's score of each completion (None: a judge's reply without a score). A reward
        server speaking plain JSON gets the templated prompt text (OpenRLHF sends prompt + completion
        as the model saw it); ours and a judge get the conversation's messages."""
        rows = [batch[s.group] for s in samples]
        if isinstance(self.remote, RemoteReward) and self.remote.protocol == "json":
            prompts = [row.prompt_text for row in rows]
        else:
            prompts = [([{"role": "system", "content": row.system}] if row.system else []) + list(row.messages)
                       if row.messages else row.prompt_text for row in rows]
        return self.remote(prompts, completion_texts(self.run.tokenizer, samples), [row.reference for row in rows])

    def __call__(self, batch: list[PromptRow], samples: list[RolloutSample]) -> tuple[list[float], dict]:
        total = [0.0] * len(samples)
        stats: dict = {}
        if self.remote is not None:
            remote = self._remote_scores(batch, samples)
            total = [a + (b or 0.0) for a, b in zip(total, remote)]  # None (no score) adds nothing
            scored = [b for b in remote if b is not None]
            stats["rewards/reward_model"] = sum(scored) / len(scored) if scored else float("nan")
            if isinstance(self.remote, JudgeReward):  # the share of replies without a score
                stats["rewards/reward_model_unscored"] = (len(remote) - len(scored)) / len(remote)
        elif self.use_model:
            model_scores = self.run.roles.reward_scores(samples)
            total = [a + b for a, b in zip(total, model_scores)]
            stats["rewards/reward_model"] = sum(model_scores) / len(model_scores)
        rules, means = reward_totals(self.rules, batch, samples, self.run.tokenizer)  # + a multi-turn environment's
        total = [a + b for a, b in zip(total, rules)]
        stats.update(means)
        reward = torch.tensor(total)
        lengths = torch.tensor([float(len(s.completion_ids)) for s in samples])
        stats.update(reward=reward.mean().item(), reward_std=reward.std().item() if len(total) > 1 else 0.0,
                     completion_length=lengths.mean().item(),
                     truncated_ratio=sum(s.truncated for s in samples) / len(samples))
        return total, stats

    def evaluate(self, sampling: SamplingSpec) -> dict:
        """Greedy completions of the eval prompts, scored like the training ones."""
        if not self.run.eval_prompts:
            return {}
        samples = greedy_samples(self.run, sampling.max_tokens, sampling.stop_token_ids)
        _, stats = self(self.run.eval_prompts, samples)
        out = {"eval_reward": stats["reward"]}
        out.update({f"eval_{k}": v for k, v in stats.items() if k.startswith("rewards/")})
        return out
