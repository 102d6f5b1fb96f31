"""The policy role: one data-parallel rank of the model being trained by an RL stage.

A plain class: fabric/ runs one per policy bundle as a Ray actor, after joining the ranks in a
torch.distributed group. It owns the model (full, freeze or LoRA, as the finetuning options say),
the frozen reference when the KL term needs one (for LoRA: the same model with its adapter off,
no second copy), the optimizer and the schedule, and answers the controller's questions:
log-probs, reference log-probs, one update, the weights for the rollout engines, and HF
generation as the fallback rollout backend.

No HF Trainer here: an RL step is a custom loss over samples the controller hands in, and the
optimizer, schedule and gradient clipping follow the same trainer options (learning_rate,
weight_decay, adam_*, max_grad_norm, lr_scheduler_type, warmup_steps).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Optional

import torch

from .types import Completion, RolloutSample, SamplingSpec

if TYPE_CHECKING:
    from ..job import JobSpec

logger = logging.getLogger(__name__)


class PolicyWorker:
    def __init__(self, spec: "JobSpec"):
        self.spec = spec
        self.dp_rank, self.dp_size = 0, 1  # data-parallel rank and size, set by setup()
        self.model = None  # the (maybe PEFT) model; self.train_model wraps it in DDP when world_size > 1

    # --- set-up --------------------------------------------------------------------------------
    def setup(self, rank: int, world_size: int, total_updates: int) -> dict:
        """Load tokenizer, model, reference; build optimizer and schedule. Called once per rank
        after the process group exists. Returns parameter counts for the run's plan."""
        from transformers import get_scheduler

        from ..adapters import count_parameters
        from ..loading import load_model, load_tokenizer_and_template
        from ..preference import Reference, build_reference, disable_dropout

        self.dp_rank, self.dp_size = rank, world_size
        spec, options = self.spec, self.spec.training
        torch.manual_seed(options.seed)  # the same LoRA initialisation on every rank
        self.tokenizer, self.template = load_tokenizer_and_template(spec.model, spec.data)
        self.model = load_model(spec.model, spec.finetuning, self.tokenizer, options)
        if torch.cuda.is_available():  # Ray gives a GPU actor its own device(s) only: cuda:0 is ours
            self.model.to("cuda")
        # Dropout would make the recomputed log-probs differ from the sampler's and from the
        # reference's for the same tokens: RL recipes (TRL, OpenRLHF) turn it off.
        disable_dropout(self.model)
        if options.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.reference = (
            build_reference(self.model, spec.model, spec.finetuning, self.tokenizer, options)
            if spec.rl.beta > 0 else Reference("none")
        )
        if self.reference.kind == "model":
            self.reference.model.to(next(self.model.parameters()).device).eval()
        self.model.train()
        self.train_model = self.model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # Every trainable parameter is in the loss, so DDP need not search for unused ones.
            self.train_model = DistributedDataParallel(self.model, find_unused_parameters=False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=options.learning_rate, betas=(options.adam_beta1, options.adam_beta2),
            eps=options.adam_epsilon, weight_decay=options.weight_decay,
        )
        warmup = options.warmup_steps
        warmup = int(warmup * total_updates) if 0 < warmup < 1 else int(warmup)  # a ratio, as in transformers 5
        self.scheduler = get_scheduler(
            options.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=total_updates,
            scheduler_specific_kwargs=_scheduler_kwargs(options.lr_scheduler_kwargs),
        )
        trainable, total = count_parameters(self.model)
        return {"trainable_params": trainable, "total_params": total, "reference": self.reference.kind}

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    # --- the controller's questions ---------------------------------------------------------------
    def logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The current policy's log-prob of every completion token (the "old" policy of an update)."""
        from .logprobs import completion_logprobs

        with torch.no_grad():
            out = completion_logprobs(self.model, *_ids(samples), self.pad_token_id,
                                      temperature=self.spec.generating.temperature)
        return [t.tolist() for t in out]

    def reference_logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The frozen reference's log-probs (the same temperature scaling as the policy's)."""
        from .logprobs import completion_logprobs

        temperature = self.spec.generating.temperature
        with torch.no_grad():
            if self.reference.kind == "model":
                out = completion_logprobs(self.reference.model, *_ids(samples), self.pad_token_id, temperature=temperature)
            elif self.reference.kind == "adapter_disabled":
                with self.model.disable_adapter():
                    out = completion_logprobs(self.model, *_ids(samples), self.pad_token_id, temperature=temperature)
            else:
                raise RuntimeError("reference log-probs asked for, but beta is 0: no reference model was loaded")
        return [t.tolist() for t in out]

    def update(self, samples: list[RolloutSample], normalizer: float) -> dict:
        """One optimizer step on this rank's share of the step's samples.

        ``normalizer`` is the whole step's (every rank's) loss denominator: each micro-batch's loss
        is its part of the full batch's loss, so the summed gradient (with DDP's mean over ranks
        undone by ``world_size``) equals one big batch's.
        """
        options = self.spec.training
        micro = max(1, int(options.per_device_train_batch_size))
        chunks = [samples[i : i + micro] for i in range(0, len(samples), micro)]
        totals: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            # DDP syncs gradients on the last micro-batch only; no_sync must cover its forward too.
            sync = self.train_model.no_sync() if (self.dp_size > 1 and not last) else contextlib.nullcontext()
            with sync:
                loss, metrics = self._chunk_loss(chunk, normalizer)
                (loss * self.dp_size).backward()  # DDP averages over ranks; the loss is already a global share
            weight = len(chunk)
            metrics.pop("num_tokens", None)  # a per-micro-batch count: meaningless once merged
            for key, value in {"loss": loss.item() * self.dp_size, **metrics}.items():
                totals[key] = totals.get(key, 0.0) + value * (1 if key == "loss" else weight)
        grad_norm = None
        if options.max_grad_norm and options.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), options.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        out = {key: (value if key == "loss" else value / max(len(samples), 1)) for key, value in totals.items()}
        out.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], num_samples=len(samples))
        return out

    def _chunk_loss(self, chunk: list[RolloutSample], normalizer: float):
        from .algorithms import policy_loss
        from .logprobs import completion_logprobs

        rl = self.spec.rl
        prompts, completions = _ids(chunk)
        # One forward per micro-batch: DDP pairs each forward with the backward that follows it.
        logp = _pad(completion_logprobs(self.train_model, prompts, completions, self.pad_token_id,
                                        temperature=self.spec.generating.temperature, micro_batch_size=len(chunk)))
        mask = _pad([torch.ones(len(c)) for c in completions])
        # One update per rollout (num_iterations 1): the old policy is the current one, ratio 1.
        old = _pad([torch.tensor(s.old_logprobs) for s in chunk]) if chunk[0].old_logprobs else logp.detach()
        ref = _pad([torch.tensor(s.ref_logprobs) for s in chunk]) if rl.beta > 0 else None
        advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
        return policy_loss(
            logp, old, advantages, mask,
            epsilon_low=rl.epsilon, epsilon_high=rl.epsilon_high, loss_type=rl.loss_type,
            max_completion_length=rl.max_completion_length, ref_logp=ref, beta=rl.beta,
            kl_estimator=rl.kl_estimator, normalizer=normalizer,
        )

    def export_weights(self) -> bytes:
        """The full weights, HF-named (a LoRA adapter merged in), as safetensors bytes for the engines."""
        from .weights import export_state_dict, state_dict_to_bytes

        return state_dict_to_bytes(export_state_dict(self.model))

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """The HF rollout backend: sample from the weights being trained."""
        from .hf_rollout import hf_generate

        return hf_generate(self.model, prompt_ids, sampling, self.pad_token_id)

    def save(self, output_dir: str) -> Optional[str]:
        """Rank 0 writes the adapter or model and the tokenizer with the training chat template."""
        if self.dp_rank != 0:
            return None
        from registries.templates.jinja import to_jinja

        self.model.save_pretrained(output_dir)
        self.tokenizer.chat_template = to_jinja(self.template, self.tokenizer)  # serving formats prompts as training did
        self.tokenizer.save_pretrained(output_dir)
        return output_dir


def _scheduler_kwargs(value) -> Optional[dict]:
    """lr_scheduler_kwargs as transformers takes it: a dict, or its JSON text."""
    if isinstance(value, str):
        import json

        value = json.loads(value) if value.strip() else None
    return value or None


def _ids(samples: list[RolloutSample]) -> tuple[list[list[int]], list[list[int]]]:
    return [s.prompt_ids for s in samples], [s.completion_ids for s in samples]


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([r.float() for r in rows], batch_first=True)
