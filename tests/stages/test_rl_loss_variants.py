"""The loss and sampling variants (GSPO, CISPO, the entropy bonus, REINFORCE++, DAPO's overlong
punishment) against their references on random inputs: TRL 1.16's own code where TRL implements
them (its ``GRPOTrainer._compute_loss`` run on a stand-in trainer, its reward and entropy helpers),
else the papers' / verl's formulas written out here in plain Python. Then the keys from a config."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from cluster.config import ConfigError, load_config
from stages.rl.algorithms.grpo_math import loss_normalizer, policy_loss
from stages.rl.workers.logprobs import token_logprobs
from stages.rl.algorithms.overlong import overlong_penalty, with_overlong_penalty
from stages.rl.algorithms.reinforce_pp import reinforce_pp_advantages
from stages.rl.config.types import RolloutSample

MAX_LEN = 8


def random_batch(seed: int, spread: float = 1.0):
    """Six rows of up to 7 tokens (one empty), old log-probs far enough off that ratios pass every
    clip and the CISPO cap of 5, and entropies; padding holds finite garbage (TRL multiplies it by 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 0, 5, 1, 6]
    mask = (torch.arange(7).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    logp = (-torch.rand(6, 7, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(6, 7, generator=g) * spread
    adv = torch.randn(6, generator=g)
    entropy = (torch.rand(6, 7, generator=g) * 4).requires_grad_()
    return logp, old, adv, mask, entropy, lengths


def trl_loss(logp, old, adv, mask, entropy, *, loss_type, level="token", epsilon_high=0.28, entropy_coef=0.0,
             is_ratio=None):
    """TRL's GRPOTrainer._compute_loss on a stand-in ``self``: the forward returns our log-probs and
    entropies, one process, no accumulation, beta 0; the vLLM importance-sampling correction only when
    ``is_ratio`` (its weights) is given."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    identity = lambda x, **_: x  # noqa: E731 - gather/reduce over one process
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(num_processes=1, gather=identity, reduce=identity, sync_gradients=True),
        _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    b, t = mask.shape
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


def ours(logp, old, adv, mask, entropy, *, loss_type, level="token", epsilon_high=0.28, entropy_coef=0.0, **kw):
    return policy_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=epsilon_high, loss_type=loss_type,
                       max_completion_length=MAX_LEN, importance_sampling_level=level, entropy=entropy,
                       entropy_coef=entropy_coef, **kw)


def grads(loss, *tensors):
    """d loss / d each tensor, zeros for one the loss does not use."""
    out = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, out)]


# --- GSPO, CISPO and the entropy bonus against TRL's own loss ------------------------------------

@pytest.mark.parametrize("loss_type, level, epsilon_high, entropy_coef", [
    ("grpo", "sequence", 0.28, 0.0),  # GSPO as its paper sets it up
    ("dapo", "sequence", 0.28, 0.0),
    ("dr_grpo", "sequence", 0.28, 0.0),
    ("cispo", "token", 5.0, 0.0),
    ("cispo", "sequence", 5.0, 0.0),
    ("dapo", "token", 0.28, 0.01),  # TRL's entropy bonus is a token mean: dapo's aggregation
    ("cispo", "token", 5.0, 0.05),
    ("dapo", "sequence", 0.28, 0.02),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_trl(loss_type, level, epsilon_high, entropy_coef, seed):
    logp, old, adv, mask, entropy, _ = random_batch(seed, spread=2.0 if loss_type == "cispo" else 0.3)
    expected, trl_metrics = trl_loss(logp, old, adv, mask, entropy, loss_type=loss_type, level=level,
                                     epsilon_high=epsilon_high, entropy_coef=entropy_coef)
    got, metrics = ours(logp, old, adv, mask, entropy, loss_type=loss_type, level=level,
                        epsilon_high=epsilon_high, entropy_coef=entropy_coef)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for mine, theirs in zip(grads(got, logp, entropy), grads(expected, logp, entropy)):
        assert torch.allclose(mine * mask, theirs * mask, atol=1e-6)
    assert metrics["entropy"] == pytest.approx(trl_metrics["entropy"][0], rel=1e-6)
    if loss_type == "cispo":  # some weights were capped, and the metric agrees with TRL's
        assert ((logp - old).exp() * mask > epsilon_high).any()
        assert metrics["clip_fraction_high"] == pytest.approx(trl_metrics["cispo_clip_ratio"][0], rel=1e-6)
        assert metrics["clip_fraction_low"] == 0
    else:
        assert metrics["clip_fraction_high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"][0], abs=1e-6)


def test_gspo_is_the_papers_sequence_ratio():
    # GSPO Eq. 7: s = (pi / pi_old)^(1/|y|), clipped as a whole; one row, A > 0, loss = -min(s, clip(s)) A.
    logp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.8), math.log(0.25)]])
    s = (0.5 * 0.9 * 0.2 / (0.4 * 0.8 * 0.25)) ** (1 / 3)  # 1.0400...
    loss, metrics = ours(logp, old, torch.tensor([2.0]), torch.ones(1, 3), None, loss_type="grpo", level="sequence",
                         epsilon_high=0.02)
    assert loss.item() == pytest.approx(-min(s, 1.02) * 2.0, rel=1e-6)
    assert metrics["clip_fraction_high"] == 1.0
    # unclipped: d/dlogp_t of -s A is -s A / |y| on every token
    loss, _ = ours(logp, old, torch.tensor([2.0]), torch.ones(1, 3), None, loss_type="grpo", level="sequence")
    (grad,) = grads(loss, logp)
    assert grad[0].tolist() == pytest.approx([-s * 2.0 / 3] * 3, rel=1e-6)


def test_cispo_is_minimax_m1s_formula():
    # MiniMax-M1 Eq. 4: -sg(clip(r, ., eps_max)) * A * log pi, token mean. Ratios 0.5, 2 and 8 (cap 5).
    logp = torch.tensor([[math.log(0.05), math.log(0.2), math.log(0.8)]], requires_grad=True)
    old = torch.tensor([[math.log(0.1), math.log(0.1), math.log(0.1)]])
    loss, metrics = ours(logp, old, torch.tensor([-1.5]), torch.ones(1, 3), None, loss_type="cispo", epsilon_high=5.0)
    weights = [0.5, 2.0, 5.0]
    logs = [math.log(0.05), math.log(0.2), math.log(0.8)]
    assert loss.item() == pytest.approx(sum(w * 1.5 * lp for w, lp in zip(weights, logs)) / 3, rel=1e-6)
    (grad,) = grads(loss, logp)
    assert grad[0].tolist() == pytest.approx([w * 1.5 / 3 for w in weights], rel=1e-6)  # no token loses its gradient
    assert metrics["clip_fraction_high"] == 0.0  # capped, but A < 0: the cap only counts for A > 0 (as TRL's)
    _, metrics = ours(logp, old, torch.tensor([1.5]), torch.ones(1, 3), None, loss_type="cispo", epsilon_high=5.0)
    assert metrics["clip_fraction_high"] == pytest.approx(1 / 3) and metrics["clip_fraction_low"] == 0.0
    assert loss_normalizer("cispo", [3, 1], MAX_LEN) == loss_normalizer("dapo", [3, 1], MAX_LEN) == 4.0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_entropy_bonus_is_aggregated_like_the_policy_loss(loss_type):
    # A = 0: only the bonus remains. grpo: minus the mean over rows of each row's token-mean entropy;
    # dr_grpo: minus the entropy sum / (rows x max_completion_length).
    logp, old, _, mask, entropy, lengths = random_batch(3)
    loss, metrics = ours(logp, old, torch.zeros(6), mask, entropy, loss_type=loss_type, entropy_coef=0.1)
    rows = [entropy[i, :n].tolist() for i, n in enumerate(lengths)]
    if loss_type == "grpo":
        expected = -0.1 * sum(sum(r) / max(len(r), 1) for r in rows) / len(rows)
    else:
        expected = -0.1 * sum(sum(r) for r in rows) / (len(rows) * MAX_LEN)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["entropy"] == pytest.approx(sum(map(sum, rows)) / sum(lengths), rel=1e-6)
    with pytest.raises(ValueError, match="entropy_coef needs entropy"):
        ours(logp, old, torch.zeros(6), mask, None, loss_type=loss_type, entropy_coef=0.1)


@pytest.mark.parametrize("loss_type, level, entropy_coef", [("cispo", "token", 0.0), ("grpo", "sequence", 0.01),
                                                             ("dapo", "sequence", 0.01)])
def test_micro_batches_still_sum_to_the_full_batch(loss_type, level, entropy_coef):
    logp, old, adv, mask, entropy, lengths = random_batch(4, spread=1.0)
    kw = {"loss_type": loss_type, "level": level, "epsilon_high": 5.0 if loss_type == "cispo" else 0.28,
          "entropy_coef": entropy_coef}
    full, _ = ours(logp, old, adv, mask, entropy, **kw)
    full_grad = grads(full, logp)[0]
    norm = loss_normalizer(loss_type, lengths, MAX_LEN)
    total, grad = 0.0, torch.zeros_like(logp)
    for rows in ([0, 1], [2], [3, 4, 5]):
        t = max(max(lengths[r] for r in rows), 1)
        micro, _ = ours(logp[rows, :t], old[rows, :t], adv[rows], mask[rows, :t], entropy[rows, :t],
                        normalizer=norm, **kw)
        total += micro.item()
        grad += grads(micro, logp)[0]
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(grad, full_grad, atol=1e-6)


def test_entropy_from_the_logits_matches_trl_and_carries_a_gradient():
    from trl.trainer.utils import entropy_from_logits

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 4, 11, generator=g) * 3).requires_grad_()
    ids = torch.randint(0, 11, (3, 4), generator=g)
    for temperature in (1.0, 0.7):
        logp, entropy = token_logprobs(logits, ids, temperature, with_entropy=True)
        assert torch.equal(logp, token_logprobs(logits, ids, temperature))
        assert torch.allclose(entropy, entropy_from_logits(logits.detach() / temperature), atol=1e-5)
    (grad,) = grads(entropy.sum(), logits)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


# --- REINFORCE++ against verl's formulas, written out ------------------------------------------

def whiten(rows: list[list[float]]) -> list[list[float]]:
    """verl's masked_whiten over every token of the batch: Bessel-corrected variance, +1e-8 inside."""
    flat = [x for r in rows for x in r]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in r] for r in rows]


def padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    values = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)
    return values, mask


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_whitens_discounted_returns_over_all_tokens(gamma):
    g = torch.Generator().manual_seed(6)
    lengths = [4, 1, 6, 3, 5, 2]
    # per-token rewards: a KL-like term on every token plus a score on the last (stage ppo's shaping)
    rows = [[float(x) for x in (torch.randn(n, generator=g, dtype=torch.float64) * 0.1)] for n in lengths]
    for r in rows:
        r[-1] += float(torch.rand(1, generator=g))
    returns = []
    for r in rows:
        running, out = 0.0, []
        for x in reversed(r):
            running = x + gamma * running
            out.append(running)
        returns.append(out[::-1])
    rewards, mask = padded(rows)
    got = reinforce_pp_advantages("reinforce_plus_plus", rewards, mask, num_generations=1, gamma=gamma)
    expected, _ = padded(whiten(returns))
    assert torch.allclose(got, expected, atol=1e-10)


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_whitens_tokens():
    lengths = [3, 1, 2, 4, 2, 2]
    scores = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0]  # groups of 3: the second is uniform
    rows = [[0.0] * (n - 1) + [s] for n, s in zip(lengths, scores)]
    centred = [s - sum(scores[i // 3 * 3: i // 3 * 3 + 3]) / 3 for i, s in enumerate(scores)]
    expected, _ = padded(whiten([[c] * n for c, n in zip(centred, lengths)]))
    rewards, mask = padded(rows)
    got = reinforce_pp_advantages("reinforce_plus_plus_baseline", rewards, mask, num_generations=3, gamma=0.5)
    assert torch.allclose(got, expected, atol=1e-10)  # gamma is not used, as in verl
    # The whitening shifts every token, uniform groups too (the token-weighted mean of centred scores is not 0)
    assert got[3, 0].item() == pytest.approx(expected[3, 0].item()) and got[3, 0].item() != 0.0
    with pytest.raises(ValueError, match="num_generations"):
        reinforce_pp_advantages("reinforce_plus_plus_baseline", rewards, mask, num_generations=4)


def test_grpo_recipe_gives_reinforce_plus_plus_token_advantages():
    from stages.recipes.grpo import _set_advantages

    samples = [RolloutSample([1], [5] * n, group=i // 2) for i, n in enumerate([2, 3, 1, 4])]
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rl = load_config({**GRPO, "advantage_estimator": "reinforce_plus_plus_baseline", "num_generations": 2}).rl
    _set_advantages(samples, reward, rl)
    expected = whiten([[0.5] * 2, [-0.5] * 3, [0.0] * 1, [0.0] * 4])
    for sample, row in zip(samples, expected):
        assert sample.token_advantages == pytest.approx(row, abs=1e-6)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0]


def test_ppo_recipe_whitens_the_kl_shaped_returns():
    """Stage ppo's REINFORCE++ (OpenRLHF's): -kl_coef x k1 on every token, the score on the last, returns whitened."""
    from stages.recipes.ppo import _experience
    from stages.rl.controller.steplog import PhaseTimer

    old = [[-1.0, -2.0, -0.5], [-0.3], [-1.2, -0.7]]
    ref = [[-1.5, -1.0, -0.5], [-0.1], [-1.0, -0.9]]
    roles = SimpleNamespace(policy_logprobs=lambda s: old, reference_logprobs=lambda s: ref)
    samples = [RolloutSample([1], [5] * len(o), group=i) for i, o in enumerate(old)]
    scores = [1.0, -0.5, 0.25]
    rl = load_config({**GRPO, "stage": "ppo", "advantage_estimator": "reinforce_plus_plus", "beta": 0.1,
                      "gamma": 0.9}).rl
    _experience(roles, samples, torch.tensor(scores), 0.1, rl, PhaseTimer())
    returns = []
    for o, r, score in zip(old, ref, scores):
        rewards = [-0.1 * (a - b) for a, b in zip(o, r)]
        rewards[-1] += score
        running, out = 0.0, []
        for x in reversed(rewards):
            running = x + 0.9 * running
            out.append(running)
        returns.append(out[::-1])
    for sample, row in zip(samples, whiten(returns)):
        assert sample.token_advantages == pytest.approx(row, abs=1e-5)


# --- DAPO's overlong punishment --------------------------------------------------------------------

def test_overlong_penalty_matches_trl_and_dapo():
    from trl.rewards import get_soft_overlong_punishment

    lengths = list(range(0, 21))
    trl = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=8)([[0] * n for n in lengths])
    assert overlong_penalty(lengths, 20, 8) == pytest.approx(trl)  # factor 1: TRL's reward function
    # verl's penalty_factor scales it: 0 up to 12 tokens, then -(L - 12) / 8 * 0.5, -0.5 at the cap
    assert overlong_penalty([12, 13, 16, 20], 20, 8, 0.5) == pytest.approx([0.0, -0.0625, -0.25, -0.5])
    assert overlong_penalty([20, 5], 20, 0) == [0.0, 0.0]


def test_the_recipes_add_the_overlong_penalty_to_the_reward():
    samples = [RolloutSample([1], [5] * n, group=0) for n in (4, 10, 16)]
    rl = load_config({**GRPO, "max_completion_length": 16, "overlong_buffer_len": 8}).rl
    reward, logged = with_overlong_penalty(torch.tensor([1.0, 1.0, 0.0]), samples, rl)
    assert reward.tolist() == pytest.approx([1.0, 0.75, -1.0])
    assert logged == {"rewards/overlong_penalty": pytest.approx((0.0 - 0.25 - 1.0) / 3)}
    reward, logged = with_overlong_penalty(torch.tensor([1.0, 1.0, 0.0]), samples, load_config(GRPO).rl)  # off
    assert reward.tolist() == [1.0, 1.0, 0.0] and logged == {}


# --- the keys from a config -------------------------------------------------------------------------

GRPO = {"model_name_or_path": "m", "dataset": "prompts", "output_dir": "out", "stage": "grpo",
        "reward_funcs": ["exact_match"]}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_new_keys_flow_from_a_config():
    rl = load_config(GRPO).rl
    assert (rl.importance_sampling_level, rl.entropy_coef, rl.overlong_buffer_len, rl.overlong_penalty_factor) == (
        "token", 0.0, 0, 1.0)
    rl = load_config({**GRPO, "loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence",
                      "entropy_coef": 0.001, "advantage_estimator": "reinforce_plus_plus",
                      "max_completion_length": 64, "overlong_buffer_len": 16, "overlong_penalty_factor": 0.5}).rl
    assert (rl.loss_type, rl.epsilon_high, rl.importance_sampling_level, rl.entropy_coef) == ("cispo", 5.0,
                                                                                             "sequence", 0.001)
    assert (rl.advantage_estimator, rl.overlong_buffer_len, rl.overlong_penalty_factor) == ("reinforce_plus_plus",
                                                                                           16, 0.5)
    # REINFORCE++ proper needs no group: one completion per prompt is fine; its baseline variant needs one
    assert load_config({**GRPO, "advantage_estimator": "reinforce_plus_plus", "num_generations": 1}).rl
    with pytest.raises(ConfigError, match="num_generations must be at least 2"):
        load_config({**GRPO, "advantage_estimator": "reinforce_plus_plus_baseline", "num_generations": 1})
    with pytest.raises(ConfigError, match="a group of num_generations 1 always does"):
        load_config({**GRPO, "advantage_estimator": "reinforce_plus_plus", "num_generations": 1,
                     "dynamic_filtering": True})


@pytest.mark.parametrize("bad, message", [
    ({"loss_type": "cispo"}, "invalid epsilon_high in the config dict: loss_type cispo caps each token's importance "
                             "weight at epsilon_high itself"),
    ({"loss_type": "cispo", "epsilon_high": 0.28}, "must be above 1; got 0.28"),
    ({"entropy_coef": -0.01}, "invalid entropy_coef in the config dict: entropy_coef must be >= 0, got -0.01"),
    ({"overlong_buffer_len": 32}, "must lie in [0, max_completion_length) = [0, 32); got 32"),
    ({"overlong_penalty_factor": -1}, "overlong_penalty_factor is the largest penalty"),
    ({"importance_sampling_level": "seq"}, "wrong value for 'importance_sampling_level' in the config dict: got "
                                           "'seq' (a string), expected one of 'token', 'sequence'."),
    ({"advantage_estimator": "reinforce++"}, "expected one of 'gae', 'group_norm', 'dr_grpo', 'rloo', "
                                             "'reinforce_baseline', 'reinforce_plus_plus', "
                                             "'reinforce_plus_plus_baseline'"),
])
def test_bad_values_are_refused_with_a_clear_message(bad, message):
    with pytest.raises(ConfigError) as info:
        load_config({**GRPO, **bad})
    assert message in str(info.value)
