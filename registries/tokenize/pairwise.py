"""Preference pairs (rm, dpo and its variants): one prompt, a chosen and a rejected response.

Both sequences share the same prompt ids, cut the same way, so the two differ only in the
response. The length budget treats the longer response as "the" response: ``infer_seqlen``
then favours the responses over the prompt, and both responses are cut to the same length.

A batch with an ``_images`` column (LLaMA-Factory's ranking rows with ``images``) has each
answer's messages expanded into the template's vision tokens, as LLaMA-Factory does (prompt +
chosen, prompt + rejected, the same images), and the row carries the images' ``pixel_values`` and
``image_grid_thw`` once (vision.py); a pair whose cut would drop an image token is skipped.
"""

from __future__ import annotations

from typing import Any, MutableMapping

from .common import IGNORE_INDEX, Batch, SkipCounter, messages, num_rows, optional_text, row_context
from .seqlen import infer_seqlen
from .vision import (
    IMAGE_CUT, IMAGE_GRID_THW, PIXEL_VALUES, expand_messages, has_image_column, image_cells, image_inputs,
    image_token_id, image_token_total, row_image_paths,
)

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
    """Columns: chosen_/rejected_ ``input_ids``, ``attention_mask``, ``labels``; with an ``_images``
    column also ``pixel_values`` and ``image_grid_thw`` (vision.py), one set per pair."""
    out: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    images = has_image_column(batch)
    if images:
        out[PIXEL_VALUES], out[IMAGE_GRID_THW] = [], []
    skips = SkipCounter("pairwise")
    for row in range(num_rows(batch)):
        responses = messages(batch, "_response", row)
        if len(responses) != 2:
            skips.skip(batch, row, "not_a_pair", NOT_A_PAIR)
            continue
        prompt, chosen, rejected = messages(batch, "_prompt", row), responses[0], responses[1]
        mm, wanted = None, ()
        paths = row_image_paths(batch, row) if images else []
        if paths:
            # Each answer with the prompt and all the row's images, as LLaMA-Factory expands them: an
            # answer may hold an <image> too, and one whose count differs from the other's is an error.
            # The images fill the prompt's placeholders first, so both expand the prompt alike.
            mm = image_inputs(template, paths, data_args)
            *expanded_prompt, chosen = expand_messages(template, prompt + [chosen], mm)
            rejected = expand_messages(template, prompt + [rejected], mm)[-1]
            prompt = expanded_prompt
            wanted = (image_token_total(template, prompt + [chosen]), image_token_total(template, prompt + [rejected]))
        with row_context("pairwise", batch, row):
            chosen_ids, chosen_labels, rejected_ids, rejected_labels = encode_pairwise_example(
                tokenizer, template, prompt, chosen, rejected,
                optional_text(batch, "_system", row), optional_text(batch, "_tools", row),
                data_args.cutoff_len,
            )
        if wanted:
            token = image_token_id(tokenizer, template)
            if (chosen_ids.count(token), rejected_ids.count(token)) != wanted:
                skips.skip(batch, row, "image_cut", IMAGE_CUT)
                continue
        if images:
            pixels, grid = image_cells(mm)
            out[PIXEL_VALUES].append(pixels)
            out[IMAGE_GRID_THW].append(grid)
        out["chosen_input_ids"].append(chosen_ids)
        out["chosen_attention_mask"].append([1] * len(chosen_ids))
        out["chosen_labels"].append(chosen_labels)
        out["rejected_input_ids"].append(rejected_ids)
        out["rejected_attention_mask"].append([1] * len(rejected_ids))
        out["rejected_labels"].append(rejected_labels)
    skips.report(num_rows(batch), stats)
    return out
