"""stages.rl.workers.checkpoint: what a trainable role saves and loads, round trips that continue a run bit
for bit. (Committing, resolving and pruning RL checkpoints: tests/stages/test_checkpoint_protocol.py.)"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from stages.training.checkpoints import ResumeError
from stages.rl.workers.checkpoint import load_role_state, save_role_state


# ----- role state -----

BASE_LR = 0.1
TOTAL_STEPS = 10


def stack(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)  # a frozen part: comes from the base model, not the checkpoint
    return model


def trainer(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=BASE_LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / TOTAL_STEPS)  # linear decay
    return optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    batch = torch.randn(5, 4)  # from the global generator: a resume must restore it as well
    model(batch).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def trainable_copy(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name  # exact: 0 difference


def test_role_state_round_trip_continues_the_run_exactly(tmp_path):
    folder = str(tmp_path / "policy")
    model = stack(0)
    optimizer, scheduler = trainer(model)
    for _ in range(3):
        train_step(model, optimizer, scheduler)
    save_role_state(folder, 0, model, optimizer, scheduler, extra={"consumed_prompts": 24})
    at_save = trainable_copy(model)
    train_step(model, optimizer, scheduler)
    next_step = trainable_copy(model)  # what the uninterrupted run has after step 4
    train_step(model, optimizer, scheduler)

    assert set(torch.load(os.path.join(folder, "trainable.pt"), weights_only=True)) == {"2.weight", "2.bias"}
    assert sorted(os.listdir(folder)) == ["extra.json", "optimizer.pt", "rng_state_0.pt", "scheduler.pt",
                                          "trainable.pt"]

    # Into the same objects, two steps further on.
    assert load_role_state(folder, 0, model, optimizer, scheduler) == {"consumed_prompts": 24}
    assert_same(trainable_copy(model), at_save)
    assert scheduler.get_last_lr() == [BASE_LR * (1 - 3 / TOTAL_STEPS)]
    train_step(model, optimizer, scheduler)
    assert_same(trainable_copy(model), next_step)
    assert scheduler.get_last_lr() == [BASE_LR * (1 - 4 / TOTAL_STEPS)]

    # Into fresh objects, as a restarted run builds them: the frozen layer from the "base model".
    fresh = stack(1)
    fresh[0].load_state_dict(stack(0)[0].state_dict())
    fresh_optimizer, fresh_scheduler = trainer(fresh)
    load_role_state(folder, 0, fresh, fresh_optimizer, fresh_scheduler)
    assert_same(trainable_copy(fresh), at_save)
    train_step(fresh, fresh_optimizer, fresh_scheduler)
    assert_same(trainable_copy(fresh), next_step)


def test_other_ranks_write_only_their_random_state(tmp_path):
    folder = str(tmp_path / "critic")
    model = stack(0)
    optimizer, scheduler = trainer(model)
    save_role_state(folder, 1, model, optimizer, scheduler)
    assert os.listdir(folder) == ["rng_state_1.pt"]


def test_random_state_is_restored(tmp_path):
    folder = str(tmp_path / "policy")
    model = stack(0)
    optimizer, scheduler = trainer(model)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_role_state(folder, 0, model, optimizer, scheduler)
    after_save = (random.random(), np.random.rand(), torch.rand(4))
    load_role_state(folder, 0, model, optimizer, scheduler)
    after_load = (random.random(), np.random.rand(), torch.rand(4))
    assert after_load[:2] == after_save[:2]
    assert torch.equal(after_load[2], after_save[2])


def test_a_lora_value_head_model_saves_only_what_it_trains(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.training.value_head import ValueHeadModel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=64)
    lora = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = ValueHeadModel(lora)
    optimizer, scheduler = trainer(model)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    def step():
        out = model(torch.randint(0, 64, (2, 6)))
        out.rewards.pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    step()
    folder = str(tmp_path / "critic")
    save_role_state(folder, 0, model, optimizer, scheduler)
    at_save = trainable_copy(model)
    step()
    next_step = trainable_copy(model)
    step()

    expected = {"v_head.weight", "v_head.bias"} | {
        f"pretrained_model.base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.default.weight"
        for layer in (0, 1) for proj in ("q_proj", "v_proj") for ab in ("A", "B")
    }
    assert set(torch.load(os.path.join(folder, "trainable.pt"), weights_only=True)) == expected
    load_role_state(folder, 0, model, optimizer, scheduler)
    assert_same(trainable_copy(model), at_save)
    step()
    assert_same(trainable_copy(model), next_step)
    frozen_after = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert_same(frozen_after, frozen_before)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def test_mismatched_names_are_a_resume_error(tmp_path):
    folder = str(tmp_path / "policy")
    saved = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    save_role_state(folder, 0, saved, *trainer(saved))
    other = TwoLayers()
    with pytest.raises(ResumeError) as info:
        load_role_state(folder, 0, other, *trainer(other))
    assert str(info.value) == (
        f"The checkpoint part {folder} does not fit the model being trained: 4 trainable parameter(s) of the "
        "model are not in it (a.bias, a.weight, b.bias and 1 more); it has 6 the model does not train "
        "(0.bias, 0.weight, 1.bias and 3 more). The checkpoint came from a different model or finetuning "
        "setup (model_name_or_path, finetuning_type, lora_rank, lora_target, freeze options...). Resume with "
        "the settings the checkpoint was trained with, or start fresh without resume_from_checkpoint."
    )


def test_mismatched_shapes_are_a_resume_error(tmp_path):
    folder = str(tmp_path / "policy")
    saved = nn.Sequential(nn.Linear(4, 4))
    save_role_state(folder, 0, saved, *trainer(saved))
    wider = nn.Sequential(nn.Linear(4, 5))
    with pytest.raises(ResumeError) as info:
        load_role_state(folder, 0, wider, *trainer(wider))
    assert str(info.value).startswith(
        f"The checkpoint part {folder} does not fit the model being trained: 2 have another shape "
        "(0.bias (4,) vs (5,), 0.weight (4, 4) vs (5, 4)). The checkpoint came from a different model"
    )


def test_more_trainable_parameters_than_saved_is_a_resume_error(tmp_path):
    # e.g. a checkpoint of a partly frozen model resumed with everything trainable
    folder = str(tmp_path / "policy")
    model = stack(0)
    save_role_state(folder, 0, model, *trainer(model))
    model[0].requires_grad_(True)
    with pytest.raises(ResumeError, match=r"2 trainable parameter\(s\) of the model are not in it \(0.bias, 0.weight\)\. "):
        load_role_state(folder, 0, model, *trainer(model))
