"""The trainer half of a config: transformers' option names and rules, DeepSpeed and resume files,
and the checks that run on the driver so a bad value fails before any worker starts."""

from __future__ import annotations

import json
import os

import pytest

from cluster.config import ConfigError, load_config
from stages.training.checkpoints import write_manifest
from tests.cluster.conftest import BASE, error_of, write

pytestmark = pytest.mark.usefixtures("in_tmp")


def test_deepspeed_file_is_loaded_for_remote_workers():
    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    with open("ds_z2.json", "w") as f:
        json.dump(ds, f)
    run = load_config({**BASE, "deepspeed": "ds_z2.json"})
    assert run.training.deepspeed == ds
    assert run.raw["deepspeed"] == "ds_z2.json"


def test_resume_path_becomes_absolute(tmp_path):
    os.makedirs("out/checkpoint-10")
    with open("out/checkpoint-10/trainer_state.json", "w", encoding="utf-8") as f:
        f.write("{}")
    write_manifest("out/checkpoint-10", 10)  # a committed checkpoint
    run = load_config({**BASE, "resume_from_checkpoint": "out/checkpoint-10"})
    assert run.training.resume_from_checkpoint == str(tmp_path / "out/checkpoint-10")


def _checkpoint(path: str, commit: bool) -> str:
    os.makedirs(path)
    for name, size in (("trainer_state.json", 2), ("model.safetensors", 64)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"{}" if name.endswith(".json") else bytes(size))
    if commit:
        write_manifest(path, 10)
    return path


def test_resume_from_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    os.makedirs("out/checkpoint-10")
    message = error_of({**BASE, "resume_from_checkpoint": "out/checkpoint-10"})
    assert message.startswith(f"resume_from_checkpoint {tmp_path}/out/checkpoint-10 in the config dict is not a "
                              "complete checkpoint: it has neither rayfactory_checkpoint.json nor a state file "
                              "(trainer_state.json or rl_state.json)")


def test_resume_from_a_committed_checkpoint_cut_short_is_refused(tmp_path):
    path = _checkpoint("out/checkpoint-10", commit=True)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.truncate(40)
    message = error_of({**BASE, "resume_from_checkpoint": path})
    assert message.startswith(f"resume_from_checkpoint {tmp_path}/{path} in the config dict is a half-written "
                              "checkpoint: model.safetensors is 40 bytes, the manifest says 64.")
    assert "Point resume_from_checkpoint at an earlier checkpoint-N folder" in message


def test_resume_from_a_checkpoint_without_manifest_is_taken_with_a_warning(tmp_path, caplog):
    path = _checkpoint("out/checkpoint-10", commit=False)  # written before manifests, or by another tool
    run = load_config({**BASE, "resume_from_checkpoint": path})
    assert run.training.resume_from_checkpoint == str(tmp_path / path)
    assert any("has no rayfactory_checkpoint.json" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)


def test_unknown_scheduler_is_checked_against_transformers():
    message = error_of({**BASE, "lr_scheduler_type": "cosin"})
    assert message.startswith("wrong value for 'lr_scheduler_type' in the config dict: got 'cosin' (a string), "
                              "expected one of 'linear', 'cosine', ")
    assert message.endswith("; did you mean 'cosine'?")


def test_deepspeed_file_missing(tmp_path):
    assert error_of(write("model_name_or_path: m\noutput_dir: o\ndeepspeed: ds_z9.json\n")) == (
        f"deepspeed config file 'ds_z9.json' from cfg.yaml not found (looked for {tmp_path / 'ds_z9.json'}; "
        "relative paths start from the current directory). Fix the path or remove deepspeed."
    )


def test_resume_path_missing(tmp_path):
    assert error_of({**BASE, "resume_from_checkpoint": "out/checkpoint-99"}) == (
        "resume_from_checkpoint 'out/checkpoint-99' in the config dict does not exist (looked for "
        f"{tmp_path / 'out/checkpoint-99'}). Point it at a checkpoint folder, or remove it."
    )


def test_evaluation_needs_eval_data():
    assert error_of({**BASE, "eval_strategy": "steps"}) == (
        "eval_strategy is 'steps' in the config dict but there is nothing to evaluate on. Set val_size "
        "(a fraction of the training data) or eval_dataset, or set eval_strategy: no."
    )
    assert load_config({**BASE, "eval_strategy": "steps", "val_size": 0.1}).training.eval_strategy == "steps"


def test_bf16_and_fp16():
    assert error_of({**BASE, "bf16": True, "fp16": True}) == (
        "bf16 and fp16 are both true in the config dict. Pick one precision (bf16 on recent GPUs)."
    )


def test_warmup_ratio_and_steps_together():
    assert error_of(write("model_name_or_path: m\noutput_dir: o\nwarmup_ratio: 0.1\nwarmup_steps: 5\n")) == (
        "'warmup_ratio' in cfg.yaml and 'warmup_steps' in cfg.yaml set the same thing (warmup_ratio is "
        "LLaMA-Factory's name for warmup_steps). Keep only one of them."
    )


def test_qlora_with_zero3_is_refused(tmp_path):
    ds = tmp_path / "z3.json"
    ds.write_text('{"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}')
    with pytest.raises(ConfigError, match=r"quantization_bit 4 \(QLoRA\) cannot be combined with the DeepSpeed ZeRO-3"):
        load_config({"model_name_or_path": "tiny:qwen2", "output_dir": str(tmp_path / "o"), "dataset": "arith_train",
                     "finetuning_type": "qlora", "deepspeed": str(ds)})


@pytest.mark.parametrize("key, value, rule", [
    ("per_device_train_batch_size", 0, "a whole number of at least 1"),
    ("gradient_accumulation_steps", -2, "a whole number of at least 1"),
    ("num_train_epochs", 0, "greater than 0"),
    ("save_steps", 0, "greater than 0 (a step count, or a fraction of the run below 1)"),
    ("learning_rate", -1.0e-4, "0 or more"),
])
def test_trainer_numbers_out_of_range_name_the_key_and_the_file(key, value, rule):
    assert error_of(write(f"model_name_or_path: m\noutput_dir: o\n{key}: {value}\n")) == (
        f"{key} is {value!r} in cfg.yaml; it must be {rule}. Fix the value."
    )


def test_transformers_cross_option_checks_run_on_the_driver():
    text = ("model_name_or_path: m\noutput_dir: o\ndataset: d\nval_size: 0.1\neval_strategy: steps\n"
            "save_strategy: epoch\nload_best_model_at_end: true\n")
    message = error_of(write(text))
    assert message.startswith("training options: --load_best_model_at_end requires the save and eval strategy "
                              "to match"), message
    assert message.endswith("(set in cfg.yaml)") and "\n" not in message


def test_precision_is_left_to_the_workers_hardware():
    # tf32 and bf16 need a GPU that this driver may not have; the workers judge them.
    assert load_config({**BASE, "bf16": True, "tf32": True}).training.tf32 is True
