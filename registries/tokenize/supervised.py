"""Supervised fine-tuning (sft): a conversation becomes input ids plus labels that train only
on the assistant's turns.

Layout of one example, turn by turn (``-`` marks a label of IGNORE_INDEX):

    input_ids:  prompt_1 response_1 prompt_2 response_2 ...
    labels:     -------- response_1 -------- response_2 ...

Options follow LLaMA-Factory so its configs mean the same here:

* ``train_on_prompt``: prompts are labelled too.
* ``mask_history``: only the last exchange is trained. Turns are budgeted last-first, so when
  the conversation is too long the history is cut, never the exchange being trained.
* ``cutoff_len``: each turn gets what is left of the budget, split by ``infer_seqlen``.
* ``efficient_eos`` templates write no eos between turns; the eos is appended once at the end
  and each later prompt's first position is labelled eos (the end of the answer before it).
"""

from __future__ import annotations

from typing import Any, MutableMapping

from .common import IGNORE_INDEX, Batch, SkipCounter, messages, num_rows, optional_text, row_context
from .seqlen import infer_seqlen
from .vision import (
    IMAGE_CUT, IMAGE_GRID_THW, PIXEL_VALUES, expand_images, has_image_column, image_cells, image_token_id,
    image_token_total, row_image_paths,
)

NO_RESPONSE = "no response to train on (prediction-only rows belong to stage=predict)"
MANY_RESPONSES = (
    "more than one response (ranking data: use stage=rm or stage=dpo, or drop `ranking: true` "
    "from dataset_info.json)"
)


def encode_supervised_example(
    tokenizer,
    template,
    prompt: list[dict],
    response: list[dict],
    system: str,
    tools: str,
    cutoff_len: int,
    train_on_prompt: bool = False,
    mask_history: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids and labels for one aligned example with exactly one response."""
    pairs = template.encode_multiturn(tokenizer, prompt + response, system, tools)
    eos_id = tokenizer.eos_token_id
    # The trailing eos of efficient_eos templates is reserved in the budget up front.
    used = 1 if template.efficient_eos else 0
    if mask_history:
        pairs = pairs[::-1]  # last exchange first, so it is the one that survives truncation

    input_ids: list[int] = []
    labels: list[int] = []
    for turn, (source_ids, target_ids) in enumerate(pairs):
        if used >= cutoff_len:
            break
        source_len, target_len = infer_seqlen(len(source_ids), len(target_ids), cutoff_len - used)
        source_ids, target_ids = source_ids[:source_len], target_ids[:target_len]
        used += source_len + target_len

        if train_on_prompt:
            source_labels = list(source_ids)
        elif template.efficient_eos and turn != 0 and source_len > 0:
            # LLaMA-Factory's rule (kept for identical labels): with mask_history the order is
            # reversed, so "turn != 0" means every turn but the last one.
            source_labels = [eos_id] + [IGNORE_INDEX] * (source_len - 1)
        else:
            source_labels = [IGNORE_INDEX] * source_len
        if mask_history and turn != 0:
            target_labels = [IGNORE_INDEX] * target_len
        else:
            target_labels = list(target_ids)

        if mask_history:
            input_ids = source_ids + target_ids + input_ids
            labels = source_labels + target_labels + labels
        else:
            input_ids += source_ids + target_ids
            labels += source_labels + target_labels

    if template.efficient_eos:
        input_ids.append(eos_id)
        labels.append(eos_id)
    return input_ids, labels


def encode_supervised_rows(
    batch: Batch, *, tokenizer, template, data_args, stage: str = "sft",
    stats: MutableMapping[str, int] | None = None, media: list | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) for every usable row of a batch, in order; the rest are counted.

    A batch with an ``_images`` column has each row's ``<image>`` placeholders expanded by the
    template's vision plugin (vision.py); ``media`` (a list) then receives each encoded row's
    processor tensors (None for a row without images), in the same order."""
    skips = SkipCounter(stage)
    encoded = []
    images = has_image_column(batch)
    for row in range(num_rows(batch)):
        response = messages(batch, "_response", row)
        if len(response) != 1:
            skips.skip(batch, row, "no_response" if not response else "many_responses",
                       NO_RESPONSE if not response else MANY_RESPONSES)
            continue
        prompt, mm, wanted = messages(batch, "_prompt", row), None, 0
        paths = row_image_paths(batch, row) if images else []
        if paths:
            expanded, mm = expand_images(template, prompt + response, paths, data_args)
            prompt, response = expanded[:-1], expanded[-1:]
            wanted = image_token_total(template, expanded)
        with row_context(stage, batch, row):
            input_ids, labels = encode_supervised_example(
                tokenizer,
                template,
                prompt,
                response,
                optional_text(batch, "_system", row),
                optional_text(batch, "_tools", row),
                cutoff_len=data_args.cutoff_len,
                train_on_prompt=data_args.train_on_prompt,
                mask_history=data_args.mask_history,
            )
        if wanted and input_ids.count(image_token_id(tokenizer, template)) != wanted:
            skips.skip(batch, row, "image_cut", IMAGE_CUT)
            continue
        encoded.append((input_ids, labels))
        if media is not None:
            media.append(mm)
    skips.report(num_rows(batch), stats)
    return encoded


def preprocess_supervised(
    batch: Batch, *, tokenizer, template, data_args, stats: MutableMapping[str, int] | None = None
) -> dict[str, list[Any]]:
    """Columns ``input_ids``, ``attention_mask``, ``labels``: one row per usable example; with an
    ``_images`` column also ``pixel_values`` and ``image_grid_thw`` (vision.py)."""
    out: dict[str, list[Any]] = {"input_ids": [], "attention_mask": [], "labels": []}
    media: list | None = [] if has_image_column(batch) else None
    for input_ids, labels in encode_supervised_rows(
        batch, tokenizer=tokenizer, template=template, data_args=data_args, stats=stats, media=media
    ):
        out["input_ids"].append(input_ids)
        out["attention_mask"].append([1] * len(input_ids))
        out["labels"].append(labels)
    if media is not None:
        cells = [image_cells(mm) for mm in media]
        out[PIXEL_VALUES] = [pixels for pixels, _ in cells]
        out[IMAGE_GRID_THW] = [grid for _, grid in cells]
    return out

