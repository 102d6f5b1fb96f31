"""Prompts for generation (ppo rollouts, predict): the model continues ``input_ids``.

``input_ids`` is the whole conversation up to and including the generation prompt (e.g.
``<|im_start|>assistant\\n``); ``labels`` holds the reference response ids when the row has
exactly one response (for scoring predictions) and is empty otherwise. Rows with two responses
(preference data) are used for their prompt only, as LLaMA-Factory does, so a dpo dataset can
feed ppo. Prompt and reference share the length budget through ``infer_seqlen``.

The row's conversation also travels as text, for what acts on it rather than on ids: ``messages``
(JSON of the prompt turns), ``system``, ``tools`` (JSON text, "" when none) and ``columns`` (JSON
of the dataset's unmapped columns, the aligner's ``_extra``). A multi-turn RL environment resets
from them, and reward functions receive the columns as keywords.
"""

from __future__ import annotations

import json
from typing import Any, MutableMapping

from .common import Batch, messages, num_rows, optional_text, row_context
from .seqlen import infer_seqlen


def encode_unsupervised_example(
    tokenizer, template, prompt: list[dict], response: list[dict], system: str, tools: str, cutoff_len: int
) -> tuple[list[int], list[int]]:
    # An empty assistant turn lets the template write the generation prompt after the last turn.
    has_reference = len(response) == 1
    reply = response[0] if has_reference else {"role": "assistant", "content": ""}
    input_ids, labels = template.encode_oneturn(tokenizer, prompt + [reply], system, tools)
    if not has_reference:
        labels = []  # the empty turn's own ids (e.g. "<|im_end|>\n") are no reference
    elif template.efficient_eos:
        labels = labels + [tokenizer.eos_token_id]
    source_len, target_len = infer_seqlen(len(input_ids), len(labels), cutoff_len)
    return input_ids[:source_len], labels[:target_len]


def preprocess_unsupervised(
    batch: Batch, *, tokenizer, template, data_args, stats: MutableMapping[str, int] | None = None
) -> dict[str, list[Any]]:
    """Columns ``input_ids``, ``attention_mask``, ``labels`` (reference ids, maybe empty), and the
    row as text: ``messages``, ``system``, ``tools``, ``columns``."""
    names = ("input_ids", "attention_mask", "labels", "messages", "system", "tools", "columns")
    out: dict[str, list[Any]] = {name: [] for name in names}
    for row in range(num_rows(batch)):
        prompt, response = messages(batch, "_prompt", row), messages(batch, "_response", row)
        system, tools = optional_text(batch, "_system", row), optional_text(batch, "_tools", row)
        with row_context("unsupervised", batch, row):
            input_ids, labels = encode_unsupervised_example(
                tokenizer, template, prompt, response, system, tools, data_args.cutoff_len,
            )
        out["input_ids"].append(input_ids)
        out["attention_mask"].append([1] * len(input_ids))
        out["labels"].append(labels)
        out["messages"].append(json.dumps(prompt, ensure_ascii=False))
        out["system"].append(system)
        out["tools"].append(tools)
        out["columns"].append(optional_text(batch, "_extra", row) or "{}")
    return out
