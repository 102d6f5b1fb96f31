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

import logging
from typing import TYPE_CHECKING, Optional

import torch

from stages.rl.algorithms.masks import pad_rows, sample_ids, sample_mask
from .trainable import TrainableRole
from stages.engines.types import Completion, SamplingSpec
from stages.rl.config.types import RolloutSample

if TYPE_CHECKING:
    from stages.job import JobSpec

logger = logging.getLogger(__name__)


class PolicyWorker(TrainableRole):
    def __init__(self, spec: "JobSpec"):
        self.spec = spec
        self.model = None  # the (maybe PEFT) model; self.train_model wraps it in DDP when world_size > 1
        # beta * KL in the loss, or (the stage table's kl_in_loss false) already in the rewards.
        self.kl_loss_coef = spec.rl.beta if spec.stage.rl.kl_in_loss else 0.0

    # --- set-up --------------------------------------------------------------------------------
    def setup(self, rank: int, world_size: int, total_updates: int) -> dict:
        """Load tokenizer, model, reference; build optimizer and schedule. Called once per rank
        after the process group exists. Returns parameter counts for the run's plan."""
        from stages.training.adapters import count_parameters
        from stages.loading import build_reference, load_model, load_tokenizer_and_template
        from stages.training.reference import Reference, disable_dropout

        spec, options = self.spec, self.spec.training
        torch.manual_seed(options.seed)  # the same LoRA initialisation on every rank
        self.tokenizer, self.template = load_tokenizer_and_template(spec.model, spec.data)
        model = load_model(spec.model, spec.finetuning, self.tokenizer, options)
        if torch.cuda.is_available():  # Ray gives a GPU actor its own device(s) only: cuda:0 is ours
            model.to("cuda")
        # Dropout would make the recomputed log-probs differ from the sampler's and from the
        # reference's for the same tokens: RL recipes (TRL, OpenRLHF) turn it off.
        disable_dropout(model)
        if options.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.reference = (
            build_reference(model, spec.model, spec.finetuning, self.tokenizer, options)
            if spec.rl.beta > 0 else Reference("none")
        )
        if self.reference.kind == "model":
            self.reference.model.to(next(model.parameters()).device).eval()
        model.train()
        self._prepare_training(model, rank, world_size, total_updates)
        trainable, total = count_parameters(model)
        return {"trainable_params": trainable, "total_params": total, "reference": self.reference.kind}

    # --- the controller's questions ---------------------------------------------------------------
    def logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The current policy's log-prob of every completion token (the "old" policy of an update)."""
        from .logprobs import completion_logprobs

        with torch.no_grad(), self.forwards(), self._paired_forwards(self._forward_count(samples)):
            out = completion_logprobs(self.model, *sample_ids(samples), self.pad_token_id, **self._logprob_options())
        return [t.tolist() for t in out]

    def reference_logprobs(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The frozen reference's log-probs (the same temperature scaling and layout as the policy's)."""
        from .logprobs import completion_logprobs

        options = self._logprob_options()
        with torch.no_grad():
            if self.reference.kind == "model":
                with self.forwards(self.reference.model):
                    out = completion_logprobs(self.reference.model, *sample_ids(samples), self.pad_token_id, **options)
            elif self.reference.kind == "adapter_disabled":
                # ZeRO-3: the idle forwards too with the adapter off, gathering what the real ones gather
                with self.model.disable_adapter(), self.forwards(), self._paired_forwards(self._forward_count(samples)):
                    out = completion_logprobs(self.model, *sample_ids(samples), self.pad_token_id, **options)
            else:
                raise RuntimeError("reference log-probs asked for, but beta is 0: no reference model was loaded")
        return [t.tolist() for t in out]

    def _logprob_options(self) -> dict:
        """completion_logprobs' options for the no-grad passes: sampling temperature, micro-batch budget, layout."""
        return dict(temperature=self.spec.generating.temperature, max_tokens=self.spec.rl.max_tokens_per_micro_batch,
                    rows=self.rows)

    def update(self, samples: list[RolloutSample], normalizer: float) -> dict:
        """One optimizer step on this rank's share of the step's samples; ``normalizer`` is the
        whole step's (every rank's) loss denominator (grpo_math.loss_normalizer).

        When the samples carry no old log-probs (one update per rollout: the policy that sampled
        is the one being updated) and the sampler ran at temperature 1, the update's own forward
        is the weight-sync check (rollout_logprob_diff): the log-probs it computes before the
        optimizer step are what a separate no-grad pass would give (dropout aside), so that pass,
        a quarter of a GRPO step on CPU, is not run."""
        self._sampled_policy_logprobs: list[list[float]] = []
        metrics = self._optimizer_step(samples, lambda chunk: self._chunk_loss(chunk, normalizer))
        if self._sampled_policy_logprobs and self.spec.generating.temperature == 1.0:
            from stages.rl.algorithms.rollout_correction import rollout_logprob_gap

            metrics.update(rollout_logprob_gap(samples, self._sampled_policy_logprobs))
        if self._correction is not None:  # the pre-update log-probs: this update's own, or the given old ones
            metrics.update(self._correction.sample_metrics(
                samples, self._sampled_policy_logprobs or [s.old_logprobs for s in samples]))
        return metrics

    @property
    def _correction(self):
        from stages.rl.algorithms.rollout_correction import RolloutCorrection

        return RolloutCorrection.from_args(self.spec.rl)

    def _chunk_loss(self, chunk: list[RolloutSample], normalizer: float):
        from stages.rl.algorithms.registry import loss_options
        from stages.rl.algorithms.grpo_math import policy_loss
        from .logprobs import completion_logprobs

        rl = self.spec.rl
        prompts, completions = sample_ids(chunk)
        # One forward per micro-batch: DDP pairs each forward with the backward that follows it. The
        # entropy comes from the same logits, only when the bonus needs it (it costs a softmax pass).
        out = completion_logprobs(self.train_model, prompts, completions, self.pad_token_id,
                                  temperature=self.spec.generating.temperature, micro_batch_size=len(chunk),
                                  with_entropy=rl.entropy_coef > 0, rows=self.rows)
        logp, entropy = (pad_rows(out[0]), pad_rows(out[1])) if rl.entropy_coef > 0 else (pad_rows(out), None)
        mask = sample_mask(chunk)  # observation tokens of multi-turn samples are out of loss and KL
        # One update per rollout (num_iterations 1): the old policy is the current one, ratio 1.
        if chunk[0].old_logprobs:
            old = pad_rows([torch.tensor(s.old_logprobs) for s in chunk])
        else:
            old = logp.detach()
            self._sampled_policy_logprobs += [row[: len(s.completion_ids)].tolist() for row, s in zip(old, chunk)]
        # Rollout correction: the sampler's log-probs against the pre-update ones (old), as TRL does.
        weights = self._correction.sample_weights(chunk, old, mask) if self._correction is not None else None
        ref = pad_rows([torch.tensor(s.ref_logprobs) for s in chunk]) if self.kl_loss_coef > 0 else None
        if any(s.token_advantages for s in chunk):  # GAE, REINFORCE++: one advantage per token
            advantages = pad_rows([torch.tensor(s.token_advantages) for s in chunk])
        else:
            advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
        return policy_loss(
            logp, old, advantages, mask,
            epsilon_low=rl.epsilon, epsilon_high=rl.epsilon_high, loss_type=rl.loss_type,
            max_completion_length=rl.max_completion_length, ref_logp=ref, beta=self.kl_loss_coef,
            kl_estimator=rl.kl_estimator, normalizer=normalizer,
            importance_sampling_level=rl.importance_sampling_level, entropy=entropy, entropy_coef=rl.entropy_coef,
            rollout_weights=weights, loss_options=loss_options(rl),
        )

    def export_weights(self) -> Optional[bytes]:
        """The full weights, HF-named (a LoRA adapter merged in), as safetensors bytes for the engines.
        Under ZeRO-3 with several ranks every rank is called (the shards' gather is collective) and
        rank 0's answer is the export; the others answer None."""
        from .weights import export_state_dict, state_dict_to_bytes
        from .zero import gathered

        with gathered(self.model):
            return state_dict_to_bytes(export_state_dict(self.model)) if self.dp_rank == 0 else None

    def export_adapter(self) -> Optional[bytes]:
        """The LoRA adapter alone (adapter-only weight sync), as one safetensors blob (ZeRO-3: as
        ``export_weights``)."""
        from .weights import export_adapter
        from .zero import gathered

        with gathered(self.model):
            return export_adapter(self.model) if self.dp_rank == 0 else None

    def exports_need_all_ranks(self) -> bool:
        """True when reading the whole model is a collective (ZeRO-3 over several ranks): exports
        and the final save must then be called on every rank, not rank 0 alone."""
        from .zero import is_partitioned

        return self.dp_size > 1 and is_partitioned(self.model)

    def generate_batch(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        """The HF rollout backend: the transformers engine samples from the weights being trained."""
        from stages.engines.hf_backend import HFEngine

        return HFEngine(self.model, self.pad_token_id).generate_batch(prompt_ids, sampling)

    def save(self, output_dir: str) -> Optional[str]:
        """Rank 0 writes the adapter or model and the tokenizer with the training chat template
        (ZeRO-3: every rank is called, and the shards are gathered first)."""
        from .zero import gathered

        with gathered(self.model):
            if self.dp_rank != 0:
                return None
            self.model.save_pretrained(output_dir)
        from registries.templates.jinja import to_jinja

        self.tokenizer.chat_template = to_jinja(self.template, self.tokenizer)  # serving formats prompts as training did
        self.tokenizer.save_pretrained(output_dir)
        return output_dir
