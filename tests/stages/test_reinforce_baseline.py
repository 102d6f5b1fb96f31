"""advantage_estimator reinforce_baseline is OpenRLHF's (openrlhf/trainer/ppo_utils/experience_maker.py,
``compute_advantages_and_returns``): what both recipes give each token, against that formula written
out here in plain Python on random inputs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cluster.config import load_config
from stages.rl.controller.steplog import PhaseTimer
from stages.rl.config.types import RolloutSample
from tests.stages.test_rl_loss_variants import GRPO

N = 4  # completions per prompt


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def openrlhf_reinforce_baseline(scores: list[float], kl: list[list[float]], kl_coef: float) -> list[list[float]]:
    """OpenRLHF's reinforce_baseline, step by step: each reward minus its prompt's mean; the token
    rewards -kl_coef x kl with that centred reward added on the last token (compute_reward); the
    returns, gamma forced to 1 (get_cumulative_returns), as the advantages; then every action token
    of the batch whitened together, mean and variance over the tokens (divided by their count) and
    1 / sqrt(max(var, 1e-8))."""
    centred = []
    for start in range(0, len(scores), N):
        group = scores[start:start + N]
        centred += [s - sum(group) / N for s in group]
    returns = []
    for c, row in zip(centred, kl):
        rewards = [-kl_coef * k for k in row]
        rewards[-1] += c
        running, out = 0.0, []
        for r in reversed(rewards):
            running = r + running
            out.append(running)
        returns.append(out[::-1])
    tokens = [x for row in returns for x in row]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / len(tokens)
    return [[(x - mean) / math.sqrt(max(var, 1e-8)) for x in row] for row in returns]


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (3 * N,), generator=g).tolist()
    scores = (torch.randn(3 * N, generator=g, dtype=torch.float64) * 2).tolist()
    scores[N:2 * N] = [0.5] * N  # a uniform group: centred exactly 0, shifted by the whitening like the others
    old = [(-torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist() for n in lengths]
    ref = [[x + 0.3 * float(torch.randn(1, generator=g)) for x in row] for row in old]
    samples = [RolloutSample([1], [5] * n, group=i // N) for i, n in enumerate(lengths)]
    return samples, scores, old, ref


def max_diff(samples, expected) -> float:
    """The largest gap per token (a per-sequence ``advantage`` is on each of its tokens, as the update reads it)."""
    got = [s.token_advantages or [s.advantage] * len(s.completion_ids) for s in samples]
    return max(abs(a - b) for mine, row in zip(got, expected) for a, b in zip(mine, row, strict=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_reinforce_baseline_is_openrlhfs(seed):
    """grpo keeps the KL in the loss: OpenRLHF's formula with no KL in the rewards."""
    from stages.recipes.grpo import _set_advantages

    samples, scores, _, _ = random_case(seed)
    rl = load_config({**GRPO, "advantage_estimator": "reinforce_baseline", "num_generations": N}).rl
    _set_advantages(samples, torch.tensor(scores, dtype=torch.float64), rl)
    expected = openrlhf_reinforce_baseline(scores, [[0.0] * len(s.completion_ids) for s in samples], 0.0)
    assert max_diff(samples, expected) < 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_reinforce_baseline_is_openrlhfs(seed):
    """ppo puts the KL (k1 here) into the rewards, per token, as OpenRLHF does."""
    from stages.recipes.ppo import _experience

    samples, scores, old, ref = random_case(seed)
    roles = SimpleNamespace(policy_logprobs=lambda s: old, reference_logprobs=lambda s: ref)
    rl = load_config({**GRPO, "stage": "ppo", "advantage_estimator": "reinforce_baseline", "num_generations": N,
                      "beta": 0.1}).rl
    _experience(roles, samples, torch.tensor(scores, dtype=torch.float64), 0.1, rl, PhaseTimer())
    kl = [[a - b for a, b in zip(o, r)] for o, r in zip(old, ref)]
    assert max_diff(samples, openrlhf_reinforce_baseline(scores, kl, 0.1)) < 1e-6
