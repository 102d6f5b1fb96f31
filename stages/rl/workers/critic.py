"""PPO's critic: one data-parallel rank of a value model (a causal LM with a scalar value head).

It estimates, before each completion token, the return still to come; GAE turns those values and
the per-token rewards into advantages, and the critic learns the returns with PPO's clipped value
loss. It starts from the reward model (``critic_init: reward``, OpenRLHF's default: its weights and
value head, so the first values already track the score) or from the policy (``policy``: the
policy's starting weights and a fresh head). A LoRA reward model's critic trains that adapter on
the policy's base (LLaMA-Factory's ``reward_model_type: lora``); a full one trains all weights.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .logprobs import budget_slices, pack_completions
from stages.rl.algorithms.masks import pad_rows, sample_ids, sample_mask
from .trainable import TrainableRole
from stages.rl.config.types import RolloutSample

if TYPE_CHECKING:
    from stages.training.collators import PaddingFreeCollator

    from stages.job import JobSpec

logger = logging.getLogger(__name__)
CRITIC_DIR = "critic"  # the trained critic, inside output_dir (a value model like stage rm's)


def critic_source(spec: "JobSpec") -> str:
    """"reward" or "policy": where the critic's starting weights come from."""
    return spec.rl.critic_init or ("reward" if spec.finetuning.reward_model_folder else "policy")


class CriticWorker(TrainableRole):
    def __init__(self, spec: "JobSpec"):
        self.spec = spec
        self.model = None

    def setup(self, rank: int, world_size: int, total_updates: int) -> dict:
        from stages.training.adapters import count_parameters
        from stages.training.reference import disable_dropout

        torch.manual_seed(self.spec.training.seed)  # the same fresh head / LoRA init on every rank
        model = self._load()
        if torch.cuda.is_available():
            model.to("cuda")
        disable_dropout(model)  # values recomputed in the update must equal those of the rollout
        model.train()
        self._prepare_training(model, rank, world_size, total_updates,
                               learning_rate=self.spec.rl.critic_learning_rate)
        trainable, total = count_parameters(model)
        return {"trainable_params": trainable, "total_params": total, "init": critic_source(self.spec)}

    def _load(self):
        from dataclasses import replace

        from stages.loading import load_model, load_tokenizer_and_template
        from stages.training.value_head import ValueHeadModel, is_adapter_folder

        spec = self.spec
        self.tokenizer, _ = load_tokenizer_and_template(spec.model, spec.data)
        if critic_source(spec) == "policy":
            backbone = load_model(spec.model, spec.finetuning, self.tokenizer, spec.training)
            return ValueHeadModel(backbone)
        folder = spec.finetuning.reward_model
        if is_adapter_folder(folder):  # keep training the reward model's adapter, on the policy's base
            model_args = replace(spec.model, adapter_name_or_path=[folder])
            tuning = replace(spec.finetuning, finetuning_type="lora")
        else:
            model_args = replace(spec.model, model_name_or_path=folder, adapter_name_or_path=None)
            tuning = replace(spec.finetuning, finetuning_type="full")
        model = ValueHeadModel(load_model(model_args, tuning, self.tokenizer, spec.training))
        model.load_value_head(folder)
        return model

    # --- the controller's questions ---------------------------------------------------------------
    def values(self, samples: list[RolloutSample]) -> list[list[float]]:
        """The critic's value before each completion token (no gradient)."""
        with torch.no_grad(), self.forwards(), self._paired_forwards(self._forward_count(samples, sort=False)):
            out = completion_values(self.model, *sample_ids(samples), self.pad_token_id,
                                    max_tokens=self.spec.rl.max_tokens_per_micro_batch, rows=self.rows)
        return [v.tolist() for v in out]

    def update(self, samples: list[RolloutSample], normalizer: float) -> dict:
        """One optimizer step of the clipped value loss on this rank's share of a mini-batch;
        ``normalizer`` is the mini-batch's completion-token count over every rank."""
        return self._optimizer_step(samples, lambda chunk: self._chunk_loss(chunk, normalizer))

    def _chunk_loss(self, chunk: list[RolloutSample], normalizer: float):
        from stages.rl.algorithms.ppo_math import value_loss

        prompts, completions = sample_ids(chunk)
        values = pad_rows(completion_values(self.train_model, prompts, completions, self.pad_token_id,
                                            micro_batch_size=len(chunk), rows=self.rows))
        loss, metrics = value_loss(
            values, pad_rows([torch.tensor(s.values) for s in chunk]), pad_rows([torch.tensor(s.returns) for s in chunk]),
            sample_mask(chunk), clip=self.spec.rl.cliprange_value, normalizer=normalizer,
        )
        return loss, metrics

    def save(self, output_dir: str) -> None:
        """Rank 0 writes the critic into output_dir/critic, loadable like a stage rm output
        (ZeRO-3: every rank is called, and the shards are gathered first)."""
        from .zero import gathered

        with gathered(self.model):
            if self.dp_rank == 0:
                self.model.save(os.path.join(output_dir, CRITIC_DIR))

    def exports_need_all_ranks(self) -> bool:
        """True when saving is a collective (ZeRO-3 over several ranks): call save on every rank."""
        from .zero import is_partitioned

        return self.dp_size > 1 and is_partitioned(self.model)


def completion_values(model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                      pad_token_id: int, micro_batch_size: int = 16, max_tokens: Optional[int] = None,
                      rows: Optional["PaddingFreeCollator"] = None) -> list[torch.Tensor]:
    """One 1-D float32 tensor per completion: the value head's output at the position before each
    completion token (the state the token was chosen in), as the log-probs are aligned.

    ``model`` is a ValueHeadModel, or one wrapped in DDP. Rows are right-padded with an attention
    mask, so real tokens keep positions 0..len-1, or laid out padding-free by ``rows`` (as
    completion_logprobs lays them out; the model must attend as ``rows.attention`` says).
    ``max_tokens``: micro-batches by a token budget instead of ``micro_batch_size`` rows (padded
    tokens, or real ones when padding-free).
    """
    device = next(model.parameters()).device
    results: list[torch.Tensor] = []
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    for part in budget_slices(lengths, micro_batch_size, max_tokens, padded=rows is None):
        prompts, completions = prompt_ids[part], completion_ids[part]
        if rows is not None:
            packed = pack_completions(prompts, completions, rows)
            values = model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                           sequence_ids=packed.sequence_ids.to(device)).values
            results += values.reshape(-1)[packed.before.to(device)].split(packed.counts)
            continue
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
        width = max(len(r) for r in seqs)
        input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, row in enumerate(seqs):
            input_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        values = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).values
        for i, (p, c) in enumerate(zip(prompts, completions)):
            first = len(p) - 1  # the value at token t's predecessor is the state token t was chosen in
            results.append(values[i, first : first + len(c)])
    return results
