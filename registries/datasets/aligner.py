"""The aligner: raw rows of any format -> ALIGNED examples, the input of per-stage tokenization.

An ALIGNED example::

    _prompt    list[{"role", "content"}]  every turn before the response, ending on user/observation
    _response  list[{"role", "content"}]  1 message (sft, kto), 0 (prediction-only, pretraining text),
                                          2 = [chosen, rejected] (ranking)
    _system    str ("" if none)           _tools  str, JSON list of function schemas ("" if none)
    _kto_tag   bool, or None unless the dataset has a kto_tag column
    _images    list[str] of checked image paths; present only when the dataset has an images column
    _extra     str, JSON object of the row's columns its dataset_info entry does not map ("{}" if none):
               what RL reward functions and environments read (a test case, a difficulty, an id)
    _source_file, _source_row             where the row came from, so later steps can name it too

Rows come from readers.py (``_raw`` JSON text plus source file and row). Everything here is a
pure function of its inputs, so Ray Data can call it on column batches:

    ds.map_batches(align_batch, fn_kwargs={"attr": attr, "skip_bad_rows": True})

With skip_bad_rows, bad rows are dropped; the driver learns how many from the row counts
before and after, and which ones by running ``bad_rows_batch`` over the same rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import DatasetRowError, describe_type
from .formats import FORMAT_ALIGNERS
from .info import DatasetAttr
from .readers import RAW, SOURCE_FILE, SOURCE_ROW
from .rowcontext import RowContext

ALIGNED_COLUMNS = ("_prompt", "_response", "_system", "_tools", "_kto_tag", "_extra", SOURCE_FILE, SOURCE_ROW)
IMAGES_COLUMN = "_images"  # extra column of multimodal datasets (see media.py)
ERROR_COLUMN = "_error"


def align_row(row: dict[str, Any], attr: DatasetAttr) -> dict[str, Any]:
    """One reader row -> one ALIGNED example; raises DatasetRowError if the row is bad."""
    file, number = row[SOURCE_FILE], int(row[SOURCE_ROW])
    try:
        record = json.loads(row[RAW])
    except json.JSONDecodeError as err:
        problem = f"the row is not valid JSON ({err.msg} at column {err.colno})"
        raise DatasetRowError(attr.name, file, number, "", problem) from None
    if not isinstance(record, dict):
        problem = f"the row is {describe_type(record)}, expected an object of columns"
        raise DatasetRowError(attr.name, file, number, "", problem)
    example = FORMAT_ALIGNERS[attr.formatting](RowContext(attr, record, file, number))
    example["_extra"] = extra_columns(record, attr)
    example[SOURCE_FILE] = file
    example[SOURCE_ROW] = number
    return example


def extra_columns(record: dict[str, Any], attr: DatasetAttr) -> str:
    """The row's columns that the entry maps to no role, as JSON text (key order kept)."""
    mapped = {name for name in attr.columns.values() if name}
    return json.dumps({k: v for k, v in record.items() if k not in mapped}, ensure_ascii=False)


@dataclass
class AlignResult:
    examples: list[dict[str, Any]]
    skipped: list[DatasetRowError] = field(default_factory=list)

    def report(self, limit: int = 5) -> str:
        """A one-paragraph summary of skipped rows ("" if none)."""
        return skip_report(self.skipped, len(self.examples) + len(self.skipped), limit)


def align_rows(rows: list[dict[str, Any]], attr: DatasetAttr, skip_bad_rows: bool = False) -> AlignResult:
    """Align a list of reader rows; the first bad row raises unless skip_bad_rows."""
    result = AlignResult([])
    for row in rows:
        try:
            result.examples.append(align_row(row, attr))
        except DatasetRowError as err:
            if not skip_bad_rows:
                raise
            result.skipped.append(err)
    return result


def align_batch(batch: dict[str, list], attr: DatasetAttr, skip_bad_rows: bool = False) -> dict[str, list]:
    """Column batch of reader rows -> column batch of ALIGNED examples (bad rows dropped if skipping)."""
    result = align_rows(_batch_rows(batch), attr, skip_bad_rows)
    names = ALIGNED_COLUMNS + ((IMAGES_COLUMN,) if attr.has_images else ())
    return {name: [ex[name] for ex in result.examples] for name in names}


def bad_rows_batch(batch: dict[str, list], attr: DatasetAttr) -> dict[str, list]:
    """Column batch of reader rows -> one row per bad row: source file, row and the error text."""
    skipped = align_rows(_batch_rows(batch), attr, skip_bad_rows=True).skipped
    return {
        SOURCE_FILE: [e.file for e in skipped],
        SOURCE_ROW: [e.row for e in skipped],
        ERROR_COLUMN: [e.short for e in skipped],
    }


SHOWN_SKIPPED = 5  # bad rows a report names; the rest are counted


def skip_report(errors: list[DatasetRowError], total: int, limit: int = SHOWN_SKIPPED) -> str:
    if not errors:
        return ""
    return skipped_summary([e.short for e in errors[:limit]], len(errors), total)


def skipped_summary(shown: list[str], skipped: int, total: int) -> str:
    """``skipped`` of ``total`` rows were bad; ``shown`` names the first few (each its row, file and dataset)."""
    more = f"; and {skipped - len(shown)} more" if skipped > len(shown) else ""
    return f"skipped {skipped} of {total} rows (skip_bad_rows is on): {'; '.join(shown)}{more}."


def aligned_schema(images: bool = False):
    """The pyarrow schema of an aligned batch, so every block has the same types (an all-empty
    ``_response`` block would otherwise be inferred as list<null>). ``images`` adds ``_images``."""
    import pyarrow as pa

    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    return pa.schema(
        [
            ("_prompt", message),
            ("_response", message),
            ("_system", pa.string()),
            ("_tools", pa.string()),
            ("_kto_tag", pa.bool_()),
            ("_extra", pa.string()),
            (SOURCE_FILE, pa.string()),
            (SOURCE_ROW, pa.int64()),
        ]
        + ([(IMAGES_COLUMN, pa.list_(pa.string()))] if images else [])
    )


def aligned_table(batch: dict[str, list], images: bool | None = None):
    """An aligned column batch as a pyarrow Table with ``aligned_schema()``. ``images`` (None: whether
    the batch has ``_images``) True gives every table the ``_images`` column, null where the batch
    lacks it: a text dataset mixed with an image dataset must have the same schema."""
    import pyarrow as pa

    if images is None:
        images = IMAGES_COLUMN in batch
    names = ALIGNED_COLUMNS + ((IMAGES_COLUMN,) if images else ())
    rows = len(batch[SOURCE_ROW])
    columns = {name: batch[name] if name in batch else [None] * rows for name in names}
    return pa.Table.from_pydict(columns, schema=aligned_schema(images))


def with_images_column(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aligned rows of several datasets, some with images: every row gets ``_images`` (None where its
    dataset has none), so a batch of them has one set of columns."""
    return [row if IMAGES_COLUMN in row else {**row, IMAGES_COLUMN: None} for row in rows]


def _batch_rows(batch: dict[str, list]) -> list[dict[str, Any]]:
    # Ray hands numpy arrays for "numpy" batches and lists for "default"/pandas conversions.
    raws, files, numbers = (list(batch[c]) for c in (RAW, SOURCE_FILE, SOURCE_ROW))
    return [{RAW: r, SOURCE_FILE: f, SOURCE_ROW: int(n)} for r, f, n in zip(raws, files, numbers)]
