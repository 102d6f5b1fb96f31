"""Trainer options checked on the driver, so a bad value is one clear error before any work
instead of a traceback from every Ray Train worker."""

from __future__ import annotations

import typing

from stages.args import TrainingOptions, TrainingOptionsError

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
            raise ConfigError(f"{key} is {value!r} in {where(key)}; it must be {rule}. Fix the value.")
    # transformers' own cross-option checks (strategies that must match, ...). What depends on the
    # hardware (precision, DeepSpeed) is left to the workers: the driver may run on a CPU-only head.
    try:
        options.build(deepspeed=None, use_cpu=True, bf16=False, fp16=False, tf32=None)
    except TrainingOptionsError as exc:
        keys = [k for k in values if k in str(exc)]
        places = sorted({where(k) for k in keys}) or [where("output_dir")]
        raise ConfigError(f"{exc} (set in {' / '.join(places)})") from None
