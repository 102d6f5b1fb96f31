"""Packing for sft: whole tokenized examples share one sequence of at most ``cutoff_len``.

Examples are never split. They are placed by a greedy knapsack (the largest that still fits,
until none does), which wastes little room and is deterministic.

Plain packing marks every real token 1 in ``attention_mask``; the model then attends across
example boundaries (cheap, some cross-talk). ``neat_packing`` writes the example's number
instead (1, 1, 1, 2, 2, 3, ...) so the collator can build position ids that restart per example
and a block-diagonal causal mask: packed examples cannot see each other.

In both modes the first token of every packed example gets label IGNORE_INDEX. Unpacked, that
label is never used (the loss predicts token t from tokens before t); packed, it would make the
last token of the previous example learn to predict the next example's start.
"""

from __future__ import annotations

import bisect
from typing import Any, MutableMapping

from .common import IGNORE_INDEX, Batch, logger
from .supervised import encode_supervised_rows
from .vision import has_image_column
from registries.errors import UserError


def greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins whose lengths sum to at most ``capacity``.

    Each bin is filled by repeatedly taking the longest remaining item that still fits
    (binary search over the items sorted by length). Items longer than ``capacity`` are an
    error: callers drop or truncate them first.
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"Items {too_long} are longer than the capacity {capacity}; drop them before packing.")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sorted_lengths = [lengths[i] for i in order]
    bins: list[list[int]] = []
    while order:
        room, current = capacity, []
        while True:
            pick = bisect.bisect_right(sorted_lengths, room) - 1
            if pick < 0:
                break
            room -= sorted_lengths.pop(pick)
            current.append(order.pop(pick))
        bins.append(current)
    return bins


def pack_examples(
    examples: list[tuple[list[int], list[int]]], cutoff_len: int, neat_packing: bool = False
) -> dict[str, list[Any]]:
    """Pack (input_ids, labels) pairs into rows of ``input_ids``, ``attention_mask``, ``labels``.

    Rows are not padded: the collator pads each batch to its longest row.
    """
    fitting = [ex for ex in examples if 0 < len(ex[0]) <= cutoff_len]
    dropped = len(examples) - len(fitting)
    if dropped:  # cannot happen after supervised truncation; guards hand-made inputs
        logger.warning("packing: dropped %d examples longer than cutoff_len=%d or empty.", dropped, cutoff_len)

    out: dict[str, list[Any]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for members in greedy_knapsack([len(ids) for ids, _ in fitting], cutoff_len):
        input_ids: list[int] = []
        attention_mask: list[int] = []
        labels: list[int] = []
        for number, index in enumerate(members, start=1):
            ids, example_labels = fitting[index]
            input_ids += ids
            attention_mask += [number if neat_packing else 1] * len(ids)
            labels += [IGNORE_INDEX] + list(example_labels[1:])
        out["input_ids"].append(input_ids)
        out["attention_mask"].append(attention_mask)
        out["labels"].append(labels)
    return out


def preprocess_packed_supervised(
    batch: Batch, *, tokenizer, template, data_args, stats: MutableMapping[str, int] | None = None
) -> dict[str, list[Any]]:
    """sft with ``packing``: tokenize each row as for plain sft, then pack within the batch."""
    if has_image_column(batch):
        raise UserError(
            "packing (and neat_packing) cannot take rows with images yet: a packed sequence would need its "
            "images' tensors and positions per example. Set packing: false for this dataset."
        )
    examples = encode_supervised_rows(
        batch, tokenizer=tokenizer, template=template, data_args=data_args, stats=stats
    )
    return pack_examples(examples, data_args.cutoff_len, neat_packing=data_args.neat_packing)
