"""Preference pairs (rm, dpo and its variants): one prompt, a chosen and a rejected response.

Both sequences share the same prompt ids, cut the same way, so the two differ only in the
response. The length budget treats the longer response as "the" response: ``infer_seqlen``
then favours the responses over the prompt, and both responses are cut to the same length.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from .common import IGNORE_INDEX, Batch, SkipCounter, messages, num_rows, optional_text, row_context
from .seqlen import infer_seqlen

NOT_A_PAIR = (
    "not exactly two responses (preference data needs `ranking: true` and chosen/rejected "
    "columns in dataset_info.json)"
)
COLUMNS = (
    "chosen_input_ids", "chosen_attention_mask", "chosen_labels",
    "rejected_input_ids", "rejected_attention_mask", "rejected_labels",
)


def encode_pairwise_example(
    tokenizer, template, prompt: list[dict], chosen: dict, rejected: dict, system: str, tools: str,
    cutoff_len: int,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels)."""
    prompt_ids, chosen_ids = template.encode_oneturn(tokenizer, prompt + [chosen], system, tools)
    _, rejected_ids = template.encode_oneturn(tokenizer, prompt + [rejected], system, tools)
    if template.efficient_eos:
        chosen_ids = chosen_ids + [tokenizer.eos_token_id]
        rejected_ids = rejected_ids + [tokenizer.eos_token_id]

    source_len, target_len = infer_seqlen(len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), cutoff_len)
    prompt_ids = prompt_ids[:source_len]
    chosen_ids, rejected_ids = chosen_ids[:target_len], rejected_ids[:target_len]
    prompt_labels = [IGNORE_INDEX] * source_len
    return (
        prompt_ids + chosen_ids, prompt_labels + chosen_ids,
        prompt_ids + rejected_ids, prompt_labels + rejected_ids,
    )


def preprocess_pairwise(
    batch: Batch, *, tokenizer, template, data_args, stats: MutableMapping[str, int] | None = None
) -> dict[str, list[Any]]:
    """Columns: chosen_/rejected_ ``input_ids``, ``attention_mask``, ``labels``."""
    out: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    skips = SkipCounter("pairwise")
    for row in range(num_rows(batch)):
        responses = messages(batch, "_response", row)
        if len(responses) != 2:
            skips.skip(batch, row, "not_a_pair", NOT_A_PAIR)
            continue
        with row_context("pairwise", batch, row):
            chosen_ids, chosen_labels, rejected_ids, rejected_labels = encode_pairwise_example(
                tokenizer, template, messages(batch, "_prompt", row), responses[0], responses[1],
                optional_text(batch, "_system", row), optional_text(batch, "_tools", row),
                data_args.cutoff_len,
            )
        out["chosen_input_ids"].append(chosen_ids)
        out["chosen_attention_mask"].append([1] * len(chosen_ids))
        out["chosen_labels"].append(chosen_labels)
        out["rejected_input_ids"].append(rejected_ids)
        out["rejected_attention_mask"].append([1] * len(rejected_ids))
        out["rejected_labels"].append(rejected_labels)
    skips.report(num_rows(batch), stats)
    return out
