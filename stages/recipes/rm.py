"""rm: a reward model, the causal LM plus a scalar value head, trained on preference pairs.

Loss: -log sigmoid(r_chosen - r_rejected) (Bradley-Terry), r = the head's value at the last real
token. Logged: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins while
training; eval_loss and eval_accuracy (plus eval_rewards/*) on evaluation. The output folder is
the causal LM as usual (LoRA adapter or full model) plus value_head.safetensors:
``stages.loading.load_reward_model(output_dir)`` loads it for PPO or a server.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from stages.job import StageJob
from stages.recipes.preference import BatchMetricsMixin
from stages.training.value_head import ValueHeadModel, is_adapter_folder


FORWARD_COLUMNS = ("input_ids", "attention_mask", "position_ids", "sequence_ids")


def pairwise_reward_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley-Terry loss: -log sigmoid(r_chosen - r_rejected)."""
    return -F.logsigmoid(chosen - rejected)


class RewardTrainer(BatchMetricsMixin, Trainer):
    """Trains a ``ValueHeadModel`` on stacked [chosen; rejected] batches; saves LM + value head."""

    def batch_loss(self, model, inputs) -> tuple[torch.Tensor, dict[str, float]]:
        # Padded (attention_mask) or padding-free (position_ids, sequence_ids) pairs: stages/training/preference_collators.py
        rewards = model(**{k: inputs[k] for k in FORWARD_COLUMNS if k in inputs}).rewards
        chosen, rejected = rewards.chunk(2)
        loss = pairwise_reward_loss(chosen, rejected).mean()
        chosen, rejected = chosen.detach(), rejected.detach()
        accuracy = (chosen > rejected).float().mean().item()
        metrics = {
            "rewards/chosen": chosen.mean().item(),
            "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": accuracy,
            "rewards/margins": (chosen - rejected).mean().item(),
        }
        if not model.training:
            metrics["accuracy"] = accuracy  # eval_accuracy, LLaMA-Factory's name for it
        return loss, metrics

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # The Trainer saves only PreTrainedModel / PeftModel; the wrapper saves its two parts itself.
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        self.accelerator.unwrap_model(self.model).save(output_dir, state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Resume: the checkpoint's LM weights (adapter or full) and value head, into the live model."""
        model = model or self.model
        model = self.accelerator.unwrap_model(model)
        if is_adapter_folder(resume_from_checkpoint):
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            set_peft_model_state_dict(model.pretrained_model, load_peft_weights(resume_from_checkpoint))
        else:
            from safetensors.torch import load_file

            weights = load_file(os.path.join(resume_from_checkpoint, "model.safetensors"))
            model.pretrained_model.load_state_dict(weights, strict=False)  # tied weights are saved once
        model.load_value_head(resume_from_checkpoint)


def run_rm(job: StageJob) -> dict:
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = job.tokenizer_and_template()
    # 2. causal LM with its adapter, plus a fresh value head (always trained, whatever the adapter)
    model = ValueHeadModel(job.load_model(tokenizer))
    # 3. the pairwise Trainer on this worker's pairs
    trainer = job.build_trainer(RewardTrainer, model, tokenizer)
    # 4. train, then 5. LM (adapter or full) + value_head.safetensors, tokenizer + chat template, state, metrics
    return job.train_and_save(trainer, tokenizer, template)
