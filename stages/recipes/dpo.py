"""dpo: direct preference optimisation and its variants, chosen by ``pref_loss``.

* sigmoid: DPO, -log sigmoid(beta * margin of log-ratios); ``dpo_label_smoothing`` > 0 is cDPO.
* hinge:   relu(1 - beta * margin of log-ratios) (SLiC).
* ipo:     (margin of length-averaged log-ratios - 1 / (2 beta))^2.
* orpo:    no reference; NLL of chosen + beta * -log sigmoid(log odds ratio), length-averaged.
* simpo:   no reference; -log sigmoid(beta * margin of length-averaged log-probs - simpo_gamma).

``pref_ftx`` adds that weight times the chosen responses' average NLL (an SFT term). The formulas
follow LLaMA-Factory's CustomDPOTrainer, which TRL 1.16 splits over three trainers; its own
trainers also tokenize the data themselves, so this one is a thin ``transformers.Trainer`` over
our pre-tokenized pairs: one forward pass on chosen + rejected together (PairwiseCollator: padded,
or padding-free where the model allows), log-probs summed over the labelled tokens without the
batch's full logits (stages/training/sequence_logps.py); the reference's may be computed before
training (stages/training/reference_logps.py).
tests/stages/test_pref_losses.py checks each loss against TRL's own loss functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Trainer

from stages.job import StageJob
from stages.recipes.preference import BatchMetricsMixin
from stages.training.reference import Reference, disable_dropout
from stages.training.reference_logps import PrecomputedReferenceMixin
from stages.training.sequence_logps import SequenceLogpsMixin

LENGTH_NORMALIZED = ("ipo", "orpo", "simpo")  # these compare average, not summed, log-probs


@dataclass
class PreferenceLoss:
    """Per-pair losses and the implicit rewards that are logged as rewards/*."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def preference_loss(
    loss_type: str,
    beta: float,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PreferenceLoss:
    """The pref_loss formulas on per-pair log-probs (already length-averaged for ipo/orpo/simpo)."""
    if loss_type in ("orpo", "simpo"):
        if loss_type == "orpo":
            log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
            losses = -chosen_logps - beta * F.logsigmoid(log_odds)
        else:
            losses = -F.logsigmoid(beta * (chosen_logps - rejected_logps) - simpo_gamma)
        return PreferenceLoss(losses, beta * chosen_logps.detach(), beta * rejected_logps.detach())

    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"pref_loss {loss_type!r} needs the reference model's log-probs.")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    margin = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
        )
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"Unknown pref_loss {loss_type!r}; expected sigmoid, hinge, ipo, orpo or simpo.")
    return PreferenceLoss(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


class PreferenceTrainer(PrecomputedReferenceMixin, SequenceLogpsMixin, BatchMetricsMixin, Trainer):
    """The Trainer whose loss is ``preference_loss`` on a batch of [chosen; rejected] sequences
    (padded or padding-free), log-probs summed without the full logits (sequence_logps)."""

    def __init__(self, *args, reference: Reference, finetuning_args, **kwargs):
        super().__init__(*args, chunked_loss=finetuning_args.chunked_loss,
                         chunked_loss_tokens=finetuning_args.chunked_loss_tokens, **kwargs)
        self.reference = reference
        self.precompute_setting = finetuning_args.precompute_ref_log_probs
        self.loss_type = finetuning_args.pref_loss
        self.beta = finetuning_args.pref_beta
        self.ftx = finetuning_args.pref_ftx
        self.label_smoothing = finetuning_args.dpo_label_smoothing
        self.simpo_gamma = finetuning_args.simpo_gamma
        reference.prepare(self)

    def reference_columns(self, model, batch) -> dict[str, torch.Tensor]:
        """The reference's summed log-probs of a batch's pairs, as data columns (reference_logps.py)."""
        chosen, rejected = self.reference.logps(model, lambda m: self.sequence_logps(m, batch))[0].chunk(2)
        return {"chosen_ref_logps": chosen, "rejected_ref_logps": rejected}

    def batch_loss(self, model, inputs) -> tuple[torch.Tensor, dict[str, float]]:
        logps, lengths = self.sequence_logps(model, inputs)
        avg_logps = logps / lengths.clamp(min=1)
        policy = avg_logps if self.loss_type in LENGTH_NORMALIZED else logps
        chosen, rejected = policy.chunk(2)
        ref_chosen = ref_rejected = None
        if "ref_logps" in inputs or self.reference.kind != "none":
            ref_logps = inputs.get("ref_logps")
            if ref_logps is None:
                ref_logps, _ = self.reference.logps(model, lambda m: self.sequence_logps(m, inputs))
            ref = ref_logps / lengths.clamp(min=1) if self.loss_type in LENGTH_NORMALIZED else ref_logps
            ref_chosen, ref_rejected = ref.chunk(2)
        out = preference_loss(
            self.loss_type, self.beta, chosen, rejected, ref_chosen, ref_rejected,
            self.label_smoothing, self.simpo_gamma,
        )
        losses = out.losses
        sft_loss = -avg_logps.chunk(2)[0]  # average NLL of the chosen responses
        if self.ftx > 0:
            losses = losses + self.ftx * sft_loss
        summed_chosen, summed_rejected = logps.detach().chunk(2)
        metrics = {
            "rewards/chosen": out.chosen_rewards.mean().item(),
            "rewards/rejected": out.rejected_rewards.mean().item(),
            "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float().mean().item(),
            "rewards/margins": (out.chosen_rewards - out.rejected_rewards).mean().item(),
            "logps/chosen": summed_chosen.mean().item(),
            "logps/rejected": summed_rejected.mean().item(),
            # The policy alone prefers chosen (what preference_accuracy measures on held-out pairs).
            "logps/accuracies": (summed_chosen > summed_rejected).float().mean().item(),
            "sft_loss": sft_loss.detach().mean().item(),
        }
        return losses.mean(), metrics


def run_dpo(job: StageJob) -> dict:
    # 1. tokenizer and template exactly as the data was tokenized with
    tokenizer, template = job.tokenizer_and_template()
    # 2. the policy, and the reference it is measured against (none, the adapter-less policy, or a copy)
    model = job.load_model(tokenizer)
    disable_dropout(model)
    reference = job.build_reference(model, tokenizer)
    # 3. the preference Trainer on this worker's pairs
    trainer = job.build_trainer(
        PreferenceTrainer, model, tokenizer, reference=reference, finetuning_args=job.spec.finetuning
    )
    # 4. train, then 5. adapter/model, tokenizer + chat template, state, metrics, plot
    return job.train_and_save(trainer, tokenizer, template)
