"""kto: Kahneman-Tversky Optimization on single answers tagged desirable or undesirable.

The loss follows TRL 1.16's ``KTOTrainer`` (paper eq. 7, https://huggingface.co/papers/2402.01306):

    z0        = clamp(mean(log pi(y'|x) - log ref(y'|x)), min=0), detached   (y' = a mismatched answer)
    desirable   : w_d * (1 - sigmoid(beta * (log pi(y|x) - log ref(y|x) - z0)))
    undesirable : w_u * (1 - sigmoid(beta * (z0 - (log pi(y|x) - log ref(y|x)))))

TRL's trainer itself wants raw prompt/completion text and tokenizes it; our rows arrive already
tokenized by the registries through Ray Data (with the mismatched KL example built there), so the
loss lives in a thin ``transformers.Trainer`` subclass instead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers import Trainer

from .callbacks import JsonlLogCallback
from .collators import build_collator
from .job import StageJob
from .loading import load_model, load_tokenizer_and_template
from .outputs import save_outputs
from .preference import Reference, build_reference, disable_dropout, forward_logps


@dataclass
class KTOLossOutput:
    loss: torch.Tensor  # scalar: mean over the batch's rows of the weighted per-row losses
    chosen_rewards: torch.Tensor  # beta * log-ratio of each desirable row (detached)
    rejected_rewards: torch.Tensor  # beta * log-ratio of each undesirable row (detached)
    kl: torch.Tensor  # the clamped, detached KL estimate z0 (a 0-d tensor)


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    policy_kl_logps: torch.Tensor,
    reference_kl_logps: torch.Tensor,
    tags: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    reduce_kl: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> KTOLossOutput:
    """The KTO loss of one batch from summed log-probs of each row's labelled tokens.

    ``tags`` is True for desirable rows. ``reduce_kl`` averages the KL estimate over workers (TRL
    gathers it across ranks) before it is clamped, so every rank uses the same reference point.
    """
    tags = tags.to(device=policy_logps.device, dtype=torch.bool)
    # The KL term is a baseline, not something to optimise: no gradient flows through it.
    kl = (policy_kl_logps - reference_kl_logps).mean().detach()
    if reduce_kl is not None:
        kl = reduce_kl(kl)
    kl = kl.clamp(min=0)

    logratios = policy_logps - reference_logps
    chosen_ratios, rejected_ratios = logratios[tags], logratios[~tags]
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_ratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_ratios))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return KTOLossOutput(
        loss=losses.mean(),
        chosen_rewards=beta * chosen_ratios.detach(),
        rejected_rewards=beta * rejected_ratios.detach(),
        kl=kl,
    )


# ------------------------------------------------------------------------------ the trainer

class KTOTrainer(Trainer):
    """``transformers.Trainer`` whose loss is KTO over the KTO collator's batches.

    Per batch: one forward pass of the policy on the tagged answers (with gradients), one on the
    mismatched KL answers (without: the KL term is detached anyway), and the reference on both.
    """

    def __init__(self, *args, finetuning_args, reference: Reference, **kwargs):
        super().__init__(*args, **kwargs)
        self.finetuning_args = finetuning_args
        self.reference = reference
        self.reference.prepare(self)
        # The loss is ours and already a per-batch mean: the Trainer must divide it by the
        # accumulation steps itself instead of expecting the model to normalise by token count.
        self.model_accepts_loss_kwargs = False
        self._metrics = {"train": defaultdict(float), "eval": defaultdict(float)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.finetuning_args
        tags = inputs["kto_tags"].bool()
        logps, lengths = forward_logps(model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])
        kl_batch = (inputs["kl_input_ids"], inputs["kl_attention_mask"], inputs["kl_labels"])
        with torch.no_grad():
            kl_logps, _ = forward_logps(model, *kl_batch)
        ref_logps, _ = self.reference.logps(model, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])
        ref_kl_logps, _ = self.reference.logps(model, *kl_batch)

        out = kto_loss(
            logps, ref_logps, kl_logps, ref_kl_logps, tags, args.pref_beta,
            args.kto_chosen_weight, args.kto_rejected_weight, reduce_kl=self._mean_over_workers,
        )
        loss = out.loss
        if args.pref_ftx > 0 and tags.any():
            # SFT on the desirable answers: mean per-token negative log-likelihood.
            loss = loss + args.pref_ftx * (-(logps[tags] / lengths[tags].clamp(min=1))).mean()
        self._record(out, logps.detach(), tags, "train" if model.training else "eval")
        return (loss, {}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation needs the loss and the reward metrics only (there are no logits to return)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _mean_over_workers(self, value: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(value.reshape(1), reduction="mean").reshape(())

    def _record(self, out: KTOLossOutput, logps: torch.Tensor, tags: torch.Tensor, mode: str) -> None:
        """Accumulate sums and counts (over every worker) until the next log line."""
        stats = torch.stack([
            out.chosen_rewards.sum(), torch.tensor(float(out.chosen_rewards.numel())),
            out.rejected_rewards.sum(), torch.tensor(float(out.rejected_rewards.numel())),
            logps[tags].sum(), logps[~tags].sum(), out.kl, torch.tensor(1.0),
        ]).to(self.args.device, torch.float32)
        stats = self.accelerator.reduce(stats, reduction="sum").tolist()
        names = ("chosen_sum", "chosen_n", "rejected_sum", "rejected_n", "logps_chosen", "logps_rejected",
                 "kl_sum", "batches")
        for name, value in zip(names, stats):
            self._metrics[mode][name] += value

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        sums, self._metrics[mode] = self._metrics[mode], defaultdict(float)
        prefix = "eval_" if mode == "eval" else ""
        metrics = {}
        if sums["batches"]:
            metrics["kl"] = sums["kl_sum"] / sums["batches"]
        if sums["chosen_n"]:
            metrics["rewards/chosen"] = sums["chosen_sum"] / sums["chosen_n"]
            metrics["logps/chosen"] = sums["logps_chosen"] / sums["chosen_n"]
        if sums["rejected_n"]:
            metrics["rewards/rejected"] = sums["rejected_sum"] / sums["rejected_n"]
            metrics["logps/rejected"] = sums["logps_rejected"] / sums["rejected_n"]
        if sums["chosen_n"] and sums["rejected_n"]:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        logs.update({prefix + key: round(value, 6) for key, value in metrics.items()})
        super().log(logs, start_time)


# ------------------------------------------------------------------------------ the recipe
def run_kto(job: StageJob) -> dict:
    args = job.training_args
    # The KTO columns (kl_*, kto_tags) are not arguments of the model's forward(): keep them.
    args.remove_unused_columns = False
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = load_tokenizer_and_template(job.model_args, job.data_args)
    # 2. policy with its adapter, and the frozen reference (LoRA: the same model, adapter off)
    model = load_model(job.model_args, job.finetuning_args, tokenizer, args)
    disable_dropout(model)  # dropout noise would separate policy from reference before any learning
    reference = build_reference(model, job.model_args, job.finetuning_args, tokenizer, args)
    # 3. the KTO trainer on this worker's data
    trainer = KTOTrainer(
        model=model,
        args=args,
        train_dataset=job.train_dataset,
        eval_dataset=job.eval_dataset,
        data_collator=build_collator("kto", tokenizer, job.data_args, model),
        processing_class=tokenizer,
        callbacks=[JsonlLogCallback(args.output_dir), *job.callbacks],
        finetuning_args=job.finetuning_args,
        reference=reference,
    )
    if job.prepare_trainer is not None:
        trainer = job.prepare_trainer(trainer)
    # 4. train (resuming restores optimizer, scheduler, RNG and the data position)
    result = trainer.train(resume_from_checkpoint=job.resume_from_checkpoint)
    # 5. adapter/model, tokenizer + chat template, state, metrics, plot
    return save_outputs(trainer, tokenizer, template, result, job.finetuning_args)
