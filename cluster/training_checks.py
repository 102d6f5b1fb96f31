"""Trainer options checked on the driver, so a bad value is one clear error before any work
instead of a traceback from every Ray Train worker."""

from __future__ import annotations

import json
import os
import typing

from stages.run_args import TrainingOptions, TrainingOptionsError
from stages.training.checkpoints import ResumeError, check_resumable

from .config_types import ConfigError

# (key, test, what the value must be): ranges transformers itself does not check up front.
_RANGES = (
    ("per_device_train_batch_size", lambda v: v >= 1, "a whole number of at least 1"),
    ("per_device_eval_batch_size", lambda v: v >= 1, "a whole number of at least 1"),
    ("gradient_accumulation_steps", lambda v: v >= 1, "a whole number of at least 1"),
    ("num_train_epochs", lambda v: v > 0, "greater than 0"),
    ("logging_steps", lambda v: v > 0, "greater than 0 (a step count, or a fraction of the run below 1)"),
    ("save_steps", lambda v: v > 0, "greater than 0 (a step count, or a fraction of the run below 1)"),
    ("eval_steps", lambda v: v > 0, "greater than 0 (a step count, or a fraction of the run below 1)"),
    ("learning_rate", lambda v: v >= 0, "0 or more"),
    ("weight_decay", lambda v: v >= 0, "0 or more"),
    ("warmup_steps", lambda v: v >= 0, "0 or more"),
)


def check_training_options(options: TrainingOptions, where: typing.Callable[[str], str]) -> None:
    values = options.values
    for key, test, rule in _RANGES:
        value = values.get(key)
        if value is not None and not isinstance(value, bool) and not test(value):
            raise ConfigError(f"{key} is {value!r} in {where(key)}; it must be {rule}. Fix the value.", key=key)
    # transformers' own cross-option checks (strategies that must match, ...). What depends on the
    # hardware (precision, DeepSpeed) is left to the workers: the driver may run on a CPU-only head.
    try:
        options.build(deepspeed=None, use_cpu=True, bf16=False, fp16=False, tf32=None)
    except TrainingOptionsError as exc:
        keys = [k for k in values if k in str(exc)]
        places = sorted({where(k) for k in keys}) or [where("output_dir")]
        raise ConfigError(f"{exc} (set in {' / '.join(places)})", key=keys[0] if keys else None) from None


def planned_work(values: dict) -> tuple[bool, bool]:
    """(train, predict). transformers defaults do_train to false, but a config that leaves it out
    trains (as every run here always has); only an explicit ``do_train: false`` skips training."""
    return bool(values.get("do_train", True)), bool(values.get("do_predict", False))


def check_planned_work(run, where: typing.Callable[[str], str]) -> None:
    """A run has something to do, and prediction has what it needs."""
    from stages.table import stages_where

    values = run.training.values
    do_train, do_predict = planned_work(values)
    if not do_predict:
        if not do_train:
            raise ConfigError(
                f"do_train is false in {where('do_train')} and do_predict is not set, so this run has nothing to do. "
                "Set do_train: true to train, or do_predict: true with predict_with_generate: true and eval_dataset "
                "to predict."
            )
        return
    stage, predictors = run.finetuning.stage, stages_where("predicts")
    if not run.finetuning.spec.predicts:
        raise ConfigError(
            f"do_predict is true in {where('do_predict')} for stage {stage!r}, but prediction "
            f"(generated_predictions.jsonl and its BLEU/ROUGE scores) is built for stage {predictors} only. Remove "
            f"do_predict, or predict with a separate config that has stage: {predictors} and the trained output as "
            "adapter_name_or_path (lora) or model_name_or_path."
        )
    if not values.get("predict_with_generate"):
        raise ConfigError(
            f"do_predict is true in {where('do_predict')} but predict_with_generate is not: predictions here are "
            "generated replies scored with BLEU and ROUGE. Set predict_with_generate: true."
        )
    if not run.data.eval_dataset:
        raise ConfigError(
            f"do_predict is true in {where('do_predict')} but eval_dataset is not set, so there are no rows to "
            "predict. Set eval_dataset to one or more names from dataset_info.json (e.g. eval_dataset: arith_eval)."
        )


def check_template(name: str | None) -> None:
    """A named template exists (``auto`` and unset are resolved from the tokenizer when the run loads it)."""
    from registries.templates import get_template
    from registries.templates.autodetect import AUTO

    if name not in (None, AUTO):
        try:
            get_template(name)
        except ValueError as exc:  # the only error get_template raises: an unknown name
            raise ConfigError(f"template: {exc}") from None


def check_streaming(stage_name: str, launch: str, values: dict, where: typing.Callable[[str], str]) -> None:
    """streaming: true trains from a stream with no known length, so the run needs a step count,
    and only the Ray Train stages read their data that way (RL stages sample prompts on the driver)."""
    if launch == "rl_controller":
        raise ConfigError(
            f"streaming is true in {where('streaming')}, but stage {stage_name!r} keeps its prompts on the driver "
            "and samples them each step, so it has nothing to stream. Remove streaming."
        )
    max_steps = values.get("max_steps")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps <= 0:
        raise ConfigError(
            f"streaming is true in {where('streaming')} but max_steps is {max_steps!r}: a streamed dataset has no "
            "length, so the number of epochs cannot say when training ends. Set max_steps (the optimizer steps "
            "to train), as LLaMA-Factory requires for streaming too."
        )


def resolve_explicit_checkpoint(training: dict, where: typing.Callable[[str], str], kind: str | None = None) -> None:
    """An explicit ``resume_from_checkpoint`` becomes an absolute path and must be a committed checkpoint
    of the run's kind (stages/training/checkpoints.py ``check_resumable``, the check every stage's
    resolver makes at launch too), refused here before any work. "auto" stays as it is: it is
    resolved at launch, since output_dir may only get its checkpoints later (a rerun of a died run)."""
    resume = training.get("resume_from_checkpoint")
    if not isinstance(resume, str) or resume == "auto":
        return
    if not os.path.isdir(resume):
        raise ConfigError(
            f"resume_from_checkpoint {resume!r} in {where('resume_from_checkpoint')} does not exist "
            f"(looked for {os.path.abspath(resume)}). Point it at a checkpoint folder, or remove it."
        )
    path = training["resume_from_checkpoint"] = os.path.abspath(resume)
    try:
        check_resumable(path, place=where("resume_from_checkpoint"), kind=kind)
    except ResumeError as exc:
        raise ConfigError(str(exc)) from None


def loaded_zero_stage(training: dict) -> int | None:
    """The ZeRO stage of the config's DeepSpeed JSON once read_deepspeed_config has loaded it (None
    without one, or while it is still a path)."""
    ds_config = training.get("deepspeed")
    return ds_config.get("zero_optimization", {}).get("stage") if isinstance(ds_config, dict) else None


def read_deepspeed_config(training: dict, model, tuning, where: typing.Callable[[str], str]) -> None:
    """``deepspeed``: a file path becomes its JSON (read here: workers on other nodes may not have
    the file), and what ZeRO-3 cannot partition is refused."""
    ds = training.get("deepspeed")
    if isinstance(ds, str):
        if not os.path.isfile(ds):
            raise ConfigError(
                f"deepspeed config file {ds!r} from {where('deepspeed')} not found (looked for {os.path.abspath(ds)}; "
                "relative paths start from the current directory). Fix the path or remove deepspeed."
            )
        try:
            with open(ds, encoding="utf-8") as f:
                training["deepspeed"] = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"deepspeed config file {ds} is not valid JSON ({exc}). Fix the file.") from None
    zero_stage = loaded_zero_stage(training)
    if model.quantization_bit and zero_stage == 3:
        raise ConfigError(
            f"quantization_bit {model.quantization_bit} (QLoRA) cannot be combined with the DeepSpeed ZeRO-3 config "
            f"from {where('deepspeed')}: bitsandbytes weights cannot be partitioned. Use a ZeRO-2 config "
            "(configs/deepspeed/ds_z2_config.json) or drop quantization_bit."
        )
    if tuning.chunked_loss and zero_stage == 3:
        raise ConfigError(
            f"chunked_loss is true in {where('chunked_loss')}, but the DeepSpeed ZeRO-3 config from "
            f"{where('deepspeed')} partitions the output head's weight, which the chunked loss calls chunk by "
            "chunk outside the model's forward. Use a ZeRO-2 config, or remove chunked_loss (null keeps the "
            "plain loss under ZeRO-3)."
        )
