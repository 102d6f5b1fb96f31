"""GRPO math against closed forms worked out by hand (plain Python floats, no torch formulas)."""

import math

import pytest
import torch

from stages.rl.algorithms.grpo_math import compute_advantages, kl_penalty, loss_normalizer, policy_loss, uniform_groups

EPS = 1e-4
# Two groups of four: [1, 0, 0, 1] (mean 0.5) and [0, 0, 0, 4] (mean 1).
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 4.0]
CENTRED = [0.5, -0.5, -0.5, 0.5, -1.0, -1.0, -1.0, 3.0]


def close(tensor, expected, tol=1e-6):
    assert tensor.tolist() == pytest.approx(expected, abs=tol)


# --- advantages ---------------------------------------------------------------------------------

def test_group_norm_per_group_std_is_unbiased():
    # group 1: squared deviations 4 * 0.25 = 1, / (n - 1) = 1/3;  group 2: 1 + 1 + 1 + 9 = 12, / 3 = 4
    s1, s2 = math.sqrt(1 / 3), 2.0
    adv = compute_advantages(torch.tensor(REWARDS), 4, "group_norm")
    expected = [c / (s1 + EPS) for c in CENTRED[:4]] + [c / (s2 + EPS) for c in CENTRED[4:]]
    close(adv, expected)
    assert adv[0].item() == pytest.approx(0.8658752, abs=1e-6)  # 0.5 / (0.57735027 + 1e-4)


def test_group_norm_batch_and_none_scaling():
    # all 8 rewards: mean 0.75, squared deviations sum to 13.5, unbiased variance 13.5 / 7
    batch_std = math.sqrt(13.5 / 7)
    adv = compute_advantages(torch.tensor(REWARDS), 4, "group_norm", "batch")
    close(adv, [c / (batch_std + EPS) for c in CENTRED])
    close(compute_advantages(torch.tensor(REWARDS), 4, "group_norm", "none"), CENTRED)


def test_dr_grpo_only_centres():
    close(compute_advantages(torch.tensor(REWARDS), 4, "dr_grpo"), CENTRED)


def test_rloo_uses_the_mean_of_the_other_completions():
    # group 1 (sum 2): 1 - 1/3, 0 - 2/3;  group 2 (sum 4): 0 - 4/3, 4 - 0
    close(compute_advantages(torch.tensor(REWARDS), 4, "rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4 / 3, -4 / 3, -4 / 3, 4.0])


def test_odd_group_size():
    # [0, 0, 3]: mean 1, centred [-1, -1, 2], unbiased std sqrt(6 / 2)
    close(compute_advantages(torch.tensor([0.0, 0.0, 3.0]), 3, "group_norm"),
          [c / (math.sqrt(3) + EPS) for c in (-1.0, -1.0, 2.0)])


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_uniform_groups_get_exact_zeros(estimator, scale):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.0])
    adv = compute_advantages(rewards, 3, estimator, scale)
    assert not torch.isnan(adv).any()
    assert adv[:6].tolist() == [0.0] * 6
    assert adv[6:].abs().sum() > 0
    all_equal = compute_advantages(torch.full((4,), 0.3), 2, estimator, scale)
    assert all_equal.tolist() == [0.0] * 4  # even a batch std of 0 gives no NaN


def test_integer_rewards_and_float64_kept():
    assert compute_advantages(torch.tensor([1, 0]), 2, "dr_grpo").tolist() == [0.5, -0.5]
    assert compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2, "dr_grpo").dtype == torch.float64


def test_advantage_errors():
    with pytest.raises(ValueError, match="groups of num_generations=3"):
        compute_advantages(torch.zeros(4), 3, "group_norm")
    with pytest.raises(ValueError, match="num_generations >= 2"):
        compute_advantages(torch.zeros(4), 1, "group_norm")
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        compute_advantages(torch.zeros(4), 2, "ppo")
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(torch.zeros(4), 2, "group_norm", "token")
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(torch.tensor([0.0, float("nan")]), 2, "group_norm")


def test_uniform_groups():
    assert uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4).tolist() == [False, True]
    assert uniform_groups(torch.tensor([0.5, 0.5 + 1e-9, 0.0, 1.0]), 2).tolist() == [True, False]
    assert uniform_groups(torch.tensor([1, 1]), 2).dtype == torch.bool


# --- KL -----------------------------------------------------------------------------------------

LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-1.5, -1.0, -0.5])  # log r = [0.5, -1.0, 0.0]


def test_kl_estimators_match_hand_formulas():
    close(kl_penalty(LOGP, REF, "k1"), [0.5, -1.0, 0.0])
    close(kl_penalty(LOGP, REF, "k2"), [0.125, 0.5, 0.0])
    close(kl_penalty(LOGP, REF, "k3"), [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0])
    with pytest.raises(ValueError, match="Unknown KL estimator"):
        kl_penalty(LOGP, REF, "k4")


def test_k3_is_non_negative_and_finite_when_extreme():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    extreme = kl_penalty(torch.tensor([0.0, -1000.0]), torch.tensor([-1000.0, 0.0]), "k3")
    assert torch.isfinite(extreme).all()
    # log r clamped to +-20 (float32 at ~5e8: compare relatively)
    assert extreme.tolist() == pytest.approx([math.exp(-20) - 1 + 20, math.exp(20) - 1 - 20], rel=1e-6)


# --- policy loss --------------------------------------------------------------------------------

def _loss(logp, old, adv, mask, **kw):
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.2, "loss_type": "dapo", "max_completion_length": 5, **kw}
    return policy_loss(logp, old, adv, mask, **kw)


def test_clipping_cuts_the_gradient_only_where_it_should():
    # One token per row, old logp 0 so ratio = exp(logp). Rows: (ratio, A) =
    # (1.5, +1) clipped high; (0.5, -1) clipped low; (0.5, +1) and (1.5, -1) not clipped.
    ratios, adv = [1.5, 0.5, 0.5, 1.5], [1.0, -1.0, 1.0, -1.0]
    logp = torch.tensor([[math.log(r)] for r in ratios], requires_grad=True)
    loss, metrics = _loss(logp, torch.zeros(4, 1), torch.tensor(adv), torch.ones(4, 1))
    loss.backward()
    # per token: -min(1.5, 1.2) = -1.2; -min(-0.5, -0.8) = 0.8; -0.5; 1.5; dapo = mean over 4 tokens
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 0.5 + 1.5) / 4, abs=1e-6)
    # d/dlogp of -ratio * A is -ratio * A; clipped rows get 0
    close(logp.grad.flatten(), [0.0, 0.0, -0.5 / 4, 1.5 / 4])
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["clip_fraction_low"] == pytest.approx(0.25)
    assert metrics["clip_fraction_high"] == pytest.approx(0.25)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["num_tokens"] == 4
    assert "kl" not in metrics


def test_asymmetric_epsilon_high():
    logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
    loss, metrics = _loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), epsilon_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25) and logp.grad.item() == pytest.approx(-1.25)
    assert metrics["clip_fraction"] == 0.0
    logp.grad = None
    loss, metrics = _loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))  # symmetric 0.2
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and logp.grad.item() == 0.0
    assert metrics["clip_fraction"] == 1.0


def _two_rows():
    # row 0: A = 1, ratios [1.1, 0.9, 1.0] -> per-token -1.1, -0.9, -1.0 (mean -1.0, sum -3.0)
    # row 1: A = -2, ratio [1.05] then padding holding -inf -> per-token 2.1
    logp = torch.tensor([[math.log(1.1), math.log(0.9), 0.0], [math.log(1.05), -math.inf, -math.inf]],
                        requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return logp, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", (-1.0 + 2.1) / 2),  # mean of the sequence means
    ("dapo", (-3.0 + 2.1) / 4),  # token mean over 4 tokens
    ("dr_grpo", (-3.0 + 2.1) / (2 * 5)),  # sum / (B * max_completion_length)
])
def test_loss_type_aggregation(loss_type, expected):
    logp, old, adv, mask = _two_rows()
    loss, _ = _loss(logp, old, adv, mask, loss_type=loss_type)
    loss.backward()
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert torch.isfinite(logp.grad).all() and logp.grad[1, 1:].tolist() == [0.0, 0.0]  # padding: no grad, no NaN


def test_kl_term_and_metric():
    # ratio 1 and A = 0: only beta * kl remains. log r = [0.5, -1.0] -> k3 = [e^-0.5 - 0.5, e - 2]
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    k3 = [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]
    loss, metrics = _loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), ref_logp=ref, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, abs=1e-6)
    assert metrics["kl"] == pytest.approx(sum(k3) / 2, abs=1e-6)
    loss, metrics = _loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), ref_logp=ref, kl_estimator="k1")
    assert loss.item() == 0.0 and metrics["kl"] == pytest.approx(-0.25)  # beta 0: logged, not in the loss
    with pytest.raises(ValueError, match="ref_logp"):
        _loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), beta=0.1)


def test_gradients_flow_to_logp_only():
    logp, old, ref = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    loss, _ = _loss(logp, old, adv, torch.ones(2, 3), ref_logp=ref, beta=0.5)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert old.grad is None and ref.grad is None and adv.grad is None


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        _loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="loss_type"):
        _loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), loss_type="bnpo")


def test_loss_normalizer():
    assert loss_normalizer("grpo", [3, 1, 0], 5) == 3.0
    assert loss_normalizer("dapo", torch.tensor([3, 1, 0]), 5) == 4.0
    assert loss_normalizer("dr_grpo", [3, 1, 0], 5) == 15.0
    assert loss_normalizer("dapo", [0, 0], 5) == 1.0 and loss_normalizer("grpo", [], 5) == 1.0


def _random_batch(seed=0, batch=6, width=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 0, 5, 1, 6]
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    logp = (-torch.rand(batch, width, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(batch, width, generator=g) * 0.3  # some ratios beyond the clip
    ref = logp.detach() + torch.randn(batch, width, generator=g) * 0.5
    adv = torch.randn(batch, generator=g)
    return logp, old, ref, adv, mask, lengths


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_the_full_batch(loss_type):
    logp, old, ref, adv, mask, lengths = _random_batch()
    kw = {"loss_type": loss_type, "epsilon_high": 0.28, "ref_logp": ref, "beta": 0.04}
    full, metrics = _loss(logp, old, adv, mask, **kw)
    assert 0 < metrics["clip_fraction"] < 1
    full.backward()
    full_grad, logp.grad = logp.grad.clone(), None

    norm = loss_normalizer(loss_type, lengths, 5)
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):  # each micro-batch padded only to its own longest row
        t = max(max(lengths[r] for r in rows), 1)
        micro, _ = _loss(logp[rows, :t], old[rows, :t], adv[rows], mask[rows, :t], normalizer=norm,
                         **{**kw, "ref_logp": ref[rows, :t]})
        micro.backward()
        total += micro.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(logp.grad, full_grad, atol=1e-6)

    # Two DDP ranks: each divides the global normaliser by the world size; DDP averages their grads.
    rank_grads = []
    for rows in ([0, 1, 2], [3, 4, 5]):
        logp.grad = None
        micro, _ = _loss(logp[rows], old[rows], adv[rows], mask[rows], normalizer=norm / 2,
                         **{**kw, "ref_logp": ref[rows]})
        micro.backward()
        rank_grads.append(logp.grad.clone())
    assert torch.allclose((rank_grads[0] + rank_grads[1]) / 2, full_grad, atol=1e-6)
