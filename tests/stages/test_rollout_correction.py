"""Rollout correction (stages/rl/algorithms/rollout_correction.py): the weights' closed form for every mode,
TRL 1.16's own code on random inputs (the weights, and the loss they enter), the keys from a config,
and the real policy update: unchanged when the sampler agrees with the trainer, re-weighted as the
closed form says when it does not."""

from __future__ import annotations

import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from cluster.config import ConfigError, load_config
from stages.rl.algorithms.grpo_math import loss_normalizer
from stages.rl.config.rl_args import default_correction
from stages.rl.algorithms.rollout_correction import MODES, RolloutCorrection, sampler_logprobs
from tests.stages.test_rl_loss_variants import GRPO, grads, ours, random_batch, trl_loss
from tests.stages.test_rl_policy import policy, samples

# Two completions (3 and 2 tokens) whose trainer / sampler ratios are 2, 4, 0.2 and 0.5, 1; the
# padding holds garbage. Sequence ratios: 2 x 4 x 0.2 = 1.6 and 0.5.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 9.0]])
SAMPLER = TRAINER - torch.tensor([[math.log(2), math.log(4), math.log(0.2)], [math.log(0.5), 0.0, -3.0]])


@pytest.mark.parametrize("mode, clip_min, clip_max, expected", [
    ("token_truncate", None, 3.0, [[2, 3, 0.2], [0.5, 1, None]]),
    ("token_truncate", 0.25, 3.0, [[2, 3, 0.25], [0.5, 1, None]]),
    ("token_truncate", 0.6, None, [[2, 4, 0.6], [0.6, 1, None]]),
    ("token_mask", None, 3.0, [[2, 0, 0.2], [0.5, 1, None]]),
    ("token_mask", 0.25, 3.0, [[2, 0, 0], [0.5, 1, None]]),
    ("sequence_truncate", None, 3.0, [[1.6], [0.5]]),
    ("sequence_truncate", 0.6, 1.5, [[1.5], [0.6]]),
    ("sequence_mask", None, 1.5, [[0], [0.5]]),
    ("sequence_mask", 0.6, 3.0, [[1.6], [0]]),
])
def test_weights_are_their_closed_form(mode, clip_min, clip_max, expected):
    trainer = TRAINER.clone().requires_grad_()  # the weights must not carry its graph
    got = RolloutCorrection(mode, clip_min, clip_max).weights(trainer, SAMPLER, MASK)
    assert not got.requires_grad
    assert got.shape == ((2, 1) if mode.startswith("sequence") else (2, 3))
    for row, want in zip(got.tolist(), expected):
        for value, w in zip(row, want):
            if w is not None:  # padding: any value, the loss masks it
                assert value == pytest.approx(w, rel=1e-5, abs=1e-7)


def test_tokens_the_sampler_did_not_score_get_weight_one():
    sampler = SAMPLER.clone()
    sampler[0, 1] = math.nan
    got = RolloutCorrection("token_mask", None, 3.0).weights(TRAINER, sampler, MASK)
    assert got[0].tolist() == pytest.approx([2.0, 1.0, 0.2], rel=1e-5)
    padded = sampler_logprobs([[-1.0, -2.0], None], torch.zeros(2, 3))
    assert padded[0, :2].tolist() == [-1.0, -2.0] and torch.isnan(padded[0, 2]) and torch.isnan(padded[1]).all()


def test_metrics_are_their_closed_form():
    ratios = torch.tensor([2.0, 4.0, 0.2, 0.5, 1.0])
    metrics = RolloutCorrection("token_truncate", None, 3.0).metrics(TRAINER, SAMPLER, MASK)
    assert metrics["rollout_is_ratio_mean"] == pytest.approx(ratios.mean().item(), rel=1e-5)
    assert metrics["rollout_is_ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert metrics["rollout_is_weight_mean"] == pytest.approx((2 + 3 + 0.2 + 0.5 + 1) / 5, rel=1e-5)
    assert metrics["rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
    # KL(sampler || trainer), estimated on the sampler's tokens: mean of r - 1 - log r (k3)
    assert metrics["rollout_is_kl"] == pytest.approx((ratios - 1 - ratios.log()).mean().item(), rel=1e-5)
    seq = RolloutCorrection("sequence_mask", None, 1.5).metrics(TRAINER, SAMPLER, MASK)
    assert seq["rollout_is_ratio_max"] == pytest.approx(1.6, rel=1e-5)
    assert seq["rollout_is_masked_fraction"] == 0.5 and seq["rollout_is_weight_mean"] == pytest.approx(0.25)


# --- TRL 1.16's own code ---------------------------------------------------------------------------


def trl_weights(old, sampling, mask, mode, clip_min, clip_max) -> torch.Tensor:
    """The block of GRPOTrainer._generate_and_score_completions that computes
    ``vllm_importance_sampling_ratio``, cut from TRL's installed source and run as it is."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index("if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                         "                mask = completion_mask")
    end = source.index("# Compute the per-token log probabilities for the reference model")
    block = source[source.rindex("\n", 0, start) + 1:end]
    scope = {"torch": torch, "math": math, "old_per_token_logps": old, "sampling_per_token_logps": sampling,
             "completion_mask": mask, "tool_mask": None,
             "self": SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                                     vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                                     vllm_importance_sampling_clip_max=clip_max)}
    exec(textwrap.dedent(block), scope)  # noqa: S102 - TRL's code, from the installed package
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 2.0), (0.8, None)])
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_equal_trls(mode, clip_min, clip_max, seed):
    logp, old, _, mask, _, _ = random_batch(seed, spread=0.4)
    sampler = old - torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 7)) * 0.3
    sampler[0, 2] = math.nan  # a token the sampler did not score
    expected = trl_weights(old, sampler, mask, mode, clip_min, clip_max)
    got = RolloutCorrection(mode, clip_min, clip_max).weights(old, sampler, mask)
    assert got.shape == expected.shape
    keep = mask if got.shape[1] > 1 else 1  # token modes: padding is masked out of the loss anyway
    assert torch.allclose(got * keep, expected * keep, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_weighted_loss_equals_trls(loss_type, mode):
    """The weights enter the loss where TRL puts them: after clipping, on the per-token surrogate."""
    epsilon_high = 5.0 if loss_type == "cispo" else 0.28
    logp, old, adv, mask, entropy, _ = random_batch(3, spread=0.3)
    sampler = old - torch.randn(old.shape, generator=torch.Generator().manual_seed(11)) * 0.5
    weights = RolloutCorrection(mode, 0.5, 2.0).weights(old, sampler, mask)
    expected, _ = trl_loss(logp, old, adv, mask, entropy, loss_type=loss_type, epsilon_high=epsilon_high,
                           is_ratio=weights)
    got, _ = ours(logp, old, adv, mask, entropy, loss_type=loss_type, epsilon_high=epsilon_high,
                  rollout_weights=weights)
    unweighted, _ = ours(logp, old, adv, mask, entropy, loss_type=loss_type, epsilon_high=epsilon_high)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert got.item() != pytest.approx(unweighted.item(), rel=1e-3)
    (mine,), (theirs,) = grads(got, logp), grads(expected, logp)
    assert torch.allclose(mine * mask, theirs * mask, atol=1e-6)


# --- the keys from a config ------------------------------------------------------------------------


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_default_is_off_for_the_synchronous_loop_and_on_for_async():
    assert default_correction(asynchronous=False) is False and default_correction(asynchronous=True) is True
    assert RolloutCorrection.from_args(load_config(dict(GRPO)).rl) is None


def test_keys_flow_from_yaml(in_tmp):
    rl = load_config(dict(GRPO)).rl
    assert (rl.vllm_importance_sampling_correction, rl.vllm_importance_sampling_mode,
            rl.vllm_importance_sampling_clip_max, rl.vllm_importance_sampling_clip_min) == (
        False, "sequence_mask", 3.0, None)  # TRL's mode and bounds, off (synchronous)
    with open("cfg.yaml", "w") as f:
        f.write("model_name_or_path: m\ndataset: prompts\noutput_dir: out\nstage: ppo\nreward_funcs: [exact_match]\n"
                "vllm_importance_sampling_correction: true\nvllm_importance_sampling_mode: token_truncate\n"
                "vllm_importance_sampling_clip_min: 0.5\nvllm_importance_sampling_clip_max: 2.0\n")
    run = load_config("cfg.yaml")
    assert RolloutCorrection.from_args(run.rl) == RolloutCorrection("token_truncate", 0.5, 2.0)
    assert load_config(run.write_yaml()).resolved() == run.resolved()  # the saved config repeats the run
    old_name = load_config({**GRPO, "vllm_importance_sampling_cap": 5.0}).rl  # TRL's deprecated name
    assert (old_name.vllm_importance_sampling_clip_max, old_name.vllm_importance_sampling_cap) == (5.0, None)


@pytest.mark.parametrize("bad, message", [
    ({"vllm_importance_sampling_mode": "token"}, "wrong value for 'vllm_importance_sampling_mode' in the config dict"),
    ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 2.0},
     "invalid vllm_importance_sampling_clip_min in the config dict: vllm_importance_sampling_clip_min (2.0) must be "
     "less than vllm_importance_sampling_clip_max (2.0)"),
    ({"vllm_importance_sampling_clip_max": -1.0}, "which is always positive, so it must be above 0 or unset"),
    ({"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate",
      "vllm_importance_sampling_clip_max": None}, "but both bounds are unset"),
    ({"vllm_importance_sampling_correction": True, "temperature": 0.7},
     "with temperature 0.7: the engines report raw log-probs"),
])
def test_bad_values_are_refused(in_tmp, bad, message):
    with pytest.raises(ConfigError) as info:
        load_config({**GRPO, **bad})
    assert message in str(info.value)


@pytest.mark.parametrize("cut, key", [({"top_k": 50}, "top_k 50"), ({"top_p": 0.9}, "top_p 0.9"),
                                      ({"top_k": 20, "top_p": 0.8}, "top_k 20")])
def test_truncated_sampling_is_refused_where_the_correction_is_on(in_tmp, cut, key):
    """The engines report raw log-probs, of the whole distribution; top_k / top_p sample from a cut,
    renormalised one, so the importance weights would be wrong: refused as temperature != 1 is."""
    with pytest.raises(ConfigError) as info:
        load_config({**GRPO, **cut, "vllm_importance_sampling_correction": True})
    assert str(info.value) == (
        f"vllm_importance_sampling_correction in the config dict with {key} (in the config dict): the engines "
        "report raw log-probs, of the whole distribution, while top_k / top_p sample from a cut and renormalised "
        "one, so the trainer / sampler ratio is not the sampling mismatch and the importance weights would be "
        "wrong. Set top_k: 0 and top_p: 1.0, or vllm_importance_sampling_correction: false.")
    with pytest.raises(ConfigError) as info:  # asynchronous rollouts turn it on by default
        load_config({**GRPO, **cut, "async_rollout": "one_step"})
    assert str(info.value).startswith(
        f"async_rollout one_step in the config dict turns rollout correction on by default (importance weights for "
        f"samples drawn from older weights), but with {key} (in the config dict) its weights would be wrong: ")
    assert str(info.value).endswith("Set top_k: 0 and top_p: 1.0, or vllm_importance_sampling_correction: false to "
                                    "train on stale samples uncorrected.")
    # the defaults (no cut), and a cut without the correction, stay valid
    assert load_config({**GRPO, "async_rollout": "one_step"}).generating.top_k == 0
    assert load_config({**GRPO, **cut, "async_rollout": "one_step",
                        "vllm_importance_sampling_correction": False}).rl.async_rollout == "one_step"
    assert load_config({**GRPO, **cut}).rl.vllm_importance_sampling_correction is False


# --- the real policy update ------------------------------------------------------------------------


def _step(tmp_path, batch, **overrides) -> tuple[torch.Tensor, dict]:
    """One update of a fresh tiny policy; a huge adam_epsilon makes the step proportional to the
    gradient (see test_rl_policy), so equal steps mean equal gradients."""
    worker = policy(tmp_path, per_device_train_batch_size=3, adam_epsilon=1e3, learning_rate=100.0,
                    loss_type="dapo", **overrides)
    before = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
    report = worker.update(batch, loss_normalizer("dapo", [len(s.completion_ids) for s in batch], 32))
    return torch.cat([p.detach().flatten() for p in worker.model.parameters()]) - before, report


def _with_logprobs(tmp_path, shift) -> list:
    """samples() with the tiny policy's own log-probs as old ones and the sampler's shifted by ``shift(i, t)``."""
    batch = samples()
    old = policy(tmp_path).logprobs(batch)
    for i, (sample, row) in enumerate(zip(batch, old)):
        sample.old_logprobs = row
        sample.rollout_logprobs = [lp - shift(i, t) for t, lp in enumerate(row)]
    return batch


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs().max() / b.abs().max()) < 1e-5)


def test_update_is_unchanged_when_the_sampler_agrees(tmp_path):
    on = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_mask"}
    batch = _with_logprobs(tmp_path, lambda i, t: 0.0)
    plain, _ = _step(tmp_path, batch)
    corrected, report = _step(tmp_path, batch, **on)
    assert torch.equal(plain, corrected)  # every weight is exactly 1
    assert report["rollout_is_ratio_max"] == 1.0 and report["rollout_is_masked_fraction"] == 0.0
    # One update per rollout: the trainer's side is the update's own forward, the sampler's a separate pass
    for sample in batch:
        sample.old_logprobs = []
    plain, _ = _step(tmp_path, batch)
    corrected, report = _step(tmp_path, batch, **on)
    assert _close(corrected, plain) and report["rollout_is_kl"] < 1e-6


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_shifted_sampler_reweights_the_gradient_as_the_closed_form(tmp_path, mode):
    """At ratio 1 (old = current) the clipped surrogate's gradient is -A grad logp, so weights w
    give the gradient of advantages A x w: the update with correction equals the plain update
    whose per-token advantages are A x w (sequence modes: w of the row on each of its tokens)."""
    shift = lambda i, t: 0.4 * ((i + t) % 3 - 1)  # noqa: E731 - log(trainer / sampler) per token: -0.4, 0, 0.4
    batch = _with_logprobs(tmp_path, shift)
    scaled = []
    for i, sample in enumerate(batch):
        ratios = [math.exp(shift(i, t)) for t in range(len(sample.completion_ids))]
        if mode.startswith("sequence"):
            ratios = [math.prod(ratios)] * len(ratios)
        w = [min(max(r, 0.8), 1.3) if mode.endswith("truncate") else (r if 0.8 <= r <= 1.3 else 0.0) for r in ratios]
        scaled.append([sample.advantage * x for x in w])
    corrected, report = _step(tmp_path, batch, vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.8,
                              vllm_importance_sampling_clip_max=1.3)
    plain, _ = _step(tmp_path, batch)
    for sample, row in zip(batch, scaled):
        sample.token_advantages = row
    expected, _ = _step(tmp_path, batch)
    assert _close(corrected, expected) and not _close(corrected, plain)
    assert report["rollout_is_ratio_max"] > 1.3 and report["rollout_is_kl"] > 0
