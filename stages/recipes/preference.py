"""What the preference stages (dpo and its variants, kto) share: log-probs of the labelled tokens
of whole sequences, the frozen reference policy, and held-out preference accuracy.

Public API (stable; stages/recipes/kto.py imports it):

* ``sequence_logps(logits, labels) -> (logps, lengths)``: per row, the summed log-prob of the
  labelled tokens (labels != IGNORE_INDEX, shifted by one as in causal LM training) and how many
  there are. float32 whatever the model's dtype.
* ``forward_logps(model, input_ids, attention_mask, labels) -> (logps, lengths)``: one forward pass
  of a causal LM, then ``sequence_logps``.
* ``build_reference(policy, model_args, finetuning_args, tokenizer, training_args) -> Reference``:
  how the stage obtains reference log-probs. ``Reference.kind`` is
  ``"none"`` (orpo/simpo: no reference at all), ``"adapter_disabled"`` (LoRA: the policy itself
  with its adapter switched off, so no second copy of the weights) or ``"model"`` (full/freeze
  training, or an explicit ``ref_model``: a separate frozen model).
* ``Reference.prepare(trainer)``: once the Trainer exists, put a separate reference model on the
  training device (wrapped by DeepSpeed for ZeRO-3, which shards it like the policy).
* ``Reference.logps(policy, compute) -> (logps, lengths)``: reference log-probs under
  ``torch.no_grad()``: ``compute(model)`` runs the batch through the reference model it is given
  (``SequenceLogpsMixin.sequence_logps``); ``policy`` is the model the Trainer hands ``compute_loss``.
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

import contextlib
import dataclasses
import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

from registries.tokenize import IGNORE_INDEX

from stages.training.per_example_attention import attention_implementation, use_attention
from stages.training.preference_collators import PairwiseCollator

logger = logging.getLogger(__name__)

# "precomputed": the reference's log-probs are columns of the data (stages/training/reference_logps.py).
ReferenceKind = Literal["none", "adapter_disabled", "model", "precomputed"]


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


def unwrap(model):
    """The module under DDP / DeepSpeed wrappers (PEFT wrappers stay: they own disable_adapter)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def disable_dropout(model) -> None:
    """Dropout off, as TRL does for preference training: with it, the policy's and the reference's
    log-probs of the same sequence differ by noise, and the rewards drift without learning."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


@dataclass
class Reference:
    """Where reference log-probs come from (see the module docstring for the three kinds)."""

    kind: ReferenceKind
    model: Any = None  # only for kind "model": a frozen model (a DeepSpeed engine after prepare under ZeRO-3)
    autocast: Any = contextlib.nullcontext  # the Trainer's mixed precision, set by prepare

    def prepare(self, trainer) -> None:
        """Put a separate reference next to the policy: DeepSpeed-wrapped under DeepSpeed (ZeRO-3
        shards it like the policy; other stages keep a full copy per worker), else on the device."""
        if self.kind != "model":
            return
        # The Trainer's mixed precision wraps the policy's forward in autocast (accelerate patches
        # it); a separate reference must compute the same way, or at step 1 the two already differ.
        self.autocast = trainer.accelerator.autocast
        # Padding-free batches need the policy's attention (one example at a time on sdpa) here too.
        use_attention(self.model, attention_implementation(trainer.model))
        if getattr(trainer, "is_deepspeed_enabled", False):
            from trl.models.utils import prepare_deepspeed

            self.model = prepare_deepspeed(self.model, trainer.accelerator)
        else:
            self.model = self.model.to(trainer.args.device)
        self.model.eval()

    def logps(self, policy, compute) -> tuple[torch.Tensor, ...]:
        """Reference (summed log-probs, label counts) for a batch, without gradients: ``compute(model)``
        runs the batch through the model it is given; ``policy`` is the model the Trainer hands ``compute_loss``."""
        if self.kind not in ("model", "adapter_disabled"):
            raise RuntimeError(f"No reference model to run (reference kind {self.kind!r}).")
        with torch.no_grad():
            if self.kind == "model":
                with self.autocast():
                    return compute(self.model)
            # The bare module, not a DDP wrapper: this pass has no backward for DDP to sync.
            with self.disabled_adapter(policy):
                return compute(unwrap(policy))

    @staticmethod
    @contextlib.contextmanager
    def disabled_adapter(policy):
        """The LoRA policy as its base model, for the length of the block."""
        with unwrap(policy).disable_adapter():
            yield


def build_reference(policy, model_args, finetuning_args, tokenizer, training_args=None) -> Reference:
    """The reference policy a stage needs, loaded as cheaply as the setup allows.

    * orpo / simpo (``finetuning_args.use_ref_model`` false): none at all.
    * LoRA without ``ref_model``: the policy with its adapter disabled (LLaMA-Factory's choice):
      the reference is the base model, the adapter's and modules_to_save' starting point. Nothing
      is loaded.
    * otherwise: ``ref_model`` (with ``ref_model_adapters``) if given, else the policy's own
      starting weights loaded again from ``model_name_or_path``: the policy trains in place, so
      its initial weights exist nowhere else. Loading (rather than deep-copying the policy) also
      works under ZeRO-3, whose ``from_pretrained`` shards the weights as they load.
    """
    if not finetuning_args.use_ref_model:
        return Reference("none")
    if finetuning_args.ref_model is None and finetuning_args.finetuning_type == "lora":
        if not hasattr(unwrap(policy), "disable_adapter"):
            raise RuntimeError("A LoRA policy without disable_adapter(); expected a peft PeftModel.")
        return Reference("adapter_disabled")

    from stages.loading import load_model

    adapters = finetuning_args.ref_model_adapters if finetuning_args.ref_model else None
    ref_model_args = dataclasses.replace(
        model_args,
        model_name_or_path=finetuning_args.ref_model or model_args.model_name_or_path,
        adapter_name_or_path=adapters,
    )
    # Only the fields that decide how weights load: the reference never trains.
    ref_tuning = dataclasses.replace(
        finetuning_args, finetuning_type="lora" if adapters else "full", use_rslora=False, use_dora=False
    )
    model = load_model(ref_model_args, ref_tuning, tokenizer, training_args, is_trainable=False)
    model.requires_grad_(False)
    disable_dropout(model)
    logger.info("reference model: %s", ref_model_args.model_name_or_path)
    return Reference("model", model)


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
    "Reference",
    "build_reference",
    "disable_dropout",
    "forward_logps",
    "judge_adapter",
    "pairwise_logps",
    "preference_accuracy",
    "sequence_logps",
    "unwrap",
]
