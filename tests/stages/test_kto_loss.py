"""The KTO loss against the paper's formula computed by hand, row by row, in plain Python floats."""

import math

import pytest
import torch

from stages.recipes.kto import kto_loss

POLICY = [-3.0, -5.5, -2.0, -7.25, -4.0]
REFERENCE = [-4.0, -5.0, -2.5, -6.0, -4.5]
TAGS = [True, False, True, False, False]


def reference_kto(policy, reference, policy_kl, reference_kl, tags, beta, w_d=1.0, w_u=1.0):
    """KTO eq. 7 written out independently: z0 = max(0, mean KL log-ratio); per-row value losses."""
    z0 = max(0.0, sum(p - r for p, r in zip(policy_kl, reference_kl)) / len(policy_kl))
    sigmoid = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    losses, chosen, rejected = [], [], []
    for p, r, tag in zip(policy, reference, tags):
        ratio = p - r
        if tag:
            losses.append(w_d * (1.0 - sigmoid(beta * (ratio - z0))))
            chosen.append(beta * ratio)
        else:
            losses.append(w_u * (1.0 - sigmoid(beta * (z0 - ratio))))
            rejected.append(beta * ratio)
    return sum(losses) / len(losses), chosen, rejected, z0


def tensors(*lists):
    return [torch.tensor(x, dtype=torch.float64) for x in lists]


@pytest.mark.parametrize(
    "policy_kl, reference_kl, beta, w_d, w_u",
    [
        ([-6.0, -3.0, -5.0, -4.0, -2.0], [-6.5, -3.2, -5.5, -4.1, -2.6], 0.1, 1.0, 1.0),  # KL > 0
        ([-6.0, -3.0, -5.0, -4.0, -2.0], [-5.0, -2.0, -4.0, -3.0, -1.0], 0.5, 1.0, 1.0),  # KL < 0: clamped
        ([-6.0, -3.0, -5.0, -4.0, -2.0], [-7.0, -3.0, -5.0, -4.0, -2.0], 2.0, 1.5, 0.6),  # weights
    ],
)
def test_loss_rewards_and_kl_match_the_formula(policy_kl, reference_kl, beta, w_d, w_u):
    out = kto_loss(*tensors(POLICY, REFERENCE, policy_kl, reference_kl), torch.tensor(TAGS), beta, w_d, w_u)
    loss, chosen, rejected, z0 = reference_kto(POLICY, REFERENCE, policy_kl, reference_kl, TAGS, beta, w_d, w_u)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx(chosen, rel=1e-12)
    assert out.rejected_rewards.tolist() == pytest.approx(rejected, rel=1e-12)
    assert out.kl.item() == pytest.approx(z0, abs=1e-12)


def test_negative_kl_estimate_is_clamped_to_zero():
    out = kto_loss(*tensors(POLICY, REFERENCE, [-5.0] * 5, [-4.0] * 5), torch.tensor(TAGS), 0.1)
    assert out.kl.item() == 0.0


def test_gradient_flows_through_the_answers_but_not_the_kl_term():
    policy, policy_kl = tensors(POLICY, [-1.0, -2.0, -3.0, -4.0, -5.0])
    policy.requires_grad_(True)
    policy_kl.requires_grad_(True)
    out = kto_loss(policy, torch.tensor(REFERENCE, dtype=torch.float64), policy_kl,
                   torch.tensor([-2.0, -3.0, -4.0, -5.0, -6.0], dtype=torch.float64), torch.tensor(TAGS), 0.1)
    out.loss.backward()
    assert policy_kl.grad is None
    # d/dp (1 - sigmoid(beta (p - r - z0))) < 0 for desirable rows: raising their log-prob lowers the loss;
    # undesirable rows the other way round.
    for grad, tag in zip(policy.grad.tolist(), TAGS):
        assert (grad < 0) if tag else (grad > 0), (grad, tag)
    # Hand derivative for row 0 (desirable): -beta * s * (1 - s) / n with s = sigmoid(beta*(ratio - z0)).
    beta, z0 = 0.1, 1.0
    s = 1 / (1 + math.exp(-beta * (POLICY[0] - REFERENCE[0] - z0)))
    assert policy.grad[0].item() == pytest.approx(-beta * s * (1 - s) / 5, rel=1e-12)


def test_batch_of_one_kind_has_no_nan_and_empty_other_side():
    out = kto_loss(*tensors(POLICY[:2], REFERENCE[:2], [-1.0, -2.0], [-1.5, -2.5]), torch.tensor([True, True]), 0.1)
    loss, chosen, _, _ = reference_kto(POLICY[:2], REFERENCE[:2], [-1.0, -2.0], [-1.5, -2.5], [True, True], 0.1)
    assert out.loss.item() == pytest.approx(loss, rel=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx(chosen)
    assert out.rejected_rewards.numel() == 0


def test_kl_is_averaged_across_workers_before_clamping():
    # One rank alone sees a negative KL (clamped to 0); averaged with the other ranks it is positive.
    out = kto_loss(*tensors(POLICY, REFERENCE, [-5.0] * 5, [-4.0] * 5), torch.tensor(TAGS), 0.1,
                   reduce_kl=lambda kl: (kl + torch.tensor(3.0, dtype=kl.dtype)) / 2)
    assert out.kl.item() == pytest.approx(1.0)
