"""KTO feedback: one response per prompt, tagged desirable (True) or undesirable (False).

KTO also needs a KL reference term: the same prompt paired with a response written for a
*different* prompt. Within a batch, row i borrows the response of the usable row before it
(the first row borrows the last one's). That is LLaMA-Factory's current rule; its older rule,
reversing the batch, paired the middle row of an odd-sized batch with its own response.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from .common import (
    IGNORE_INDEX, Batch, SkipCounter, kto_tag, logger, messages, num_rows, optional_text, row_context, where,
)
from .seqlen import infer_seqlen
from .vision import has_image_column, row_image_paths

NOT_ONE_RESPONSE = "not exactly one response (KTO rows have one response plus a kto_tag)"
NO_TAG = "kto_tag is empty (set it to true or false)"
COLUMNS = ("input_ids", "attention_mask", "labels", "kl_input_ids", "kl_attention_mask", "kl_labels", "kto_tags")


def encode_feedback_example(
    tokenizer, template, prompt: list[dict], response: dict, system: str, tools: str, cutoff_len: int
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for the prompt followed by one response, truncated by infer_seqlen."""
    prompt_ids, response_ids = template.encode_oneturn(tokenizer, prompt + [response], system, tools)
    if template.efficient_eos:
        response_ids = response_ids + [tokenizer.eos_token_id]
    source_len, target_len = infer_seqlen(len(prompt_ids), len(response_ids), cutoff_len)
    response_ids = response_ids[:target_len]
    return prompt_ids[:source_len] + response_ids, [IGNORE_INDEX] * source_len + response_ids


def preprocess_feedback(
    batch: Batch, *, tokenizer, template, data_args, stats: MutableMapping[str, int] | None = None
) -> dict[str, list[Any]]:
    """Columns ``input_ids, attention_mask, labels, kl_input_ids, kl_attention_mask, kl_labels,
    kto_tags``."""
    if "_kto_tag" not in batch or all(tag is None for tag in batch["_kto_tag"]):
        raise ValueError(
            "Stage 'kto' needs a desirable/undesirable tag per row, but this dataset has none. "
            "Add a boolean column and name it in dataset_info.json under "
            '"columns": {"kto_tag": "<column>"}, or train with stage=sft or stage=dpo instead.'
        )

    if has_image_column(batch):
        pictured = [row for row in range(num_rows(batch)) if row_image_paths(batch, row)]
        if pictured:
            raise ValueError(
                f"Stage 'kto' does not read images yet, but {where(batch, pictured[0])} has some "
                f"({len(pictured)} row(s) of this batch do). Train vision-language models with stage sft or dpo "
                "(a ranking dataset with an images column), or use a kto dataset without images."
            )
    skips = SkipCounter("kto")
    usable: list[tuple[int, list[dict], dict, bool]] = []  # (row, prompt, response, tag)
    for row in range(num_rows(batch)):
        response = messages(batch, "_response", row)
        tag = kto_tag(batch, row)
        if len(response) != 1:
            skips.skip(batch, row, "not_one_response", NOT_ONE_RESPONSE)
        elif tag is None:
            skips.skip(batch, row, "no_kto_tag", NO_TAG)
        else:
            usable.append((row, messages(batch, "_prompt", row), response[0], tag))
    skips.report(num_rows(batch), stats)

    out: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    if len(usable) == 1:
        logger.warning("kto: a batch with one usable row pairs it with its own response for the KL term; "
                       "use larger batches so the KL term sees mismatched pairs.")
    for position, (row, prompt, response, tag) in enumerate(usable):
        kl_response = _mismatched_response(usable, position)
        system, tools = optional_text(batch, "_system", row), optional_text(batch, "_tools", row)
        with row_context("kto", batch, row):
            input_ids, labels = encode_feedback_example(
                tokenizer, template, prompt, response, system, tools, data_args.cutoff_len
            )
            kl_input_ids, kl_labels = encode_feedback_example(
                tokenizer, template, prompt, kl_response, system, tools, data_args.cutoff_len
            )
        out["input_ids"].append(input_ids)
        out["attention_mask"].append([1] * len(input_ids))
        out["labels"].append(labels)
        out["kl_input_ids"].append(kl_input_ids)
        out["kl_attention_mask"].append([1] * len(kl_input_ids))
        out["kl_labels"].append(kl_labels)
        out["kto_tags"].append(tag)

    desirable = sum(out["kto_tags"])
    if out["kto_tags"] and desirable in (0, len(out["kto_tags"])):
        kind = "desirable" if desirable else "undesirable"
        logger.warning("kto: every row in this batch is %s; KTO learns from both kinds, so check the "
                       "kto_tag column (or shuffle the dataset).", kind)
        if stats is not None:
            stats["single_tag_batches"] = stats.get("single_tag_batches", 0) + 1
    return out


def _mismatched_response(usable: list, position: int) -> dict:
    """The response of the nearest earlier row (wrapping around) asked a different prompt.

    KTO data often lists a prompt's good and bad answer next to each other; the plain previous
    row would then pair a prompt with its own answer and the KL estimate would not be of a
    mismatched pair. With a single prompt in the batch the previous row is the only choice."""
    prompt = usable[position][1]
    for step in range(1, len(usable)):
        candidate = usable[position - step]
        if candidate[1] != prompt:
            return candidate[2]
    return usable[position - 1][2]

