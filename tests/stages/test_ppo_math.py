"""PPO math against independent references: plain-Python loops, closed forms worked by hand, numpy."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from registries.errors import UserError
from stages.rl.algorithms.grpo_math import policy_loss
from stages.rl.algorithms.ppo_math import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    gae,
    kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    normalize_scores,
    token_rewards,
    value_loss,
)

GARBAGE = 1e9  # what padding holds in these tests: any leak of it into a result is glaring


def close(tensor, expected, tol=1e-6):
    """Element-wise |tensor - expected| <= tol; ``expected`` is a flat or nested list of floats."""
    expected = torch.tensor(expected, dtype=torch.float64)
    assert tuple(tensor.shape) == tuple(expected.shape)
    assert tensor.flatten().tolist() == pytest.approx(expected.flatten().tolist(), abs=tol)


def ragged(rows: list[list[float]], width: int, pad: float = GARBAGE, dtype=torch.float64):
    """Right-padded [B, width] tensor of ``rows`` and its mask; padding filled with ``pad``."""
    values = [row + [pad] * (width - len(row)) for row in rows]
    mask = [[1] * len(row) + [0] * (width - len(row)) for row in rows]
    return torch.tensor(values, dtype=dtype), torch.tensor(mask)


def plain_whiten(xs: list[float], shift_mean: bool = True, eps: float = 1e-8) -> list[float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    out = [(x - mean) / math.sqrt(var + eps) for x in xs]
    return out if shift_mean else [o + mean for o in out]


def plain_gae(rewards: list[list[float]], values: list[list[float]], gamma: float, lam: float):
    """Per row: A_t = sum_k (gamma*lam)^(k-t) delta_k, delta_k = r_k + gamma V_{k+1} - V_k, V_len = 0."""
    advantages, returns = [], []
    for r, v in zip(rewards, values):
        length = len(r)
        deltas = [r[k] + gamma * (v[k + 1] if k + 1 < length else 0.0) - v[k] for k in range(length)]
        adv = [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, length)) for t in range(length)]
        advantages.append(adv)
        returns.append([a + value for a, value in zip(adv, v)])
    return advantages, returns


def padded_list(rows: list[list[float]], width: int) -> list[list[float]]:
    return [row + [0.0] * (width - len(row)) for row in rows]


# A ragged batch: lengths 5, 3, 1 and one full row of width 6.
REWARDS = [[0.1, -0.2, 0.3, 0.0, 1.5], [0.5, -0.1, -2.0], [0.7], [0.2, 0.2, -0.3, 0.4, 0.1, 0.9]]
VALUES = [[0.3, 0.1, -0.4, 0.2, 0.8], [1.0, 0.6, -0.5], [0.25], [-0.1, 0.0, 0.3, 0.5, -0.2, 0.4]]
WIDTH = 6


# --- GAE ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma, lam", [(0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_a_plain_double_loop(gamma, lam):
    rewards, mask = ragged(REWARDS, WIDTH)
    values, _ = ragged(VALUES, WIDTH, pad=float("nan"))
    adv, ret = gae(rewards, values, mask, gamma, lam, whiten_advantages=False)
    exp_adv, exp_ret = plain_gae(REWARDS, VALUES, gamma, lam)
    close(adv, padded_list(exp_adv, WIDTH))
    close(ret, padded_list(exp_ret, WIDTH))


def test_gae_with_gamma_and_lambda_one_is_future_reward_sum_minus_value():
    rewards, mask = ragged(REWARDS, WIDTH)
    values, _ = ragged(VALUES, WIDTH)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0, whiten_advantages=False)
    expected = [[sum(r[t:]) - v[t] for t in range(len(r))] for r, v in zip(REWARDS, VALUES)]
    close(adv, padded_list(expected, WIDTH))
    # the return of the un-discounted case is the plain reward-to-go
    close(ret, padded_list([[sum(r[t:]) for t in range(len(r))] for r in REWARDS], WIDTH))


def test_gae_whitens_advantages_over_every_completion_token_but_not_returns():
    rewards, mask = ragged(REWARDS, WIDTH)
    values, _ = ragged(VALUES, WIDTH)
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    exp_adv, exp_ret = plain_gae(REWARDS, VALUES, 0.9, 0.8)
    flat = plain_whiten([a for row in exp_adv for a in row])
    lengths = [len(r) for r in REWARDS]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    whitened_rows = [flat[s:s + n] for s, n in zip(starts, lengths)]
    close(adv, padded_list(whitened_rows, WIDTH))
    close(ret, padded_list(exp_ret, WIDTH))
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_whiten_rewards_rescales_rewards_keeping_their_mean():
    rewards, mask = ragged(REWARDS, WIDTH)
    values, _ = ragged(VALUES, WIDTH)
    adv, _ = gae(rewards, values, mask, 0.9, 0.8, whiten_rewards=True, whiten_advantages=False)
    flat = plain_whiten([r for row in REWARDS for r in row], shift_mean=False)
    it = iter(flat)
    scaled = [[next(it) for _ in row] for row in REWARDS]
    exp_adv, _ = plain_gae(scaled, VALUES, 0.9, 0.8)
    close(adv, padded_list(exp_adv, WIDTH))


def test_gae_float32_stays_close_and_float32():
    rewards, mask = ragged(REWARDS, WIDTH, dtype=torch.float32)
    values, _ = ragged(VALUES, WIDTH, dtype=torch.float32)
    adv, ret = gae(rewards, values, mask, 0.9, 0.8, whiten_advantages=False)
    assert adv.dtype == ret.dtype == torch.float32
    close(adv, padded_list(plain_gae(REWARDS, VALUES, 0.9, 0.8)[0], WIDTH), tol=1e-5)


# --- masked statistics --------------------------------------------------------------------------

def test_masked_whiten_gives_mean_zero_unbiased_var_one_and_zero_padding():
    rows = [[3.0, 5.0, 10.0], [-2.0], [4.0, 4.5, 7.0, 1.0]]
    x, mask = ragged(rows, 4)
    flat = [v for row in rows for v in row]
    out = masked_whiten(x, mask)
    kept = out[mask.bool()]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert kept.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    close(kept, plain_whiten(flat))
    assert out[~mask.bool()].tolist() == [0.0] * int((~mask.bool()).sum())

    kept_scaled = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert kept_scaled.mean().item() == pytest.approx(sum(flat) / len(flat), abs=1e-9)
    close(kept_scaled, plain_whiten(flat, shift_mean=False))


def test_masked_statistics_against_numpy_and_nan_padding():
    rows = [[1.0, 2.0, 3.5], [10.0, -4.0]]
    x, mask = ragged(rows, 3, pad=float("nan"))
    flat = np.array([v for row in rows for v in row])
    assert masked_mean(x, mask).item() == pytest.approx(flat.mean(), abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(flat.var(ddof=1), abs=1e-12)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(flat.var(ddof=0), abs=1e-12)
    close(masked_mean(x, mask, dim=1), [6.5 / 3, 3.0], tol=1e-12)
    assert torch.isfinite(masked_whiten(x, mask)).all()


def test_masked_statistics_of_tiny_masks_are_finite():
    x = torch.tensor([[5.0, float("nan")]])
    one, none = torch.tensor([[1, 0]]), torch.tensor([[0, 0]])
    assert masked_var(x, one).item() == 0.0  # one token: no spread, not NaN
    assert masked_whiten(x, one).tolist() == [[0.0, 0.0]]
    assert masked_mean(x, none).item() == 0.0
    assert masked_whiten(x, none).tolist() == [[0.0, 0.0]]


# --- token rewards ------------------------------------------------------------------------------

def test_token_rewards_spread_kl_and_put_the_score_on_the_last_token():
    kl, mask = ragged([[0.5, -0.2, 1.0], [2.0], [0.1, 0.3]], 3, dtype=torch.float32)
    scores = torch.tensor([2.0, -1.0, 0.5])
    rewards = token_rewards(scores, kl, mask, kl_coef=0.1)
    close(rewards, [[-0.05, 0.02, -0.1 + 2.0], [-0.2 - 1.0, 0.0, 0.0], [-0.01, -0.03 + 0.5, 0.0]])


def test_token_rewards_row_without_tokens_is_zero():
    kl = torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    rewards = token_rewards(torch.tensor([4.0, 7.0]), kl, torch.tensor([[1, 1], [0, 0]]), kl_coef=0.5)
    close(rewards, [[-0.5, -0.5 + 4.0], [0.0, 0.0]])


# --- value loss ---------------------------------------------------------------------------------

def test_value_loss_closed_form_with_active_and_inactive_clipping():
    # token 1: v 1.0 clipped to old 0.5 + 0.2 = 0.7: (1-3)^2 = 4 < (0.7-3)^2 = 5.29 -> clipped wins
    # token 2: v 2.0 inside [1.8, 2.2]: both terms (2-1)^2 = 1, a tie, so not counted as clipped
    # token 3: v 1.0 clipped to 0.9 + 0.05 = 0.95: 1 > 0.9025 -> unclipped wins
    values = torch.tensor([[1.0, 2.0, 1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.9, 5.0]], requires_grad=True)
    returns = torch.tensor([[3.0, 1.0, 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    # different clips per token are not possible, so run token 3 in its own call for clip 0.05
    loss, metrics = value_loss(values[:, :2], old[:, :2], returns[:, :2], mask[:, :2], clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (5.29 + 1.0) / 2, abs=1e-6)
    assert metrics["value_clipfrac"] == pytest.approx(0.5)
    assert metrics["value_mean"] == pytest.approx(1.5)
    assert metrics["value_error"] == pytest.approx((4.0 + 1.0) / 2)
    assert metrics["num_tokens"] == 2
    loss.backward()
    # clipped term is flat in v (token 1); token 2: d/dv 0.5 (v - R)^2 / 2 = (2 - 1) / 2
    close(values.grad, [[0.0, 0.5, 0.0, 0.0]])
    assert old.grad is None and returns.grad is None

    values.grad = None
    loss, metrics = value_loss(values[:, 2:], old[:, 2:], returns[:, 2:], mask[:, 2:], clip=0.05)
    assert loss.item() == pytest.approx(0.5 * 1.0, abs=1e-6)  # one token, NaN padding ignored
    assert metrics["value_clipfrac"] == 0.0
    loss.backward()
    close(values.grad, [[0.0, 0.0, 1.0, 0.0]])  # d/dv 0.5 (v - 0)^2 = v = 1


def test_value_loss_without_clip_is_half_mean_squared_error():
    values, mask = ragged([[1.0, -1.0, 0.5], [2.0]], 3, dtype=torch.float32)
    returns, _ = ragged([[0.0, 1.0, 0.5], [-1.0]], 3, dtype=torch.float32)
    old = torch.zeros_like(values)  # far away: would clip everything if clip were on
    loss, metrics = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0 + 0.0 + 9.0) / 4, abs=1e-6)
    assert metrics["value_clipfrac"] == 0.0


def test_value_loss_micro_batches_with_shared_normalizer_sum_to_full_batch():
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    values = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_()
    old = values.detach() + 0.3 * torch.randn(4, 4, generator=g, dtype=torch.float64)
    returns = torch.randn(4, 4, generator=g, dtype=torch.float64)
    full, _ = value_loss(values, old, returns, mask, clip=0.2)
    (full_grad,) = torch.autograd.grad(full, values)
    total_tokens = float(mask.sum())
    parts = [value_loss(values[s], old[s], returns[s], mask[s], clip=0.2, normalizer=total_tokens)[0]
             for s in (slice(0, 1), slice(1, 3), slice(3, 4))]
    summed = sum(parts)
    (summed_grad,) = torch.autograd.grad(summed, values)
    assert summed.item() == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(summed_grad, full_grad, atol=1e-12)


# --- KL controllers -----------------------------------------------------------------------------

def test_adaptive_kl_controller_is_the_hand_product_with_clipped_error():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    for kl, n in [(7.0, 64), (12.0, 64), (0.0, 64), (5.7, 32)]:
        ctl.update(kl, n)
    # errors: 7/6 - 1 = 1/6; 12/6 - 1 = 1 -> 0.2; 0/6 - 1 = -1 -> -0.2; 5.7/6 - 1 = -0.05
    expected = 0.2 * (1 + (1 / 6) * 64 / 1e4) * (1 + 0.2 * 64 / 1e4) * (1 - 0.2 * 64 / 1e4) * (1 - 0.05 * 32 / 1e4)
    assert ctl.value == pytest.approx(expected, rel=1e-12)

    restored = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    restored.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert restored.value == ctl.value


def test_fixed_controller_and_factory():
    fixed = kl_controller(0.05, None, 10000)
    assert isinstance(fixed, FixedKLController)
    fixed.update(100.0, 512)
    assert fixed.value == 0.05 and json.loads(json.dumps(fixed.state_dict())) == {"value": 0.05}
    assert isinstance(kl_controller(0.2, 6.0, 10000), AdaptiveKLController)
    with pytest.raises(UserError, match="positive target"):
        kl_controller(0.2, 0.0, 10000)
    with pytest.raises(UserError, match="initial KL coefficient"):
        kl_controller(-0.1, None)


# --- running moments and score normalisation ----------------------------------------------------

def test_running_moments_match_numpy_over_all_batches_and_survive_a_state_round_trip():
    rng = random.Random(7)
    batches = [[rng.gauss(3.0, 2.0) for _ in range(n)] for n in (5, 3, 8, 2)]
    moments, seen = RunningMoments(), []
    for i, batch in enumerate(batches):
        batch_mean, batch_std = moments.update(torch.tensor(batch, dtype=torch.float32))
        seen += batch
        arr = np.array(seen, dtype=np.float32).astype(np.float64)
        assert moments.mean == pytest.approx(arr.mean(), abs=1e-6)
        assert moments.std == pytest.approx(arr.std(ddof=1), abs=1e-6)
        b = np.array(batch, dtype=np.float32).astype(np.float64)
        assert batch_mean == pytest.approx(b.mean(), abs=1e-6)
        assert batch_std == pytest.approx(b.std(ddof=1), abs=1e-6)
        if i == 1:  # checkpoint mid-way; the restored copy must continue identically
            restored = RunningMoments()
            restored.load_state_dict(json.loads(json.dumps(moments.state_dict())))
    for batch in batches[2:]:
        restored.update(torch.tensor(batch, dtype=torch.float32))
    assert restored.state_dict() == pytest.approx(moments.state_dict(), abs=1e-12)


def test_normalize_scores_updates_first_then_uses_the_updated_moments():
    first, second = [1.0, 2.0, 6.0], [0.0, 4.0]
    moments = RunningMoments()
    normalize_scores(torch.tensor(first), moments, shift_mean=True)
    out = normalize_scores(torch.tensor(second), moments, shift_mean=True)
    everything = np.array(first + second)  # mean 2.6, includes the batch being normalised
    eps = torch.finfo(torch.float32).eps
    std = everything.std(ddof=1)
    close(out, [(s - everything.mean()) / (std + eps) for s in second], tol=1e-6)

    moments = RunningMoments()
    out = normalize_scores(torch.tensor(first), moments, shift_mean=False)
    close(out, [s / (np.std(first, ddof=1) + eps) for s in first], tol=1e-6)


def test_single_first_score_keeps_the_initial_std():
    moments = RunningMoments()
    _, batch_std = moments.update(torch.tensor([4.0]))
    assert math.isnan(batch_std)
    assert moments.mean == pytest.approx(4.0) and moments.std == 1.0


# --- policy loss with per-token advantages ------------------------------------------------------

def _plain_token_loss(ratio: float, adv: float, eps: float = 0.2) -> float:
    clipped = min(max(ratio, 1 - eps), 1 + eps)
    return -min(ratio * adv, clipped * adv)


def test_policy_loss_per_token_advantages_match_hand_token_mean():
    ratios = [[1.5, 0.5, 1.0], [0.7, 1.1, 9.0]]
    advs = [[1.0, -1.0, 0.3], [-2.0, 0.5, float("nan")]]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logp = torch.tensor([[math.log(r) for r in row] for row in ratios], requires_grad=True)
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.2, "max_completion_length": 3}
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), torch.tensor(advs), mask, loss_type="dapo", **kw)
    tokens = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    per_tok = {(b, t): _plain_token_loss(ratios[b][t], advs[b][t]) for b, t in tokens}
    assert loss.item() == pytest.approx(sum(per_tok.values()) / 5, abs=1e-6)
    # clipped per token: (0,0) ratio 1.5 > 1.2 with A > 0; (0,1) 0.5 < 0.8 with A < 0;
    # (1,0) 0.7 < 0.8 with A < 0. (1,2) is padding: ratio 9 with NaN advantage is ignored.
    assert metrics["clip_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["clip_fraction_low"] == pytest.approx(2 / 5)
    assert metrics["clip_fraction"] == pytest.approx(3 / 5)
    loss.backward()
    # unclipped tokens: d/dlogp (-ratio * A) / 5 = -ratio * A / 5; clipped ones 0; padding 0
    close(logp.grad, [[0.0, 0.0, -1.0 * 0.3 / 5], [0.0, -1.1 * 0.5 / 5, 0.0]])

    grpo, _ = policy_loss(logp, torch.zeros(2, 3), torch.tensor(advs), mask, loss_type="grpo", **kw)
    row_means = [sum(per_tok[(0, t)] for t in range(3)) / 3, sum(per_tok[(1, t)] for t in range(2)) / 2]
    assert grpo.item() == pytest.approx(sum(row_means) / 2, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_policy_loss_constant_per_row_token_advantages_equal_sequence_advantages(loss_type):
    g = torch.Generator().manual_seed(11)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    logp = (0.3 * torch.randn(3, 4, generator=g)).requires_grad_()
    old = 0.3 * torch.randn(3, 4, generator=g)
    seq_adv = torch.tensor([0.8, -1.3, 0.4])
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.28, "loss_type": loss_type, "max_completion_length": 4,
          "ref_logp": torch.zeros(3, 4), "beta": 0.04}
    a, ma = policy_loss(logp, old, seq_adv, mask, **kw)
    (grad_a,) = torch.autograd.grad(a, logp)
    b, mb = policy_loss(logp, old, seq_adv.unsqueeze(1).expand(3, 4).clone(), mask, **kw)
    (grad_b,) = torch.autograd.grad(b, logp)
    assert a.item() == pytest.approx(b.item(), abs=1e-7)
    assert torch.allclose(grad_a, grad_b, atol=1e-7)
    assert ma == pytest.approx(mb)


def test_policy_loss_rejects_advantages_of_another_shape():
    with pytest.raises(ValueError, match=r"advantages \[B\] or \[B, T\]"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3),
                    epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=3)
