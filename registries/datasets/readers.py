"""Read a dataset's rows, remembering where each came from.

Every row is handed on as three fields:

* ``_raw``: the row as JSON text (for jsonl, the line itself, so a broken line is reported by the
  aligner with its row number, or skipped, rather than stopping the read),
* ``_source_file``: the file it came from, as the user wrote it (``data/my.json``),
* ``_source_row``: its 1-based position there: the element of a JSON list, the line of a jsonl
  or txt file, the record of a csv (header not counted), parquet or arrow file.

The fixed three-column shape is what lets the rows travel as a pyarrow Table (``read_table``)
through Ray Data whatever mix of types the user's columns hold; a malformed value only
becomes an error in the aligner, where it can name the row. No Ray here.
"""

from __future__ import annotations

import csv
import json
import os
import random
from typing import Any, Iterator

from .errors import DataConfigError
from .info import DatasetAttr

RAW, SOURCE_FILE, SOURCE_ROW = "_raw", "_source_file", "_source_row"
FILE_TYPES = ("json", "jsonl", "csv", "parquet", "arrow", "txt")


def read_rows(attr: DatasetAttr, max_samples: int | None = None, seed: int = 42) -> list[dict[str, Any]]:
    """All rows of one dataset as ``{"_raw", "_source_file", "_source_row"}`` dicts.

    ``attr.num_samples`` resamples first (seeded: a shuffled subset, or every row plus seeded
    repeats when it asks for more rows than there are), then ``max_samples`` keeps the first rows.
    """
    rows = list(_iter_source(attr))
    if attr.num_samples is not None:
        rows = _resample(rows, attr.num_samples, seed)
    if max_samples is not None:
        rows = rows[:max_samples]
    return rows


def read_table(attr: DatasetAttr, max_samples: int | None = None, seed: int = 42):
    """``read_rows`` as a pyarrow Table (for ``ray.data.from_arrow``)."""
    return _rows_table(read_rows(attr, max_samples, seed))


def iter_file_tables(attr: DatasetAttr, path: str, rows_per_table: int) -> Iterator:
    """One file's rows as consecutive pyarrow Tables of at most ``rows_per_table`` rows (``read_table``'s
    columns), so a reader holds one chunk at a time (a JSON list file is the exception: it is parsed whole)."""
    chunk: list[dict[str, Any]] = []
    for row in _READERS[_file_type(attr, path)](attr, path):
        chunk.append(row)
        if len(chunk) == rows_per_table:
            yield _rows_table(chunk)
            chunk = []
    if chunk:
        yield _rows_table(chunk)


def _rows_table(rows: list[dict[str, Any]]):
    import pyarrow as pa

    return pa.table(
        {
            RAW: pa.array([r[RAW] for r in rows], pa.string()),
            SOURCE_FILE: pa.array([r[SOURCE_FILE] for r in rows], pa.string()),
            SOURCE_ROW: pa.array([r[SOURCE_ROW] for r in rows], pa.int64()),
        }
    )


def data_files(attr: DatasetAttr) -> list[str]:
    """The files behind a ``file_name`` entry: the file, or a folder's files (one type, sorted)."""
    path = attr.source
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        names = [n for n in os.listdir(path) if not n.startswith(".")]  # skip .DS_Store and the like
        files = sorted(os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n)))
        if not files:
            raise DataConfigError(f"Dataset {attr.name!r}: folder {path} (file_name in {attr.info_path}) has no files.")
    else:
        raise DataConfigError(
            f"Dataset {attr.name!r}: file {path} not found (file_name in {attr.info_path} is relative to dataset_dir). "
            "Check the name, or set dataset_dir to the folder that holds it."
        )
    types = {_file_type(attr, f) for f in files}
    if len(types) > 1:
        raise DataConfigError(
            f"Dataset {attr.name!r}: folder {path} mixes file types ({', '.join(sorted(types))}); "
            "a folder dataset must hold files of one type."
        )
    return files


def source_paths(attrs: list[DatasetAttr]) -> set[str]:
    """dataset_info.json and every file the datasets ``attrs`` read; a DataConfigError names a
    missing file."""
    paths = {attr.info_path for attr in attrs}
    paths.update(path for attr in attrs if attr.load_from == "file" for path in data_files(attr))
    return paths


def _file_type(attr: DatasetAttr, path: str) -> str:
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in FILE_TYPES:
        raise DataConfigError(
            f"Dataset {attr.name!r}: cannot read {path}: unsupported file type {('.' + ext) if ext else '(none)'}. "
            f"Supported: {', '.join('.' + t for t in FILE_TYPES)}."
        )
    return ext


def _iter_source(attr: DatasetAttr) -> Iterator[dict[str, Any]]:
    if attr.load_from == "file":
        for path in data_files(attr):
            yield from _READERS[_file_type(attr, path)](attr, path)
    elif attr.load_from in ("hf_hub", "script", "ms_hub"):
        yield from _read_hub(attr)
    else:  # DatasetAttr is only built by info.parse_entry, which knows no other kinds
        raise DataConfigError(f"Dataset {attr.name!r}: unknown source kind {attr.load_from!r}.")


def _row(raw: str, path: str, number: int) -> dict[str, Any]:
    return {RAW: raw, SOURCE_FILE: path, SOURCE_ROW: number}


def _dump(record: Any) -> str:
    # default=str keeps parquet/arrow values JSON has no type for (dates, decimals) readable.
    return json.dumps(record, ensure_ascii=False, default=str)


def _read_json(attr: DatasetAttr, path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several JSON values one per line: JSON lines in a .json file
            yield from _read_jsonl(attr, path)
            return
        raise DataConfigError(
            f"Dataset {attr.name!r}: {path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}."
        ) from None
    if isinstance(data, dict):
        raise DataConfigError(
            f"Dataset {attr.name!r}: {path} holds a JSON object; expected a JSON list of rows "
            f"(e.g. [{{\"instruction\": ..., \"output\": ...}}, ...]) or one JSON object per line."
        )
    if not isinstance(data, list):
        raise DataConfigError(f"Dataset {attr.name!r}: {path} holds a single JSON value; expected a list of rows.")
    for i, record in enumerate(data, start=1):
        yield _row(_dump(record), path, i)


def _read_jsonl(attr: DatasetAttr, path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield _row(line.strip(), path, line_no)


def _read_txt(attr: DatasetAttr, path: str) -> Iterator[dict[str, Any]]:
    # One text per line for pretraining; it fills the entry's prompt column ("text" by habit).
    column = attr.column("prompt") or "text"
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            text = line.rstrip("\r\n")
            if text.strip():
                yield _row(_dump({column: text}), path, line_no)


def _read_csv(attr: DatasetAttr, path: str) -> Iterator[dict[str, Any]]:
    # Python's csv keeps every cell a string: "19" stays an answer, not a number.
    with open(path, encoding="utf-8", newline="") as f:
        for i, record in enumerate(csv.DictReader(f), start=1):
            yield _row(_dump(record), path, i)


def _read_parquet(attr: DatasetAttr, path: str) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    yield from _table_rows(pq.read_table(path), path)


def _read_arrow(attr: DatasetAttr, path: str) -> Iterator[dict[str, Any]]:
    import pyarrow as pa

    # `datasets` writes the stream format; pyarrow's feather/IPC writers the file format.
    try:
        with pa.memory_map(path) as source:
            table = pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(path) as source:
            table = pa.ipc.open_stream(source).read_all()
    yield from _table_rows(table, path)


def _table_rows(table, path: str) -> Iterator[dict[str, Any]]:
    for i, record in enumerate(table.to_pylist(), start=1):
        yield _row(_dump(record), path, i)


def _read_hub(attr: DatasetAttr) -> Iterator[dict[str, Any]]:
    """Hub and script datasets (network needed; never used by tests or demos)."""
    if attr.load_from == "ms_hub":
        try:
            from modelscope import MsDataset  # optional dependency
        except ImportError:
            raise DataConfigError(
                f"Dataset {attr.name!r} comes from the ModelScope hub (ms_hub_url in {attr.info_path}); "
                "install `modelscope` or add an hf_hub_url."
            ) from None
        dataset = MsDataset.load(attr.source, subset_name=attr.subset, data_dir=attr.folder, split=attr.split)
        dataset = dataset.to_hf_dataset() if hasattr(dataset, "to_hf_dataset") else dataset
    else:
        from datasets import load_dataset

        dataset = load_dataset(path=attr.source, name=attr.subset, data_dir=attr.folder, split=attr.split)
    label = f"{attr.load_from}:{attr.source}"
    for i, record in enumerate(dataset, start=1):
        yield _row(_dump(record), label, i)


def _resample(rows: list, target: int, seed: int) -> list:
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    picked = order[:target]
    if target > len(rows) and rows:  # every row once, then seeded repeats to reach the target
        picked += [rng.randrange(len(rows)) for _ in range(target - len(rows))]
    return [rows[i] for i in picked]


_READERS = {
    "json": _read_json,
    "jsonl": _read_jsonl,
    "csv": _read_csv,
    "parquet": _read_parquet,
    "arrow": _read_arrow,
    "txt": _read_txt,
}
