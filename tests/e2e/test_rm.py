"""rm end to end on a real local Ray: the reward model learns to score the right sum above a near
miss on held-out prompts, and its output folder reloads (load_reward_model) into a model that
scores a pair exactly as the trained one did at the end of training.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
import ray.cloudpickle
from safetensors.torch import load_file
from transformers import TrainerCallback

from cluster.driver import run_exp
from registries.datasets import DataArguments
from stages.run_args import ModelArguments
from stages.training.callbacks import read_log
from stages.training.per_example_attention import attending
from stages.training.preference_collators import PairwiseCollator
from stages.loading import load_tokenizer_and_template
from stages.training.value_head import VALUE_HEAD_FILE, reward_accuracy, score
from stages.loading import load_reward_model
from tests.e2e.conftest import (
    DATA_DIR,
    REPO_ROOT,
    assert_rerun_of_a_finished_run_trains_nothing,
    example_config,
    tokenized_pairs,
)

# Ray pickles the callbacks to the workers, which cannot import this test module by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def write_far_miss_pairs(folder) -> str:
    """Preference pairs on the addition prompts (arith_train / held-out arith_eval): chosen the
    right sum, rejected a random wrong number from 0..38, seeded. Returns the dataset_dir.

    Why not arith_pref: its rejected answers are near misses (sum +-1 or 2), and a value head on
    this random-init model does not learn to tell them apart: measured 0.42-0.57 held-out (and
    ~0.55 even on the training pairs) after 300-1000 steps, from scratch or from an sft model
    that answers the sums. Far misses it learns: 0.80 (LoRA, 600 steps) to 0.85 (full, 1000).
    """
    rng = random.Random(0)
    info = {}
    for split in ("train", "eval"):
        with open(os.path.join(DATA_DIR, f"arith_{split}.json"), encoding="utf-8") as f:
            rows = json.load(f)
        pairs = []
        for row in rows:
            wrong = int(row["output"])
            while wrong == int(row["output"]):
                wrong = rng.randrange(39)
            pairs.append({"instruction": row["instruction"], "chosen": row["output"], "rejected": str(wrong)})
        with open(os.path.join(folder, f"far_{split}.json"), "w", encoding="utf-8") as f:
            json.dump(pairs, f)
        info[f"far_{split}"] = {
            "file_name": f"far_{split}.json", "ranking": True,
            "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"},
        }
    with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f)
    return str(folder)


def held_out_pairs(dataset_dir: str) -> tuple[list[dict], int]:
    """far_eval tokenized as stage rm does, and the pad id."""
    tokenizer, template = load_tokenizer_and_template(
        ModelArguments(model_name_or_path="tiny:qwen2"), DataArguments(template="qwen")
    )
    return tokenized_pairs("far_eval", "rm", tokenizer, template, dataset_dir), tokenizer.pad_token_id


class ScoreAtTrainEnd(TrainerCallback):
    """In the worker, on the trained model itself: the rewards of a few sequences, written to a file."""

    def __init__(self, batch: dict, path: str):
        self.batch = {k: v.tolist() for k, v in batch.items()}
        self.path = path

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        was_training = model.training
        model.eval()
        # The trained model attends padding-free rows (the rm default); this probe batch is padded.
        with attending(model, "sdpa"):
            rewards = score(model, self.batch["input_ids"], self.batch["attention_mask"])
        model.train(was_training)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(rewards.tolist(), f)


STEPS = 600
RESUME_AT = 580  # a checkpoint 20 steps before the end, resumed from by a second run


def test_a_finished_reward_model_run_reruns_without_training(ray_session, tmp_path):
    config = example_config("rm_lora.yaml", tmp_path, max_steps=2, save_steps=2, logging_steps=1)
    config.pop("eval_dataset", None)
    run_exp(config)
    assert_rerun_of_a_finished_run_trains_nothing(config)


@pytest.mark.slow
def test_lora_reward_model_learns_held_out_pairs_and_reloads_identically(ray_session, tmp_path):
    """configs/rm_lora.yaml on far-miss pairs: held-out pair accuracy from chance (the Trainer's
    own evaluation before step 1) to high; the saved adapter + value head reload into a model
    that scores sequences exactly as the trained one did at the end of training; a rerun from a
    checkpoint restores adapter, value head, optimizer and data position and ends the same."""
    dataset_dir = write_far_miss_pairs(tmp_path)
    pairs, pad_id = held_out_pairs(dataset_dir)
    probe = PairwiseCollator(pad_token_id=pad_id)(pairs[:4])  # 4 chosen then 4 rejected, padded
    scores_path = str(tmp_path / "scores.json")
    config = example_config(
        "rm_lora.yaml", tmp_path, dataset="far_train", eval_dataset="far_eval", dataset_dir=dataset_dir,
        max_steps=STEPS, save_steps=RESUME_AT, eval_strategy="steps", eval_steps=STEPS, eval_on_start=True,
    )

    result = run_exp(config, callbacks=[ScoreAtTrainEnd(probe, scores_path)])
    out = result.output_dir

    for name in ("adapter_model.safetensors", "adapter_config.json", VALUE_HEAD_FILE, "chat_template.jinja"):
        assert os.path.exists(os.path.join(out, name)), name
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    model, tokenizer = load_reward_model(out)
    assert tokenizer.pad_token_id == pad_id
    with open(scores_path, encoding="utf-8") as f:
        at_train_end = json.load(f)
    reloaded = score(model, probe["input_ids"], probe["attention_mask"]).tolist()
    assert reloaded == pytest.approx(at_train_end, abs=1e-5)
    assert len({round(s, 4) for s in reloaded}) > 1  # a score per sequence, not a constant

    records = read_log(out)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["current_steps"] for r in evals][:2] == [0, STEPS]
    before = evals[0]["eval_accuracy"]
    after = reward_accuracy(model, pairs, pad_id)
    print(f"rm: far_eval pair accuracy {before:.3f} -> {after:.3f}")
    assert before <= 0.65
    assert after >= 0.7
    # The Trainer's own evaluation of the same pairs agrees (other batch shapes: a near-tie may flip).
    assert evals[1]["eval_accuracy"] == pytest.approx(after, abs=1.5 / len(pairs))

    train = [r for r in records if "loss" in r]
    assert [r["current_steps"] for r in train] == list(range(10, STEPS + 1, 10))
    assert all({"rewards/accuracies", "rewards/margins"} <= set(r) for r in train)
    assert sum(r["loss"] for r in train[-5:]) < 0.8 * sum(r["loss"] for r in train[:5])

    # Resume by rerun (no evaluation this time): the last 20 steps again, from checkpoint-580.
    rerun = {k: v for k, v in config.items() if k not in ("eval_dataset", "eval_steps", "eval_on_start")}
    rerun.update(output_dir=str(tmp_path / "resumed"), ray_storage_path=str(tmp_path / "ray-resumed"),
                 eval_strategy="no", resume_from_checkpoint=os.path.join(out, f"checkpoint-{RESUME_AT}"))
    resumed = run_exp(rerun).output_dir
    original = {r["current_steps"]: r["loss"] for r in train}
    again = {r["current_steps"]: r["loss"] for r in read_log(resumed) if "loss" in r}
    assert sorted(again) == [RESUME_AT + 10, STEPS]
    for step, loss in again.items():
        assert loss == pytest.approx(original[step], abs=1e-5), (step, loss, original[step])
    head_a = load_file(os.path.join(out, VALUE_HEAD_FILE))
    head_b = load_file(os.path.join(resumed, VALUE_HEAD_FILE))
    assert all(torch.allclose(head_a[k], head_b[k], atol=1e-5) for k in head_a)


def test_full_reward_model_under_deepspeed_zero3_on_two_workers_saves_whole_weights(ray_session, tmp_path):
    """ZeRO-3 partitions every weight across the workers; the saved LM and value head must be whole."""
    config = example_config(
        "rm_lora.yaml", tmp_path, max_steps=2, save_steps=100, logging_steps=1, ray_num_workers=2,
        finetuning_type="full", deepspeed=os.path.join(REPO_ROOT, "configs", "deepspeed", "ds_z3_config.json"),
    )
    for key in ("lora_target", "lora_rank", "additional_target", "eval_dataset"):
        config.pop(key)

    out = run_exp(config).output_dir

    assert [r["current_steps"] for r in read_log(out) if "loss" in r] == [1, 2]
    head = load_file(os.path.join(out, VALUE_HEAD_FILE))
    lm = load_file(os.path.join(out, "model.safetensors"))
    hidden = lm["model.embed_tokens.weight"].shape[1]
    assert head["weight"].shape == (1, hidden) and head["bias"].shape == (1,)
    assert all(t.numel() > 0 for t in lm.values())  # no empty ZeRO-3 placeholders
    model, tokenizer = load_reward_model(out)
    pairs, pad_id = held_out_pairs(write_far_miss_pairs(tmp_path))
    probe = PairwiseCollator(pad_token_id=pad_id)(pairs[:4])
    scores = score(model, probe["input_ids"], probe["attention_mask"])
    assert torch.isfinite(scores).all() and len({round(float(s), 4) for s in scores}) > 1
