"""A multi-turn environment's step rewards reach the loss: each trajectory's reward is its reward
functions' total plus what its environment's step() gave (logged as rewards/environment), reward
functions see it as the ``environment_reward`` column, and a custom environment alone may score a
run. Trajectories from the real multi-turn loop with a scripted policy; grpo's and ppo's scoring
called directly, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cluster.config import ConfigError, load_config
from registries.datasets import DataArguments
from stages.engines.types import Completion, SamplingSpec
from stages.loading import load_tokenizer_and_template
from stages.rl.agents.environments import Environment, StepResult
from stages.rl.controller.loop import reward_columns
from stages.rl.agents.multi_turn import multi_turn_rollout
from stages.rl.controller.rewards import load_reward_funcs
from stages.rl.controller.roles import PromptRow
from stages.rl.controller.steplog import PhaseTimer
from tests.stages.test_rl_loss_variants import GRPO

HERE = "tests.stages.test_environment_rewards"


class Graded(Environment):
    """Two steps, each rewarded with the row's reference as a number: 2 x reference in all."""

    def reset(self, row):
        self.weight, self.steps = float(row["reference"]), 0
        return row["prompt"]

    def step(self, action):
        self.steps += 1
        return StepResult(None if self.steps == 2 else "again", self.weight, self.steps == 2)


def half(prompts, completions, **columns):
    return [0.5] * len(completions)


def echo_environment(prompts, completions, environment_reward):
    return list(environment_reward)


@pytest.fixture(scope="module")
def episodes():
    """Two prompts (references 1 and 3) x 2 trajectories of two turns: environment rewards 2, 2, 6, 6."""
    tokenizer, template = load_tokenizer_and_template(
        SimpleNamespace(model_name_or_path="tiny:qwen2"), DataArguments(template="qwen"))
    batch = [PromptRow([1], f"prompt {ref}", reference=ref, messages=[{"role": "user", "content": f"q{ref}"}])
             for ref in ("1", "3")]
    reply = tokenizer.encode("7", add_special_tokens=False)

    def generate(prompts, sampling):
        return [Completion(list(reply), "stop", [-1.0] * len(reply), prompt_index=i) for i in range(len(prompts))]

    samples = multi_turn_rollout([p.environment_row() for p in batch], Graded, template, tokenizer, generate,
                                 SamplingSpec(n=2, max_tokens=16), max_turns=4, max_total_tokens=256)
    return tokenizer, batch, samples


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("funcs", [[f"{HERE}:half"], []])
def test_grpo_trains_on_the_environment_rewards_too(episodes, funcs):
    from stages.recipes.grpo import _score

    tokenizer, batch, samples = episodes
    config = {**GRPO, "environment": f"{HERE}:Graded", "reward_funcs": funcs, "num_generations": 2}
    run = SimpleNamespace(tokenizer=tokenizer, spec=SimpleNamespace(rl=load_config(config).rl))
    rewards = load_reward_funcs(funcs) if funcs else None
    reward, logged = _score(run, rewards, batch, samples, PhaseTimer())
    base = 0.5 if funcs else 0.0
    assert reward.tolist() == pytest.approx([base + 2, base + 2, base + 6, base + 6])
    assert logged["rewards/environment"] == pytest.approx(4.0)
    assert logged["reward"] == pytest.approx(base + 4.0)


def test_ppo_scores_add_the_environment_rewards(episodes):
    from stages.recipes.ppo import Scorer

    tokenizer, batch, samples = episodes
    spec = load_config({**GRPO, "stage": "ppo", "environment": f"{HERE}:Graded", "reward_funcs": [f"{HERE}:half"]})
    scores, logged = Scorer(SimpleNamespace(tokenizer=tokenizer, spec=spec))(batch, samples)
    assert scores == pytest.approx([2.5, 2.5, 6.5, 6.5])
    assert logged["rewards/environment"] == pytest.approx(4.0) and logged[f"rewards/{HERE}:half"] == 0.5


def test_reward_functions_see_the_environment_reward(episodes):
    tokenizer, batch, samples = episodes
    columns = reward_columns(batch, samples, tokenizer)
    assert columns["environment_reward"] == [2.0, 2.0, 6.0, 6.0]
    scores = load_reward_funcs([f"{HERE}:echo_environment"]).score([b.prompt_text for b in batch for _ in "ab"],
                                                                  ["7"] * 4, columns)
    assert scores.total == [2.0, 2.0, 6.0, 6.0]


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_a_custom_environment_alone_may_score_a_run(stage):
    config = {**GRPO, "stage": stage, "environment": f"{HERE}:Graded", "reward_funcs": []}
    assert load_config(config).rl.environment == f"{HERE}:Graded"
    # the built-in tool environment gives no rewards: something else must score
    with pytest.raises(ConfigError, match="needs reward_funcs|needs something to score"):
        load_config({**config, "environment": "tools", "tools": ["calculator"]})
