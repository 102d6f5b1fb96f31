"""pt and sft: the causal-LM loss on labelled tokens (pt labels every token, sft masks the prompt).

A worker's recipe, top to bottom."""

from __future__ import annotations

from transformers import Trainer

from .collators import build_collator
from .job import StageJob
from .loading import load_model, load_tokenizer_and_template


def run_causal_lm(job: StageJob) -> dict:
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = load_tokenizer_and_template(job.model_args, job.data_args)
    # 2. model with its adapter (full / freeze / lora / qlora)
    model = load_model(job.model_args, job.finetuning_args, tokenizer, job.training_args)
    # 3. the Transformers Trainer on this worker's data
    trainer = job.build_trainer(
        Trainer, model, tokenizer, build_collator(job.finetuning_args.stage, tokenizer, job.data_args, model)
    )
    # 4. train, then 5. adapter/model, tokenizer + chat template, state, metrics, plot
    return job.train_and_save(trainer, tokenizer, template)
