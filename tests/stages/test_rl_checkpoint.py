"""stages.rl.checkpoint: complete-or-absent checkpoint folders, resume resolution, and role state
round trips that continue a run bit for bit."""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from stages.rl.checkpoint import (
    STATE_FILE,
    ResumeError,
    begin_checkpoint,
    checkpoint_path,
    commit_checkpoint,
    is_complete,
    latest_checkpoint,
    load_role_state,
    read_state,
    resolve_resume,
    save_role_state,
    truncate_log,
)


def make_complete(output_dir, step: int) -> str:
    staging = begin_checkpoint(str(output_dir), step)
    return commit_checkpoint(staging, {"global_step": step})


# ----- folders -----

def test_commit_makes_a_complete_folder_with_the_parts_and_the_state(tmp_path):
    staging = begin_checkpoint(str(tmp_path), 5)
    assert staging == str(tmp_path / ".checkpoint-5.partial")
    os.makedirs(os.path.join(staging, "policy"))
    with open(os.path.join(staging, "policy", "part.txt"), "w") as f:
        f.write("weights")
    state = {"global_step": 5, "consumed_prompts": 40, "seed": 3}

    final = commit_checkpoint(staging, state)

    assert final == checkpoint_path(str(tmp_path), 5) == str(tmp_path / "checkpoint-5")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5"]  # the staging folder became it
    assert sorted(os.listdir(final)) == ["policy", STATE_FILE]  # no temp file left behind
    with open(os.path.join(final, "policy", "part.txt")) as f:
        assert f.read() == "weights"
    assert is_complete(final)
    assert read_state(final) == state
    assert latest_checkpoint(str(tmp_path)) == final


def test_a_crash_before_commit_leaves_no_complete_checkpoint(tmp_path):
    earlier = make_complete(tmp_path, 3)
    staging = begin_checkpoint(str(tmp_path), 6)
    os.makedirs(os.path.join(staging, "policy"))  # the run dies here: no commit
    assert not is_complete(staging)
    assert latest_checkpoint(str(tmp_path)) == earlier
    assert resolve_resume("auto", str(tmp_path)) == earlier

    # The rerun saves step 6 again: the leftover is cleared first.
    assert begin_checkpoint(str(tmp_path), 6) == staging
    assert os.listdir(staging) == []


def test_no_checkpoint_at_all(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    assert latest_checkpoint(str(tmp_path / "not-yet")) is None
    staging = begin_checkpoint(str(tmp_path), 2)  # only a staging folder
    assert latest_checkpoint(str(tmp_path)) is None
    assert os.path.isdir(staging)


def test_a_checkpoint_folder_without_state_is_ignored_by_auto_and_refused_by_name(tmp_path):
    complete = make_complete(tmp_path, 4)
    half_written = tmp_path / "checkpoint-8"
    os.makedirs(half_written / "policy")
    assert latest_checkpoint(str(tmp_path)) == complete
    with pytest.raises(ResumeError) as info:
        resolve_resume(str(half_written), str(tmp_path))
    assert str(info.value) == (
        f"resume_from_checkpoint {half_written} has no rl_state.json. An RL checkpoint (stages grpo and ppo) "
        "is a checkpoint-N folder whose rl_state.json is written last, so this folder is either not an RL "
        "checkpoint (e.g. one of another stage) or was only half-written when the run stopped. Point "
        "resume_from_checkpoint at another checkpoint-N folder that has rl_state.json, or set "
        "resume_from_checkpoint: auto to resume from the latest complete checkpoint in output_dir."
    )


def test_a_missing_folder_is_refused_by_name(tmp_path):
    with pytest.raises(ResumeError) as info:
        resolve_resume(str(tmp_path / "checkpoint-99"), str(tmp_path))
    assert str(info.value).startswith(f"resume_from_checkpoint {tmp_path / 'checkpoint-99'} does not exist. ")


def test_resolve_resume(tmp_path, caplog):
    assert resolve_resume(None, str(tmp_path)) is None
    assert resolve_resume("", str(tmp_path)) is None
    with caplog.at_level(logging.INFO, logger="stages.rl.checkpoint"):
        assert resolve_resume("auto", str(tmp_path)) is None
    assert f"no complete checkpoint in {tmp_path} yet; starting fresh" in caplog.text
    named = make_complete(tmp_path, 2)
    latest = make_complete(tmp_path, 7)
    assert resolve_resume("auto", str(tmp_path)) == latest
    assert resolve_resume(named, str(tmp_path)) == named


def test_latest_compares_steps_as_numbers(tmp_path):
    for step in (9, 10, 2):
        make_complete(tmp_path, step)
    for name in ("checkpoint-100-old", "checkpoint-x", "checkpoint-", "old-checkpoint-200"):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / STATE_FILE, "w") as f:
            json.dump({"global_step": 1}, f)
    with open(tmp_path / "checkpoint-300", "w") as f:  # a file, not a folder
        f.write("")
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


def test_save_total_limit_deletes_the_oldest(tmp_path):
    for step in range(1, 6):
        commit_checkpoint(begin_checkpoint(str(tmp_path), step), {"global_step": step}, save_total_limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-5"]


@pytest.mark.parametrize("limit", [None, 0, -1])
def test_no_save_total_limit_keeps_all(tmp_path, limit):
    for step in range(1, 4):
        commit_checkpoint(begin_checkpoint(str(tmp_path), step), {"global_step": step}, save_total_limit=limit)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_save_total_limit_ignores_incomplete_folders_and_keeps_the_new_checkpoint(tmp_path):
    # A run resumed from checkpoint-10 while checkpoint-20 of the replaced run is still there.
    for step in (10, 20):
        make_complete(tmp_path, step)
    os.makedirs(tmp_path / "checkpoint-5")  # half-written: not a checkpoint, not counted, not touched
    final = commit_checkpoint(begin_checkpoint(str(tmp_path), 15), {"global_step": 15}, save_total_limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-15", "checkpoint-20", "checkpoint-5"]
    commit_checkpoint(begin_checkpoint(str(tmp_path), 16), {"global_step": 16}, save_total_limit=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-16", "checkpoint-5"]
    assert not os.path.exists(final)


def test_commit_replaces_an_earlier_attempt_at_the_same_step(tmp_path):
    old = make_complete(tmp_path, 4)
    with open(os.path.join(old, "stale.txt"), "w") as f:
        f.write("from the replaced run")
    staging = begin_checkpoint(str(tmp_path), 4)
    assert commit_checkpoint(staging, {"global_step": 4, "run": 2}) == old
    assert sorted(os.listdir(old)) == [STATE_FILE]
    assert read_state(old) == {"global_step": 4, "run": 2}


def test_truncate_log(tmp_path):
    lines = [json.dumps({"current_steps": s, "loss": s / 10}) + "\n" for s in range(1, 6)]
    with open(tmp_path / "trainer_log.jsonl", "w") as f:
        f.writelines(lines)
        f.write('{"current_steps": 6, "lo')  # torn by the crash
    assert truncate_log(str(tmp_path), 3) == 3  # steps 4, 5 and the torn line
    with open(tmp_path / "trainer_log.jsonl") as f:
        assert f.read() == "".join(lines[:3])
    assert truncate_log(str(tmp_path), 3) == 0
    assert truncate_log(str(tmp_path), 0) == 3
    with open(tmp_path / "trainer_log.jsonl") as f:
        assert f.read() == ""
    assert sorted(os.listdir(tmp_path)) == ["trainer_log.jsonl"]


def test_truncate_log_without_a_log(tmp_path):
    assert truncate_log(str(tmp_path), 3) == 0
    assert os.listdir(tmp_path) == []


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

    from stages.value_head import ValueHeadModel

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
