"""What the fabric hands a stage: typed config slices, the worker's data, and hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class StageJob:
    model_args: Any
    data_args: Any
    finetuning_args: Any
    training_args: Any  # transformers.Seq2SeqTrainingArguments
    train_dataset: Any  # datasets.Dataset of tokenized rows
    eval_dataset: Optional[Any] = None
    callbacks: list = field(default_factory=list)  # extra TrainerCallbacks (Ray reporting, tests)
    resume_from_checkpoint: Optional[str] = None
    # The distribution layer's last word on the trainer (e.g. Ray's prepare_trainer); stages stay placement-free.
    prepare_trainer: Optional[Callable] = None
