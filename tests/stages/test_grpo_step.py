"""One grpo step's wiring (stages/recipes/grpo.py) on synthetic rewards, no Ray: the real loop with
stand-ins for the rollouts, the scoring and the update, so what reaches the update can be read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cluster.config import load_config
from stages.recipes import grpo
from stages.rl.config.types import RolloutSample
from tests.stages.test_rl_loss_variants import GRPO

N = 4  # completions per prompt


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def synthetic(rewards: list[float], lengths: list[int]) -> list[RolloutSample]:
    """Samples whose ``reward`` is what the stand-in scorer gives them (groups of N in a row)."""
    return [RolloutSample([1], [5] * n, group=i // N, reward=r) for i, (r, n) in enumerate(zip(rewards, lengths))]


def run_one_step(monkeypatch, rl, batches: list[list[RolloutSample]]) -> list[RolloutSample]:
    """run_grpo for one step: ``batches[0]`` is the step's rollout, the rest its refills in order.
    Returns the samples the update got."""
    trained: list[list[RolloutSample]] = []

    class Progress:
        def __init__(self, run, total_steps, sampling, evaluate):
            self.rollouts = SimpleNamespace(refill=lambda step, k, timer: ([None] * (len(batches[k]) // N),
                                                                           batches[k]))

        def steps(self, size):
            yield 1, [None] * (len(batches[0]) // N)

        def rollout(self, step, batch, timer):
            return batches[0]

        def end_step(self, step, values, timer, recipe_state):
            pass

        def finish(self, plot_keys):
            return {}

    def score(run, rewards, batch, samples, timer):
        return torch.tensor([s.reward for s in samples]), {}

    def update(roles, samples, rl, temperature, timer):
        trained.append(samples)
        return {}

    monkeypatch.setattr(grpo, "RunProgress", Progress)
    monkeypatch.setattr(grpo, "sampling_spec", lambda run: SimpleNamespace(temperature=1.0))
    monkeypatch.setattr(grpo, "count_steps", lambda *args: 1)
    monkeypatch.setattr(grpo, "_score", score)
    monkeypatch.setattr(grpo, "_update", update)
    run = SimpleNamespace(spec=SimpleNamespace(rl=rl, training=None), roles=SimpleNamespace(policy_size=1), prompts=[])
    grpo.run_grpo(run)
    assert len(trained) == 1
    return trained[0]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_dynamic_filtering_whitens_the_kept_batch_once(monkeypatch, estimator):
    """REINFORCE++ whitens over the batch: the groups dynamic filtering drops must not be in the
    statistics, and refilled groups are whitened with the others, so the tokens the update gets have
    mean 0 and standard deviation 1 (verl's masked_whiten, Bessel-corrected)."""
    g = torch.Generator().manual_seed(3)

    def lengths(count):
        return torch.randint(1, 9, (count,), generator=g).tolist()

    # 4 prompts a step; the first batch keeps 2 groups (two are all 5.0), the refill 2 more (one uniform)
    first = [0.0, 1.0, 0.5, 0.0] + [5.0] * N + [1.0, 0.0, 0.0, 0.0] + [5.0] * N
    refill = [0.2, 0.9, 0.4, 0.7] + [0.0] * N + [1.0, 1.0, 0.0, 1.0] + [3.0, 0.0, 1.0, 2.0]
    rl = load_config({**GRPO, "advantage_estimator": estimator, "num_generations": N, "rollout_batch_size": 4,
                      "dynamic_filtering": True, "max_num_gen_batches": 2}).rl
    kept = run_one_step(monkeypatch, rl, [synthetic(first, lengths(16)), synthetic(refill, lengths(16))])
    assert [s.reward for s in kept] == pytest.approx(first[:4] + first[8:12] + refill[:4] + refill[8:12])
    tokens = torch.tensor([a for s in kept for a in s.token_advantages], dtype=torch.float64)
    assert abs(tokens.mean().item()) < 1e-5 and tokens.std().item() == pytest.approx(1.0, abs=1e-5), (
        tokens.mean().item(), tokens.std().item())
