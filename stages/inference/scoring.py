"""Scoring replies with a reward model saved by stage rm (what a server's /v1/score answers).

A conversation is tokenized exactly as stage rm tokenized its chosen responses (the pairwise
encoder, the training template, ``cutoff_len``), so a reply gets the score the reward model
learned to give it; the value head reads the last real token of each right-padded row.
"""

from __future__ import annotations

import os

from registries.errors import UserError
from registries.tokenize.pairwise import encode_pairwise_example

from stages.training.collators import PaddingCollator
from ..loading import load_reward_model, resolve_model_path
from stages.training.value_head import VALUE_HEAD_FILE, score
from .chat_model import ChatInputError
from .loading import InferenceSpec, load_tokenizer_and_template

BATCH_SIZE = 16  # rows per forward pass


def is_reward_output(folder: str) -> bool:
    """True for a folder saved by stage rm (or exported from one): it carries the value head."""
    return os.path.isfile(os.path.join(folder, VALUE_HEAD_FILE))


class RewardScorer:
    def __init__(self, spec: InferenceSpec):
        folder = spec.output_folder
        if not is_reward_output(folder):
            raise UserError(
                f"{folder} holds no {VALUE_HEAD_FILE}, so it is not a reward model: scoring needs the output_dir "
                "of a stage rm run (or its export) as adapter_name_or_path (LoRA) or model_name_or_path (full)."
            )
        if len(spec.adapters) > 1:
            raise UserError(
                f"adapter_name_or_path names {len(spec.adapters)} adapters, but a reward model is scored from one "
                "folder. Merge the earlier adapters into the base with `rayfactory export` and name only the rm "
                "adapter, on the exported model."
            )
        # The training tokenizer and template (as chat uses them) encode the replies.
        self.tokenizer, self.template = load_tokenizer_and_template(spec)
        self.cutoff_len = spec.data.cutoff_len
        self.model, _ = load_reward_model(
            folder, base_model=resolve_model_path(spec.model.model_name_or_path), template=self.template.name
        )
        self.collator = PaddingCollator(pad_token_id=self.tokenizer.pad_token_id)

    def encode(self, conversation: list[dict], system: str | None = None, tools: str | None = None) -> list[int]:
        """Token ids of a conversation that ends with the assistant reply to score."""
        if not isinstance(conversation, list) or not conversation or not isinstance(conversation[-1], dict):
            raise ChatInputError("each conversation must be a non-empty list of {role, content} turns.")
        if conversation[-1].get("role") != "assistant":
            raise ChatInputError(
                f"a scored conversation must end with the assistant reply to score; this one ends with a "
                f"{conversation[-1].get('role')!r} turn."
            )
        prompt, reply = list(conversation[:-1]), conversation[-1]
        try:
            # The pair encoder with the reply as both responses: the chosen ids stage rm scored.
            ids, *_ = encode_pairwise_example(
                self.tokenizer, self.template, prompt, reply, reply, system or "", tools or "", self.cutoff_len
            )
        except ValueError as exc:  # the template's checks: roles out of order, bad tool JSON
            raise ChatInputError(str(exc)) from None
        return ids

    def score(
        self, conversations: list[list[dict]], system: str | None = None, tools: str | None = None
    ) -> list[float]:
        """One reward per conversation, in order. A reply is cut to ``cutoff_len`` on its own; stage
        rm cut a pair to one budget, so a pair's shorter reply may have been cut shorter there."""
        rows = [self.encode(c, system, tools) for c in conversations]
        rewards: list[float] = []
        for start in range(0, len(rows), BATCH_SIZE):
            chunk = rows[start : start + BATCH_SIZE]
            batch = self.collator.collate_columns({"input_ids": chunk, "attention_mask": [[1] * len(r) for r in chunk]})
            rewards += score(self.model, batch["input_ids"], batch["attention_mask"]).tolist()
        return rewards
