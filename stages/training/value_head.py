"""A causal LM with a scalar value head: the reward model of stage rm (and what PPO scores with).

The head is one ``Linear(hidden_size, 1)`` on the last layer's hidden states; a sequence's score
is the value at its last real (non-padding) token. On disk a reward model is the causal LM as
any stage saves it (LoRA adapter or full weights, tokenizer, chat template) plus
``value_head.safetensors``, so ``load_reward_model(output_dir)`` (stages/loading.py) rebuilds
exactly what trained.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"
PREFIX = "v_head."  # the head's keys inside ValueHeadModel.state_dict()
BACKBONE_PREFIX = "pretrained_model."


@dataclass
class ValueHeadOutput:
    values: torch.Tensor  # (B, L): the head's output at every position
    rewards: torch.Tensor  # (B,): the value at each row's last real token


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row: right or left padding alike (argmax returns the first
    position where the running count reaches its maximum, which is the last real token)."""
    return attention_mask.long().cumsum(-1).argmax(-1)


def last_token_of_each(sequence_ids: torch.Tensor) -> torch.Tensor:
    """Flat index of each sequence's last token in padding-free rows (-1 marks pads)."""
    owners = sequence_ids.reshape(-1)
    real = (owners >= 0).nonzero().squeeze(1)
    count = int(owners.max()) + 1
    last = torch.full((count,), -1, dtype=torch.long, device=owners.device)
    return last.scatter_reduce(0, owners.index_select(0, real), real, reduce="amax")


class ValueHeadModel(nn.Module):
    """``pretrained_model`` (a causal LM, or a PeftModel around one) + ``v_head``."""

    def __init__(self, pretrained_model: nn.Module):
        super().__init__()
        self.pretrained_model = pretrained_model
        config = getattr(pretrained_model.config, "text_config", None) or pretrained_model.config
        dtype = next(pretrained_model.parameters()).dtype
        # float32 unless the model trains in bf16/fp16 (quantized weights report uint8: use float32)
        dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        self.v_head = nn.Linear(config.hidden_size, 1, dtype=dtype)
        # Trainer introspection (use_cache toggles, model cards) reads config from the model it trains.
        self.config = pretrained_model.config
        base = pretrained_model.get_base_model() if hasattr(pretrained_model, "get_base_model") else pretrained_model
        # Only the hidden states are needed: models that can skip the (B, L, vocab) logits do.
        skips_logits = "logits_to_keep" in inspect.signature(base.forward).parameters
        self._lm_kwargs = {"logits_to_keep": 1} if skips_logits else {}

    def forward(self, input_ids, attention_mask=None, position_ids=None, sequence_ids=None, **kwargs) -> ValueHeadOutput:
        """Padded rows (``attention_mask``), or padding-free ones (stages/training/preference_collators.py:
        ``position_ids`` restarting per sequence, ``sequence_ids`` naming each token's): then
        ``rewards`` has one value per sequence, in sequence order."""
        if attention_mask is None and sequence_ids is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.pretrained_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            use_cache=False,
            **self._lm_kwargs,
        )
        hidden = out.hidden_states[-1]
        values = self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1).float()
        if sequence_ids is not None:
            return ValueHeadOutput(values, values.reshape(-1)[last_token_of_each(sequence_ids)])
        rows = torch.arange(values.shape[0], device=values.device)
        return ValueHeadOutput(values, values[rows, last_token_index(attention_mask)])

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.pretrained_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    # --------------------------------------------------------------- saving and loading

    def save(self, output_dir: str, state_dict: dict | None = None) -> None:
        """The causal LM (adapter or full weights) the usual way + ``value_head.safetensors``.

        ``state_dict`` is the whole wrapper's (the Trainer passes one gathered under ZeRO-3)."""
        from safetensors.torch import save_file

        if state_dict is None:
            state_dict = self.state_dict()
        backbone = {k[len(BACKBONE_PREFIX):]: v for k, v in state_dict.items() if k.startswith(BACKBONE_PREFIX)}
        head = {k[len(PREFIX):]: v.detach().cpu().contiguous() for k, v in state_dict.items() if k.startswith(PREFIX)}
        os.makedirs(output_dir, exist_ok=True)
        self.pretrained_model.save_pretrained(output_dir, state_dict=backbone)
        save_file(head, os.path.join(output_dir, VALUE_HEAD_FILE), metadata={"format": "pt"})

    def load_value_head(self, folder: str) -> None:
        from safetensors.torch import load_file

        path = os.path.join(folder, VALUE_HEAD_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{folder} holds no {VALUE_HEAD_FILE}, so it is not a reward model saved by stage rm. "
                "Point at the output_dir (or a checkpoint) of an rm run."
            )
        self.v_head.load_state_dict(load_file(path, device=str(self.v_head.weight.device)))


def is_adapter_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "adapter_config.json"))


@torch.no_grad()
def score(model: ValueHeadModel, input_ids, attention_mask=None) -> torch.Tensor:
    """(B,) rewards of a batch of token ids."""
    device = model.v_head.weight.device
    input_ids = torch.as_tensor(input_ids, device=device)
    attention_mask = None if attention_mask is None else torch.as_tensor(attention_mask, device=device)
    return model(input_ids, attention_mask).rewards.cpu()


def score_pairs(model: ValueHeadModel, pairs, pad_token_id: int, batch_size: int = 32):
    """(chosen, rejected) rewards of tokenized pairs (rows with chosen_*/rejected_* columns)."""
    from stages.training.preference_collators import PairwiseCollator

    collator = PairwiseCollator(pad_token_id=pad_token_id)
    rows = [pairs[i] for i in range(len(pairs))]
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        for start in range(0, len(rows), batch_size):
            batch = collator(rows[start : start + batch_size])
            c, r = score(model, batch["input_ids"], batch["attention_mask"]).chunk(2)
            chosen.append(c)
            rejected.append(r)
    finally:
        model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def reward_accuracy(model: ValueHeadModel, pairs, pad_token_id: int) -> float:
    """Fraction of pairs whose chosen response the reward model scores strictly higher."""
    chosen, rejected = score_pairs(model, pairs, pad_token_id)
    return float((chosen > rejected).float().mean())
