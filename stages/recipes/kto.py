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

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers import Trainer

from stages.job import StageJob
from stages.recipes.preference import BatchMetricsMixin
from stages.training.reference import Reference, disable_dropout
from stages.training.reference_logps import PrecomputedReferenceMixin
from stages.training.sequence_logps import SequenceLogpsMixin
from stages.training.shared_prefix import SharedPrefixes, recording, reusing


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

class KTOTrainer(PrecomputedReferenceMixin, SequenceLogpsMixin, BatchMetricsMixin, Trainer):
    """``transformers.Trainer`` whose loss is KTO over the KTO collator's batches.

    Per batch: one forward pass of the policy on the tagged answers (with gradients), one on the
    mismatched KL answers (without: the KL term is detached anyway), and the reference on both
    (or its log-probs from the data: reference_logps.py). Each KL pass may reuse its model's keys
    of the prompt from the answers' pass (stages/training/shared_prefix.py).
    """

    def __init__(self, *args, finetuning_args, reference: Reference, **kwargs):
        super().__init__(*args, chunked_loss=finetuning_args.chunked_loss,
                         chunked_loss_tokens=finetuning_args.chunked_loss_tokens, **kwargs)
        self.finetuning_args = finetuning_args
        self.reference = reference
        self.precompute_setting = finetuning_args.precompute_ref_log_probs
        reference.prepare(self)

    def answer_and_kl_logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed log-probs of the answers, their label counts, the KL answers' summed log-probs):
        the answers with gradients as the caller has them, the KL answers without. Where the batch
        was laid out to share prompts, the KL pass attends to the answers' pass's kept keys."""
        shared = SharedPrefixes.of(batch)
        with recording(shared):
            logps, lengths = self.sequence_logps(model, batch)
        with torch.no_grad(), reusing(shared):
            kl_logps, _ = self.sequence_logps(model, batch, "kl_")
        return logps, lengths, kl_logps

    def reference_columns(self, model, batch) -> dict[str, torch.Tensor]:
        """The reference's summed log-probs of a batch's answers and KL answers, as data columns."""
        ref_logps, _, kl_ref_logps = self.reference.logps(model, lambda m: self.answer_and_kl_logps(m, batch))
        return {"ref_logps": ref_logps, "kl_ref_logps": kl_ref_logps}

    def batch_loss(self, model, inputs) -> tuple[torch.Tensor, dict[str, float]]:
        args = self.finetuning_args
        tags = inputs["kto_tags"].bool()
        logps, lengths, kl_logps = self.answer_and_kl_logps(model, inputs)
        if "ref_logps" in inputs:
            ref_logps, ref_kl_logps = inputs["ref_logps"], inputs["kl_ref_logps"]
        else:
            reference = self.reference_columns(model, inputs)
            ref_logps, ref_kl_logps = reference["ref_logps"], reference["kl_ref_logps"]

        out = kto_loss(
            logps, ref_logps, kl_logps, ref_kl_logps, tags, args.pref_beta,
            args.kto_chosen_weight, args.kto_rejected_weight, reduce_kl=self._mean_over_workers,
        )
        loss = out.loss
        if args.pref_ftx > 0 and tags.any():
            # SFT on the desirable answers: their mean per-token negative log-likelihood.
            loss = loss + args.pref_ftx * (-(logps[tags] / lengths[tags].clamp(min=1))).mean()
        logps = logps.detach()
        # Sums and counts, not means: a batch may hold one kind only (see pop_metrics).
        metrics = {
            "kl": out.kl.item(),
            "chosen/count": float(tags.sum()),
            "rejected/count": float((~tags).sum()),
            "chosen/rewards_sum": out.chosen_rewards.sum().item(),
            "rejected/rewards_sum": out.rejected_rewards.sum().item(),
            "chosen/logps_sum": logps[tags].sum().item(),
            "rejected/logps_sum": logps[~tags].sum().item(),
        }
        return loss, metrics

    def pop_metrics(self, mode: str) -> dict[str, float]:
        """Per-row means since the last log line. The mixin averages each key over batches and
        workers (all see equally many batches), so mean(sums) / mean(counts) is the exact ratio."""
        means = super().pop_metrics(mode)
        if not means:
            return {}
        metrics = {"kl": means["kl"]}
        for kind in ("chosen", "rejected"):
            if means[f"{kind}/count"] > 0:
                metrics[f"rewards/{kind}"] = means[f"{kind}/rewards_sum"] / means[f"{kind}/count"]
                metrics[f"logps/{kind}"] = means[f"{kind}/logps_sum"] / means[f"{kind}/count"]
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics

    def _mean_over_workers(self, value: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return value
        return self.accelerator.reduce(value.reshape(1), reduction="mean").reshape(())


# ------------------------------------------------------------------------------ the recipe
def run_kto(job: StageJob) -> dict:
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = job.tokenizer_and_template()
    # 2. policy with its adapter, and the frozen reference (LoRA: the same model, adapter off)
    model = job.load_model(tokenizer)
    disable_dropout(model)  # dropout noise would separate policy from reference before any learning
    reference = job.build_reference(model, tokenizer)
    # 3. the KTO trainer on this worker's data (kl_* and kto_tags columns kept: see the stage table)
    trainer = job.build_trainer(KTOTrainer, model, tokenizer, finetuning_args=job.spec.finetuning, reference=reference)
    # 4. train, then 5. adapter/model, tokenizer + chat template, state, metrics, plot
    return job.train_and_save(trainer, tokenizer, template)
