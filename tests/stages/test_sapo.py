"""SAPO (stages/rl/algorithms/sapo.py, loss_type sapo): our loss against a transcription of TRL's GRPOTrainer
formula on random inputs, and its config keys through the loader and the web UI."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ConfigError, load_config
from stages.rl.algorithms.grpo_math import policy_loss
from tests.stages.test_rl_loss_variants import GRPO


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def trl_sapo(logp, old_logp, advantages, mask, pos, neg):
    """TRL's ``loss_type == "sapo"`` branch of GRPOTrainer._compute_loss (token-level ratio, beta 0,
    no vLLM correction), transcribed: soft gate per token, then the mean of completions' token means."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(logp - old_logp)
    temperatures = torch.where(advantages > 0, pos, neg)
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    per_token_loss = -soft_coef_1 * advantages
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("pos, neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_trl_on_random_inputs(per_token, pos, neg):
    g = torch.Generator().manual_seed(7 + per_token)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4).requires_grad_()
    mask = (torch.rand(B, T, generator=g) > 0.25).to(torch.float64)
    mask[:, 0] = 1.0
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if per_token else torch.randn(B, generator=g,
                                                                                           dtype=torch.float64)
    adv[0] = 0.0  # A = 0 takes the negative temperature, as in TRL (A > 0 is the positive side)
    ours, metrics = policy_loss(logp, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2, loss_type="sapo",
                                max_completion_length=T,
                                loss_options={"sapo_temperature_pos": pos, "sapo_temperature_neg": neg})
    (grad_ours,) = torch.autograd.grad(ours, logp)
    theirs = trl_sapo(logp, old, adv * mask if per_token else adv, mask, pos, neg)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    assert abs(ours.item() - theirs.item()) < 1e-6
    assert (grad_ours - grad_theirs).abs().max().item() < 1e-6
    assert metrics["clip_fraction"] == 0.0  # a soft gate clips nothing


def test_on_policy_sapo_is_the_plain_policy_gradient():
    """At ratio 1 the gate's slope is 1: the gradient equals grpo's unclipped one."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([0.7])
    mask = torch.ones(1, 3)
    common = dict(epsilon_low=0.2, epsilon_high=0.2, max_completion_length=3)
    sapo, _ = policy_loss(logp, logp.detach(), adv, mask, loss_type="sapo", **common,
                          loss_options={"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05})
    (grad_sapo,) = torch.autograd.grad(sapo, logp)
    grpo, _ = policy_loss(logp, logp.detach(), adv, mask, loss_type="grpo", **common)
    (grad_grpo,) = torch.autograd.grad(grpo, logp)
    assert torch.allclose(grad_sapo, grad_grpo, atol=1e-7)


def test_loss_type_sapo_loads_and_is_offered_by_the_web_ui():
    from cluster.webui import form

    rl = load_config({**GRPO, "loss_type": "sapo"}).rl
    assert (rl.loss_type, rl.sapo_temperature_pos, rl.sapo_temperature_neg) == ("sapo", 1.0, 1.05)  # TRL's
    rl = load_config({**GRPO, "loss_type": "sapo", "sapo_temperature_neg": 2.0}).rl
    assert rl.sapo_temperature_neg == 2.0
    with pytest.raises(ConfigError, match="invalid sapo_temperature_pos in the config dict: loss_type sapo weighs"):
        load_config({**GRPO, "loss_type": "sapo", "sapo_temperature_pos": 0})
    spec = {f["key"]: f for f in form.form_spec()["fields"]}
    assert "sapo" in spec["loss_type"]["choices"]
    config = form.config_from_form({**{f.key: f.default for f in form.FIELDS}, "model_name_or_path": "tiny:qwen2",
                                    "dataset": ["arith_train"], "stage": "grpo", "reward_funcs": "exact_match",
                                    "loss_type": "sapo"})
    assert config["loss_type"] == "sapo"


def test_the_policy_worker_trains_sapo_with_the_configured_temperatures(tmp_path, monkeypatch):
    """The worker passes the loss's registered options (its temperatures) from the config to the loss."""
    import dataclasses

    from stages.rl.algorithms import registry as reg
    from stages.rl.algorithms.grpo_math import loss_normalizer
    from tests.stages.test_rl_policy import policy, samples

    seen = []
    entry = reg.POLICY_LOSSES.get("sapo")

    def recording(*args, **options):
        seen.append(options)
        return entry.fn(*args, **options)

    monkeypatch.setitem(reg.POLICY_LOSSES.entries, "sapo", dataclasses.replace(entry, fn=recording))
    worker = policy(tmp_path, loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    batch = samples()
    before = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
    report = worker.update(batch, loss_normalizer("sapo", [len(s.completion_ids) for s in batch], 32))
    after = torch.cat([p.detach().flatten() for p in worker.model.parameters()])
    assert seen and all(o == {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0} for o in seen)
    assert report["clip_fraction"] == 0.0 and (after - before).abs().max() > 0
