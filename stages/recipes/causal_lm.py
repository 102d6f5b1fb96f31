"""pt and sft: the causal-LM loss on labelled tokens (pt labels every token, sft masks the prompt).

A worker's recipe, top to bottom."""

from __future__ import annotations

from transformers import Trainer

from stages.training.chunked_loss import ChunkedLossMixin
from stages.job import StageJob


class CausalLMTrainer(ChunkedLossMixin, Trainer):
    """The Transformers Trainer, with the loss in chunks of tokens where ``chunked_loss`` says so."""


def run_causal_lm(job: StageJob) -> dict:
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = job.tokenizer_and_template()
    # 2. model with its adapter (full / freeze / lora / qlora)
    model = job.load_model(tokenizer)
    # 3. the Trainer on this worker's data (the stage table's collator), the loss chunked for big vocabularies
    tuning = job.spec.finetuning
    trainer = job.build_trainer(CausalLMTrainer, model, tokenizer, chunked_loss=tuning.chunked_loss,
                                chunked_loss_tokens=tuning.chunked_loss_tokens)
    # 4. train, then 5. adapter/model, tokenizer + chat template, state, metrics, plot
    return job.train_and_save(trainer, tokenizer, template)
