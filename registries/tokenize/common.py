"""What every stage's tokenizer shares: the label mask value, row errors, and skip accounting.

Preprocess functions work on a column batch (``dict[str, list]``), the shape Ray Data's
``map_batches`` hands over; with ``batch_format="numpy"`` the cells are numpy arrays (a message
list is an object array of dicts, a tag may be ``numpy.bool_``), so cells are read through the
helpers here. Errors and skip reports name the row by the aligner's ``_source_file`` /
``_source_row`` columns when the batch has them, else by its index in the batch, and quote the
start of its first message.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, MutableMapping

import numpy as np

IGNORE_INDEX = -100  # label value that the loss skips (PyTorch's cross-entropy default)

logger = logging.getLogger("registries.tokenize")

Batch = dict[str, list[Any]]


def num_rows(batch: Batch) -> int:
    return len(batch["_prompt"])


def messages(batch: Batch, column: str, row: int) -> list[dict]:
    """A message-list cell as a list of plain dicts (None or a missing cell: no messages)."""
    cell = batch[column][row]
    return [] if cell is None else [dict(message) for message in cell]


def optional_text(batch: Batch, column: str, row: int) -> str:
    """Optional text columns (system, tools): an absent column or a None value mean empty."""
    values = batch.get(column)
    value = values[row] if values is not None else None
    return value or ""


def kto_tag(batch: Batch, row: int) -> bool | None:
    """The row's kto_tag as a Python bool, None if unset; anything else is a user mistake."""
    value = batch["_kto_tag"][row]
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    raise ValueError(
        f"Stage 'kto': {where(batch, row)} has kto_tag {value!r}; it must be true or false "
        "(a JSON boolean, not a string or number). Fix that column in the dataset file."
    )


def where(batch: Batch, row: int) -> str:
    """How to find a row: its source file and row when the aligner recorded them."""
    files, rows = batch.get("_source_file"), batch.get("_source_row")
    if files is not None and rows is not None:
        return f"row {int(rows[row])} of {files[row]}"
    return f"row {row} of this batch"


def row_preview(batch: Batch, row: int, width: int = 60) -> str:
    """The start of a row's first prompt message, quoted, to help find the row."""
    prompt = batch["_prompt"][row]
    first = prompt[0] if prompt is not None and len(prompt) else {}
    content = first.get("content", "") if isinstance(first, dict) else str(first)
    content = content if isinstance(content, str) else repr(content)
    return repr(content[:width] + ("..." if len(content) > width else ""))


@contextmanager
def row_context(stage: str, batch: Batch, row: int) -> Iterator[None]:
    """Turn a template error on one row into a paragraph that says which row and how to fix it."""
    try:
        yield
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"Tokenizing for stage {stage!r} failed on {where(batch, row)} (first prompt message "
            f"starts {row_preview(batch, row)}): {err} The aligner should give every row prompt turns "
            "(user/observation) and response turns (assistant/function) that alternate; check that "
            "row in the dataset file and the dataset's columns/tags in dataset_info.json."
        ) from err


class SkipCounter:
    """Rows a stage cannot use, grouped by reason, reported once per batch.

    ``stats`` (optional, any mutable mapping such as a ``Counter``) receives the totals under
    ``skipped_<key>``, so a caller that runs the function locally can assert on or show them.
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.rows: dict[str, list[str]] = {}
        self.why: dict[str, str] = {}

    def skip(self, batch: Batch, row: int, key: str, why: str) -> None:
        self.rows.setdefault(key, []).append(where(batch, row))
        self.why.setdefault(key, why)

    def report(self, total: int, stats: MutableMapping[str, int] | None = None) -> None:
        for key, rows in self.rows.items():
            shown = "; ".join(rows[:5]) + ("; ..." if len(rows) > 5 else "")
            logger.warning(
                "%s: skipped %d of %d rows in this batch (%s): %s",
                self.stage, len(rows), total, shown, self.why[key],
            )
            if stats is not None:
                stats["skipped_" + key] = stats.get("skipped_" + key, 0) + len(rows)
