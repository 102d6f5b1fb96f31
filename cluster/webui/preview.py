"""The data preview: a dataset's rows as the chosen stage and template tokenize them.

Every number comes from the registries' own path (``StageSpec.tokenize_here``: the aligner, the
template, the stage's label masking), so what the page colours as trained is what the run trains
on. Rows are shown unpacked: packing only concatenates them, it changes no label.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from registries.tokenize import IGNORE_INDEX

SHOWN_ROWS = 3
LENGTH_ROWS = 5000  # rows measured for the histogram (the first ones; the page says when capped)
BINS = 20
# Column pairs a stage's tokenized example holds: (ids, labels, what the page calls the sequence).
SEQUENCES = (
    ("input_ids", "labels", "example"),
    ("chosen_input_ids", "chosen_labels", "chosen"),
    ("rejected_input_ids", "rejected_labels", "rejected"),
    ("kl_input_ids", "kl_labels", "mismatched pair (KL)"),
)


def preview(config: dict[str, Any], dataset: str, rows: int = SHOWN_ROWS) -> dict[str, Any]:
    """The first ``rows`` examples of ``dataset`` as tokens with their label mask, and the token
    lengths of its first LENGTH_ROWS examples against cutoff_len."""
    from ..config import load_config
    from ..driver import tokenizer_and_template

    cfg = load_config(dict(config), purpose="train")
    tokenizer, template = tokenizer_and_template(cfg)
    stage = cfg.job_spec().stage
    one = dataclasses.replace(cfg.data, dataset=[dataset], packing=False, neat_packing=False, streaming=False)
    shown = stage.tokenize_here(tokenizer, template, dataclasses.replace(one, max_samples=rows))
    measured = stage.tokenize_here(
        tokenizer, template, dataclasses.replace(one, max_samples=LENGTH_ROWS, cutoff_len=10**9))
    lengths = [_length(example) for example in measured]
    cutoff = cfg.data.cutoff_len
    return {
        "dataset": dataset,
        "stage": stage.name,
        "template": template.name,
        "rows": [_sequences(example, tokenizer) for example in shown],
        "count": len(lengths),
        "capped": len(lengths) == LENGTH_ROWS,
        "cutoff_len": cutoff,
        "truncated": sum(length > cutoff for length in lengths),
        "histogram": histogram(lengths, cutoff),
    }


def _length(example: dict[str, Any]) -> int:
    """The longest sequence an example puts through the model (a pair: its longer side)."""
    return max(len(example[ids]) for ids, _, _ in SEQUENCES if ids in example)


def _sequences(example: dict[str, Any], tokenizer) -> list[dict[str, Any]]:
    out = []
    for ids_key, labels_key, name in SEQUENCES:
        if ids_key not in example:
            continue
        ids, labels = example[ids_key], example.get(labels_key) or [IGNORE_INDEX] * len(example[ids_key])
        out.append({
            "name": name,
            "tokens": [
                {"id": int(i), "text": tokenizer.decode([i]), "trained": label != IGNORE_INDEX}
                for i, label in zip(ids, labels)
            ],
        })
    return out


def histogram(lengths: list[int], cutoff: int, bins: int = BINS) -> dict[str, Any]:
    """Equal-width bins from 0 to max(longest, cutoff), so the cutoff line always falls inside."""
    top = max([cutoff, *lengths]) if lengths else cutoff
    width = max(1, -(-top // bins))  # ceil, at least one token per bin
    counts = [0] * bins
    for length in lengths:
        counts[min(length // width, bins - 1)] += 1
    return {"width": width, "counts": counts}
