"""``streaming: true``: the training split as a lazy pipeline that runs while the workers train.

read (Ray tasks, one file chunk at a time) -> align -> concat -> tokenize in BATCH_SIZE windows,
never materialized: Ray Train splits the stream between the workers (``streaming_split``) and
each worker pulls its share as it trains (streamed_shard.py), so neither the driver nor a
worker holds the whole dataset. The evaluation split is small and is prepared as usual.

What streaming gives up, compared with the materialized path (docs/architecture.md):
- the row count (no epochs, so ``max_steps`` is required) and everything that needs it before
  the first batch: ``val_size``, interleaved mixing, ``num_samples``, ``tokenized_path``;
- identical batches for any worker count: rows reach workers as Ray hands out blocks;
- an exact resume position: a resumed run skips as many batches as were trained, but of a new
  stream, not necessarily the same rows;
- the upfront report of skipped bad rows (``skip_bad_rows`` still skips them).
"""

from __future__ import annotations

import functools
import logging

import ray

from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError, DatasetRowError
from registries.datasets.info import get_dataset_attrs
from registries.datasets.readers import iter_file_tables, read_table
from registries.datasets.stage_fields import check_stage_fields
from stages.table import StageSpec

from .common import BATCH_SIZE, CarriedDataError, nothing_left, split_sources, user_errors_raised
from .ray_data import align_rows, aligned_mixed, tokenize_windows, tokenized

logger = logging.getLogger(__name__)

READ_CHUNK_ROWS = 4096  # raw rows per block a read task emits


def streamed_splits(data_args: DataArguments, stage: StageSpec, seed: int, tokenizer, template) -> tuple:
    """(lazy tokenized train stream, materialized eval dataset or None)."""
    preprocess = stage.preprocess_fn(tokenizer, template, data_args)
    attrs = get_dataset_attrs(data_args.dataset, data_args.dataset_dir)
    check_stage_fields(attrs, stage.name, stage.dataset_need)
    parts = [_streamed_rows(attr, data_args, seed) for attr in attrs]
    rows = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    train = tokenize_windows(rows, preprocess)
    _check_first_example(train, rows, preprocess, stage, data_args)
    evaluation = None
    if data_args.eval_dataset:
        evaluation = tokenized(aligned_mixed(data_args.eval_dataset, data_args, stage, seed), preprocess)
    return train, evaluation


def _streamed_rows(attr, data_args: DataArguments, seed: int) -> "ray.data.Dataset":
    """One dataset's aligned rows, lazily; local files are read in Ray tasks, chunk by chunk."""
    if attr.num_samples is not None:
        raise DataConfigError(
            f"Dataset {attr.name!r} sets num_samples in {attr.info_path}, which resamples from all of its rows; "
            "a streamed dataset is never held whole. Remove num_samples from the entry (max_samples keeps the "
            "first rows and works while streaming), or set streaming: false."
        )
    if attr.load_from == "file":
        from registries.datasets.readers import data_files

        files = data_files(attr)
        paths = ray.data.from_items([{"path": path} for path in files], override_num_blocks=len(files))
        raw = paths.map_batches(functools.partial(_read_files, attr=attr), batch_size=1, batch_format="pyarrow")
    else:  # a hub dataset arrives through datasets' own download: read on the driver, then streamed on
        logger.warning("dataset %r is read whole on the driver: streaming reads local files chunk by chunk", attr.name)
        raw = ray.data.from_arrow(read_table(attr, seed=seed))
    if data_args.max_samples is not None:
        raw = raw.limit(data_args.max_samples)
    return align_rows(raw, attr, data_args.skip_bad_rows)


def _read_files(table, attr):
    """A Ray Data generator UDF: each named file's rows as blocks of READ_CHUNK_ROWS."""
    try:
        for path in table.column("path").to_pylist():
            yield from iter_file_tables(attr, path, READ_CHUNK_ROWS)
    except (DatasetRowError, DataConfigError) as err:  # whole to the driver, as common.user_code's UDFs do
        raise CarriedDataError(err) from None


def _check_first_example(train, rows, preprocess, stage: StageSpec, data_args: DataArguments) -> None:
    """Run the stream until its first tokenized example (one window, normally) so that data the stage
    cannot use fails here, on the driver, rather than inside every worker once training started."""
    with user_errors_raised():
        if train.take(1):
            return
    where = split_sources(data_args)[0]
    raise DataConfigError(nothing_left("training", where, rows.take(BATCH_SIZE), rows.count(), preprocess, stage))
