"""The frozen reference policy a stage compares its policy with: the preference stages (dpo and its
variants, kto; stages/recipes/preference.py) and the RL policy worker (stages/rl/workers/policy.py).

* ``Reference.kind``: ``"none"`` (orpo/simpo, or RL with beta 0: no reference at all),
  ``"adapter_disabled"`` (LoRA: the policy itself with its adapter switched off, so no second copy
  of the weights), ``"model"`` (full/freeze training, or an explicit ``ref_model``: a separate frozen
  model) or ``"precomputed"`` (its log-probs are columns of the data: stages/training/reference_logps.py).
* ``Reference.prepare(trainer)``: once the Trainer exists, put a separate reference model on the
  training device (wrapped by DeepSpeed for ZeRO-3, which shards it like the policy).
* ``Reference.logps(policy, compute) -> (logps, lengths)``: reference log-probs under
  ``torch.no_grad()``: ``compute(model)`` runs the batch through the reference model it is given
  (``SequenceLogpsMixin.sequence_logps``); ``policy`` is the model the Trainer hands ``compute_loss``.
* ``disable_dropout(model)``: what policy and reference both need for their log-probs to agree.

Loading the reference (``build_reference``) is stages/loading.py's, next to the policy's own loading.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch

from stages.training.per_example_attention import attention_implementation, use_attention

# "precomputed": the reference's log-probs are columns of the data (stages/training/reference_logps.py).
ReferenceKind = Literal["none", "adapter_disabled", "model", "precomputed"]


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
