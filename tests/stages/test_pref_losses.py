"""The preference losses, log-probs, reference handling and value head, checked in one process.

Each pref_loss is compared with TRL 1.16's own loss code (CPOTrainer.cpo_loss and
ORPOTrainer.odds_ratio_loss are plain tensor functions of ``self``'s settings, so they run
standalone on fixed tensors) and, for the DPO family, with the paper formula in Python floats.
"""

from __future__ import annotations

import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from registries.tokenize import IGNORE_INDEX
from stages.run_args import FinetuningArguments, ModelArguments
from stages.recipes.dpo import preference_loss
from stages.recipes.preference import (adapter_preference_report, forward_logps, pairwise_logps, preference_accuracy,
                                       sequence_logps)
from stages.training.reference import Reference
from stages.loading import build_reference
from stages.recipes.rm import pairwise_reward_loss
from stages.training.value_head import ValueHeadModel, last_token_index

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# Summed log-probs of 4 pairs (policy and reference) and the responses' label counts.
CHOSEN = [-3.0, -5.5, -2.0, -7.25]
REJECTED = [-4.0, -5.0, -2.5, -6.0]
REF_CHOSEN = [-3.5, -5.0, -2.25, -7.0]
REF_REJECTED = [-3.75, -5.25, -2.0, -6.5]
LENGTHS_C = [3.0, 5.0, 2.0, 4.0]
LENGTHS_R = [2.0, 5.0, 3.0, 4.0]


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def trl_cpo_loss(loss_type, beta, chosen, rejected, label_smoothing=0.0, simpo_gamma=0.5):
    from trl.experimental.cpo import CPOTrainer

    settings = SimpleNamespace(
        alpha=0.0, loss_type=loss_type, beta=beta, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing,
        accelerator=SimpleNamespace(device="cpu"),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CPOTrainer.cpo_loss(settings, chosen, rejected)


def trl_odds_ratio_loss(beta, chosen, rejected):
    from trl.experimental.orpo import ORPOTrainer

    settings = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device="cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ORPOTrainer.odds_ratio_loss(settings, chosen, rejected)


# ------------------------------------------------------------------------------ the DPO family


@pytest.mark.parametrize("beta, smoothing", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_sigmoid_is_dpo_and_cdpo(beta, smoothing):
    out = preference_loss("sigmoid", beta, t(CHOSEN), t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED), smoothing)
    # TRL's sigmoid loss on the log-ratios (CPO's is DPO without a reference; feeding it the
    # policy-minus-reference log-ratios gives DPO, with its conservative label smoothing).
    chosen_ratio, rejected_ratio = t(CHOSEN) - t(REF_CHOSEN), t(REJECTED) - t(REF_REJECTED)
    expected, _, _ = trl_cpo_loss("sigmoid", beta, chosen_ratio, rejected_ratio, label_smoothing=smoothing)
    assert out.losses.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    # The paper (eq. 7), written out in floats for each pair.
    log_sigmoid = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    for i, loss in enumerate(out.losses.tolist()):
        margin = (CHOSEN[i] - REF_CHOSEN[i]) - (REJECTED[i] - REF_REJECTED[i])
        paper = -(1 - smoothing) * log_sigmoid(beta * margin) - smoothing * log_sigmoid(-beta * margin)
        assert loss == pytest.approx(paper, rel=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx((beta * chosen_ratio).tolist(), rel=1e-12)
    assert out.rejected_rewards.tolist() == pytest.approx((beta * rejected_ratio).tolist(), rel=1e-12)


def test_hinge_matches_trl():
    beta = 0.5
    out = preference_loss("hinge", beta, t(CHOSEN), t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED))
    expected, _, _ = trl_cpo_loss("hinge", beta, t(CHOSEN) - t(REF_CHOSEN), t(REJECTED) - t(REF_REJECTED))
    assert out.losses.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    margins = [(c - rc) - (r - rr) for c, r, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)]
    assert out.losses.tolist() == pytest.approx([max(0.0, 1 - beta * m) for m in margins], rel=1e-12)


def test_ipo_matches_trl_on_length_averaged_log_ratios():
    """IPO compares per-token averages (TRL's DPOTrainer normalizes the log-ratios by the
    completion length, LLaMA-Factory the log-probs: the same numbers)."""
    beta = 0.1
    avg = lambda x, n: t(x) / t(n)  # noqa: E731
    out = preference_loss(
        "ipo", beta, avg(CHOSEN, LENGTHS_C), avg(REJECTED, LENGTHS_R), avg(REF_CHOSEN, LENGTHS_C),
        avg(REF_REJECTED, LENGTHS_R),
    )
    chosen_ratio = (t(CHOSEN) - t(REF_CHOSEN)) / t(LENGTHS_C)
    rejected_ratio = (t(REJECTED) - t(REF_REJECTED)) / t(LENGTHS_R)
    expected, _, _ = trl_cpo_loss("ipo", beta, chosen_ratio, rejected_ratio)
    assert out.losses.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    assert out.losses.tolist() == pytest.approx(((chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2).tolist())


# ------------------------------------------------------------------------------ reference-free


@pytest.mark.parametrize("beta, gamma", [(2.0, 0.5), (0.1, 1.0)])
def test_simpo_matches_trl(beta, gamma):
    chosen, rejected = t(CHOSEN) / t(LENGTHS_C), t(REJECTED) / t(LENGTHS_R)
    out = preference_loss("simpo", beta, chosen, rejected, simpo_gamma=gamma)
    expected, chosen_rewards, rejected_rewards = trl_cpo_loss("simpo", beta, chosen, rejected, simpo_gamma=gamma)
    assert out.losses.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx(chosen_rewards.tolist(), rel=1e-12)
    assert out.rejected_rewards.tolist() == pytest.approx(rejected_rewards.tolist(), rel=1e-12)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_is_nll_plus_trl_odds_ratio_term(beta):
    # ORPO works on average log-probs, which are > log(0.5) for some pairs here: both branches of log1mexp.
    chosen, rejected = t([-0.2, -1.5, -0.05, -3.0]), t([-0.9, -0.4, -2.0, -3.5])
    out = preference_loss("orpo", beta, chosen, rejected)
    trl_term, chosen_rewards, rejected_rewards, _, _ = trl_odds_ratio_loss(beta, chosen, rejected)
    # TRL computes in float32
    assert out.losses.tolist() == pytest.approx((-chosen - trl_term).tolist(), rel=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx(chosen_rewards.tolist(), rel=1e-6)
    assert out.rejected_rewards.tolist() == pytest.approx(rejected_rewards.tolist(), rel=1e-6)
    # The paper's odds: p / (1 - p) with p = exp(average log-prob).
    for i, loss in enumerate(out.losses.tolist()):
        pc, pr = math.exp(chosen[i].item()), math.exp(rejected[i].item())
        log_odds_ratio = math.log((pc / (1 - pc)) / (pr / (1 - pr)))
        assert loss == pytest.approx(-chosen[i].item() + beta * math.log1p(math.exp(-log_odds_ratio)), rel=1e-10)


def test_reference_losses_refuse_to_run_without_reference_log_probs():
    with pytest.raises(ValueError, match="pref_loss 'sigmoid' needs the reference model's log-probs"):
        preference_loss("sigmoid", 0.1, t(CHOSEN), t(REJECTED))
    with pytest.raises(ValueError, match="Unknown pref_loss 'kto_pair'"):
        preference_loss("kto_pair", 0.1, t(CHOSEN), t(REJECTED), t(REF_CHOSEN), t(REF_REJECTED))


def test_reward_model_loss_is_bradley_terry():
    chosen, rejected = t([1.0, -0.5, 2.0]), t([0.0, 0.5, 2.0])
    expected = [math.log1p(math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())]
    assert pairwise_reward_loss(chosen, rejected).tolist() == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------------------ log-probs


def test_sequence_logps_sums_shifted_labelled_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 1, IGNORE_INDEX], [IGNORE_INDEX, 6, 0, 2, 5]])
    logps, lengths = sequence_logps(logits, labels)
    log_probs = logits.log_softmax(-1)
    # token at position p is predicted by the logits at p - 1
    expected = [log_probs[0, 1, 3] + log_probs[0, 2, 1], sum(log_probs[1, p - 1, labels[1, p]] for p in range(1, 5))]
    assert logps.tolist() == pytest.approx([e.item() for e in expected], rel=1e-6)
    assert lengths.tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="do not line up"):
        sequence_logps(logits, labels[:, :4])


# ------------------------------------------------------------------------------ with the tiny model


@pytest.fixture(scope="module")
def tiny():
    from registries.datasets.data_args import DataArguments
    from stages.loading import load_tokenizer_and_template

    model_args = ModelArguments(model_name_or_path="tiny:qwen2")
    tokenizer, _ = load_tokenizer_and_template(model_args, DataArguments(template="qwen"))
    return model_args, tokenizer


def tuning(**kwargs) -> FinetuningArguments:
    return FinetuningArguments(stage="dpo", **kwargs)


def load_policy(model_args, tokenizer, finetuning_args):
    from stages.loading import load_model

    return load_model(model_args, finetuning_args, tokenizer)


def batch(tokenizer):
    ids = torch.tensor([tokenizer.encode("What is 3+4? 7")] * 2)
    labels = ids.clone()
    labels[:, :-2] = IGNORE_INDEX
    return ids, torch.ones_like(ids), labels


def test_orpo_and_simpo_load_no_reference(tiny):
    model_args, tokenizer = tiny
    for loss in ("orpo", "simpo"):
        for kind in ("full", "lora"):
            args = tuning(pref_loss=loss, finetuning_type=kind)
            assert build_reference(object(), model_args, args, tokenizer) == Reference("none")


def test_lora_reference_is_the_policy_with_its_adapter_disabled(tiny):
    model_args, tokenizer = tiny
    args = tuning(finetuning_type="lora", lora_rank=4)
    policy = load_policy(model_args, tokenizer, args)
    count = sum(p.numel() for p in policy.parameters())
    reference = build_reference(policy, model_args, args, tokenizer)
    assert reference.kind == "adapter_disabled" and reference.model is None
    assert sum(p.numel() for p in policy.parameters()) == count  # nothing was added or loaded
    for name, param in policy.named_parameters():  # make the adapter do something
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    ids, mask, labels = batch(tokenizer)
    base = load_policy(model_args, tokenizer, tuning(finetuning_type="full")).eval()
    with torch.no_grad():
        base_logps, _ = sequence_logps(base(input_ids=ids).logits, labels)
        policy_logps, _ = sequence_logps(policy(input_ids=ids).logits, labels)
    ref_logps, _ = reference.logps(policy, lambda m: forward_logps(m, ids, mask, labels))
    assert ref_logps.tolist() == pytest.approx(base_logps.tolist(), rel=1e-5)
    assert abs(policy_logps[0].item() - base_logps[0].item()) > 1e-3  # the adapter is back on afterwards
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)


def test_full_reference_is_a_frozen_copy_of_the_starting_weights(tiny):
    model_args, tokenizer = tiny
    args = tuning(finetuning_type="full")
    policy = load_policy(model_args, tokenizer, args)
    with torch.no_grad():
        for param in policy.parameters():  # training moved the policy; the reference must not follow
            param.add_(0.1)
    reference = build_reference(policy, model_args, args, tokenizer)
    assert reference.kind == "model" and reference.model is not policy
    assert not any(p.requires_grad for p in reference.model.parameters())
    fresh = load_policy(model_args, tokenizer, args)
    ref_state = reference.model.state_dict()
    assert all(torch.equal(ref_state[k], v) for k, v in fresh.state_dict().items())


def test_preference_accuracy_counts_strict_wins(tiny):
    model_args, tokenizer = tiny
    model = load_policy(model_args, tokenizer, tuning(finetuning_type="full"))
    ids = tokenizer.encode("What is 3+4? 7")
    same = {f"{side}_{col}": v for side in ("chosen", "rejected") for col, v in
            (("input_ids", ids), ("attention_mask", [1] * len(ids)), ("labels", [IGNORE_INDEX] * 3 + ids[3:]))}
    assert preference_accuracy(model, [same, same], tokenizer.pad_token_id) == 0.0  # a tie is not a win


def test_adapter_report_compares_the_policy_with_its_own_base(tiny):
    """A fresh adapter (lora_B = 0) is its base: equal figures and an implied reward of exactly 0,
    which is no win. A perturbed adapter: base figures unchanged, reward = beta x log-ratio gap."""
    from registries.templates import get_template
    from tests.e2e.conftest import tokenized_pairs

    model_args, tokenizer = tiny
    pairs = tokenized_pairs("arith_pref_eval", "dpo", tokenizer, get_template("qwen"))[:6]
    policy = load_policy(model_args, tokenizer, tuning(finetuning_type="lora", lora_rank=4))
    fresh = adapter_preference_report(policy, pairs, tokenizer.pad_token_id, beta=0.1)
    assert fresh["trained_accuracy"] == fresh["base_accuracy"] and fresh["trained_margin"] == fresh["base_margin"]
    assert fresh["reward_accuracy"] == 0.0 and fresh["reward_margin"] == 0.0

    torch.manual_seed(0)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    report = adapter_preference_report(policy, pairs, tokenizer.pad_token_id, beta=0.1)
    assert report["base_accuracy"] == fresh["base_accuracy"] and report["base_margin"] == pytest.approx(fresh["base_margin"])
    policy_c, policy_r = pairwise_logps(policy, pairs, tokenizer.pad_token_id)
    assert report["trained_margin"] == pytest.approx(float((policy_c - policy_r).mean()), rel=1e-5)
    assert report["reward_margin"] == pytest.approx(0.1 * (report["trained_margin"] - report["base_margin"]), rel=1e-4)
    assert "reward_accuracy" not in adapter_preference_report(policy, pairs, tokenizer.pad_token_id)


def test_value_head_scores_the_last_real_token_whatever_the_padding(tiny):
    model_args, tokenizer = tiny
    torch.manual_seed(0)
    model = ValueHeadModel(load_policy(model_args, tokenizer, tuning(finetuning_type="full"))).eval()
    ids = tokenizer.encode("What is 3+4? 7")
    pad = tokenizer.pad_token_id
    right = torch.tensor([ids + [pad, pad], ids + [pad, pad]])
    mask = torch.tensor([[1] * len(ids) + [0, 0]] * 2)
    assert last_token_index(mask).tolist() == [len(ids) - 1] * 2
    with torch.no_grad():
        alone = model(torch.tensor([ids])).rewards
        padded = model(right, mask)
    assert padded.rewards.tolist() == pytest.approx([alone.item()] * 2, rel=1e-5)
    assert padded.values[0, len(ids) - 1].item() == pytest.approx(alone.item(), rel=1e-5)


def test_full_reward_model_saves_weights_and_value_head_and_reloads_identically(tiny, tmp_path):
    from stages.training.value_head import VALUE_HEAD_FILE, score
    from stages.loading import load_reward_model

    model_args, tokenizer = tiny
    torch.manual_seed(0)
    model = ValueHeadModel(load_policy(model_args, tokenizer, tuning(finetuning_type="full"))).eval()
    torch.nn.init.normal_(model.v_head.weight)
    model.save(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    assert {"model.safetensors", VALUE_HEAD_FILE} <= set(os.listdir(tmp_path))

    reloaded, _ = load_reward_model(str(tmp_path), template="qwen")
    ids = [tokenizer.encode("What is 3+4? 7"), tokenizer.encode("What is 3+4? 9")]
    assert score(reloaded, ids).tolist() == pytest.approx(score(model, ids).tolist(), abs=1e-6)
    with pytest.raises(FileNotFoundError, match="not a reward model saved by stage rm"):
        load_reward_model(str(tmp_path / "nothing-here"))
