"""pt and sft: the causal-LM loss on labelled tokens (pt labels every token, sft masks the prompt).

A worker's recipe, top to bottom."""

from __future__ import annotations

from transformers import Trainer

from .callbacks import JsonlLogCallback
from .collators import build_collator
from .job import StageJob
from .loading import load_model, load_tokenizer_and_template
from .outputs import save_outputs


def run_causal_lm(job: StageJob) -> dict:
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = load_tokenizer_and_template(job.model_args, job.data_args)
    # 2. model with its adapter (full / freeze / lora / qlora)
    model = load_model(job.model_args, job.finetuning_args, tokenizer, job.training_args)
    # 3. the Transformers Trainer on this worker's data
    trainer = Trainer(
        model=model,
        args=job.training_args,
        train_dataset=job.train_dataset,
        eval_dataset=job.eval_dataset,
        data_collator=build_collator(job.finetuning_args.stage, tokenizer, job.data_args, model),
        processing_class=tokenizer,
        callbacks=[JsonlLogCallback(job.training_args.output_dir), *job.callbacks],
    )
    if job.prepare_trainer is not None:
        trainer = job.prepare_trainer(trainer)
    # 4. train (resuming restores optimizer, scheduler, RNG and the data position)
    result = trainer.train(resume_from_checkpoint=job.resume_from_checkpoint)
    # 5. adapter/model, tokenizer + chat template, state, metrics, plot
    return save_outputs(trainer, tokenizer, template, result, job.finetuning_args)
