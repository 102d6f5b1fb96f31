"""What the preference stages (dpo and its variants, kto) share: log-probs of the labelled tokens
of whole sequences, per-batch metrics, and held-out preference accuracy. The frozen reference policy
is stages/training/reference.py's (the RL policy worker has one too), loaded by stages/loading.py's
``build_reference``.

Public API (stable; stages/recipes/kto.py imports it):

* ``sequence_logps(logits, labels) -> (logps, lengths)``: per row, the summed log-prob of the
  labelled tokens (labels != IGNORE_INDEX, shifted by one as in causal LM training) and how many
  there are. float32 whatever the model's dtype.
* ``forward_logps(model, input_ids, attention_mask, labels) -> (logps, lengths)``: one forward pass
  of a causal LM, then ``sequence_logps``.
* ``BatchMetricsMixin``: put before ``transformers.Trainer`` in a stage's Trainer that defines
  ``batch_loss(model, inputs) -> (loss, {name: float})``; it stores the metrics per batch, logs
  their means (averaged over workers) with each training log line and adds them, prefixed
  ``eval_``, to evaluation results. Evaluation computes only the loss (no logits are gathered).
* ``pairwise_logps(model, pairs, pad_token_id, batch_size) -> (chosen, rejected)`` and
  ``preference_accuracy(model, pairs, pad_token_id, batch_size) -> float``: over tokenized pairs
  (rows with chosen_/rejected_ input_ids, attention_mask, labels, as registries.tokenize.pairwise
  writes them), the fraction where the model's summed log-prob of the chosen response is strictly
  higher than of the rejected one. This is the held-out check that a preference run learned.
* ``adapter_preference_report(model, pairs, pad_token_id, beta) -> dict``: the same pairs judged
  for a LoRA policy (a PeftModel) against its own base, the adapter off: both models' accuracy and
  mean log-prob margin, and the accuracy and mean of the implied reward DPO and KTO optimise.
  ``judge_adapter(output_dir, dataset, dataset_dir, beta)`` does it for a saved LoRA run's output
  on a ranking dataset: base, tokenizer and template come from what the run saved.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any, Sequence

import torch

from registries.tokenize import IGNORE_INDEX

from stages.training.preference_collators import PairwiseCollator


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, V) logits and (B, L) labels -> (B,) summed log-probs of labelled tokens, (B,) counts.

    Token t is predicted by the logits at t - 1, so both are shifted by one, exactly as the
    causal-LM loss does. Computed in float32: bf16 log-softmax loses the small differences
    between chosen and rejected that the preference losses are made of.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not line up.")
    labels = labels[:, 1:]
    logits = logits[:, :-1, :].float()
    mask = labels != IGNORE_INDEX
    safe_labels = labels.masked_fill(~mask, 0)  # any valid index; masked out below
    # gather - logsumexp is log_softmax at the label without materialising a second (B, L, V) tensor
    picked = torch.gather(logits, -1, safe_labels.unsqueeze(-1)).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    return (per_token * mask).sum(-1), mask.sum(-1).float()


def forward_logps(model, input_ids, attention_mask, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass of a causal LM -> ``sequence_logps`` of its logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return sequence_logps(logits, labels)


class BatchMetricsMixin:
    """Per-batch metrics of a custom loss, logged like TRL's trainers log theirs (see module doc)."""

    # batch_loss returns a per-batch mean: the Trainer must still divide by accumulation steps.
    loss_is_scaled_for_ga = False

    def batch_loss(self, model, inputs) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, metrics = self.batch_loss(model, inputs)
        if not hasattr(self, "_batch_metrics"):
            self._batch_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        store = self._batch_metrics["train" if model.training else "eval"]
        for key, value in metrics.items():
            store[key].append(value)
        return (loss, metrics) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def pop_metrics(self, mode: str) -> dict[str, float]:
        """Means of the values stored since the last call, averaged over all workers (a collective:
        the Trainer logs and evaluates on every rank, so every rank gets here)."""
        store = getattr(self, "_batch_metrics", {}).get(mode)
        if not store:
            return {}
        keys = sorted(store)
        means = torch.tensor([sum(store[k]) / len(store[k]) for k in keys], device=self.args.device)
        if self.accelerator.num_processes > 1:
            means = self.accelerator.reduce(means, reduction="mean")
        store.clear()
        return dict(zip(keys, means.tolist()))

    def evaluation_loop(self, *args, **kwargs):
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        output.metrics.update({f"{prefix}_{k}": v for k, v in self.pop_metrics("eval").items()})
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log line
            logs.update(self.pop_metrics("train"))
        super().log(logs, start_time)


# --------------------------------------------------------------- held-out preference accuracy


def pairwise_logps(
    model, pairs: Sequence[dict] | Any, pad_token_id: int, batch_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probs of every pair, in order, in eval mode without gradients."""
    collator = PairwiseCollator(pad_token_id=pad_token_id)
    rows = [pairs[i] for i in range(len(pairs))]
    if not rows:
        raise ValueError("No preference pairs to score.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = {k: v.to(device) for k, v in collator(rows[start : start + batch_size]).items()}
                logps, _ = forward_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
                c, r = logps.chunk(2)
                chosen.append(c.cpu())
                rejected.append(r.cpu())
    finally:
        model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def preference_accuracy(model, pairs: Sequence[dict] | Any, pad_token_id: int, batch_size: int = 32) -> float:
    """Fraction of pairs whose chosen response the model gives a strictly higher log-prob."""
    chosen, rejected = pairwise_logps(model, pairs, pad_token_id, batch_size)
    return float((chosen > rejected).float().mean())


def adapter_preference_report(model, pairs, pad_token_id: int, beta: float | None = None) -> dict[str, float]:
    """``base_*`` (adapter off) and ``trained_*`` accuracy and mean margin (chosen - rejected
    log-prob, nats) of a PeftModel on tokenized pairs; with ``beta``, ``reward_accuracy`` and
    ``reward_margin`` of the implied reward beta * log(policy / base), chosen minus rejected."""
    policy_c, policy_r = pairwise_logps(model, pairs, pad_token_id)
    with model.disable_adapter():
        base_c, base_r = pairwise_logps(model, pairs, pad_token_id)
    report = {
        "base_accuracy": float((base_c > base_r).float().mean()), "base_margin": float((base_c - base_r).mean()),
        "trained_accuracy": float((policy_c > policy_r).float().mean()),
        "trained_margin": float((policy_c - policy_r).mean()),
    }
    if beta is not None:
        reward_margin = beta * ((policy_c - base_c) - (policy_r - base_r))
        report.update(reward_accuracy=float((reward_margin > 0).float().mean()), reward_margin=float(reward_margin.mean()))
    return report


def judge_adapter(
    output_dir: str, dataset: str, dataset_dir: str, beta: float | None = None, cutoff_len: int = 1024
) -> dict[str, float]:
    """``adapter_preference_report`` of a saved LoRA policy on a ranking dataset (e.g. held-out pairs)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from registries.datasets import DataArguments

    from stages.run_args import ModelArguments
    from stages.loading import load_tokenizer_and_template
    from stages.table import STAGES

    # template None: detected from the chat template the run saved with its output.
    tokenizer, template = load_tokenizer_and_template(ModelArguments(model_name_or_path=output_dir), DataArguments())
    with open(os.path.join(output_dir, "adapter_config.json"), encoding="utf-8") as f:
        base = AutoModelForCausalLM.from_pretrained(json.load(f)["base_model_name_or_path"])
    model = PeftModel.from_pretrained(base, output_dir)
    data_args = DataArguments(dataset=dataset, dataset_dir=dataset_dir, cutoff_len=cutoff_len)
    pairs = STAGES["dpo"].tokenize_here(tokenizer, template, data_args)
    return adapter_preference_report(model, pairs, tokenizer.pad_token_id, beta)


__all__ = [
    "adapter_preference_report",
    "BatchMetricsMixin",
    "forward_logps",
    "judge_adapter",
    "pairwise_logps",
    "preference_accuracy",
    "sequence_logps",
]
