"""What the fabric hands a stage: typed config slices, the worker's data, and hooks.

Also the two steps every recipe ends with, so each stage only says what differs: which Trainer,
which collator, which extra arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .callbacks import JsonlLogCallback
from .outputs import save_outputs


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

    def build_trainer(self, trainer_class, model, tokenizer, collator, args=None, **extra):
        """`trainer_class` on this worker's data, logging to trainer_log.jsonl, handed to the fabric's hook."""
        args = args if args is not None else self.training_args
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            data_collator=collator,
            processing_class=tokenizer,
            callbacks=[JsonlLogCallback(args.output_dir), *self.callbacks],
            **extra,
        )
        return self.prepare_trainer(trainer) if self.prepare_trainer is not None else trainer

    def train_and_save(self, trainer, tokenizer, template) -> dict:
        """Train (a resume restores optimizer, scheduler, RNG and the data position), then write the
        adapter or model, the tokenizer with its chat template, state, metrics and the loss plot."""
        result = trainer.train(resume_from_checkpoint=self.resume_from_checkpoint)
        return save_outputs(trainer, tokenizer, template, result, self.finetuning_args)
