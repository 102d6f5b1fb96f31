"""Ray Data: read -> align (map_batches) -> mix -> split -> tokenize + mask (map_batches).

The registries do the work (pure functions over column batches, seeded index plans for mixing
and splitting); this module runs them in Ray Data tasks across the cluster. Rows keep their
file order end to end, so the result equals running the same functions in one process
(tests/e2e/test_data_pipeline.py).
"""

from __future__ import annotations

import functools
import itertools
import logging

import ray

from registries.datasets.aligner import (
    ALIGNED_COLUMNS, IMAGES_COLUMN, SHOWN_SKIPPED, align_batch, aligned_table, bad_rows_batch,
)
from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError
from registries.datasets.info import get_dataset_attrs
from registries.datasets.loading import check_not_empty, report_skipped
from registries.datasets.mixing import mix_plan, split_plan
from registries.datasets.readers import read_table
from registries.datasets.stage_fields import check_stage_fields
from stages.table import StageSpec

from .common import BATCH_SIZE, materialized, nothing_left, split_sources, tokenized_block, user_code

logger = logging.getLogger(__name__)

def tokenized_splits(data_args: DataArguments, stage: StageSpec, seed: int, tokenizer, template) -> tuple:
    preprocess = stage.preprocess_fn(tokenizer, template, data_args)
    # Without a val_size split, a lone dataset is aligned and tokenized in one Ray Data run.
    lazy = not data_args.val_size
    train = aligned_mixed(data_args.dataset, data_args, stage, seed, lazy)
    evaluation = aligned_mixed(data_args.eval_dataset, data_args, stage, seed, lazy) if data_args.eval_dataset else None
    if data_args.val_size:
        # Split aligned rows by the registries' seeded plan, as load_aligned does: the same seed
        # picks the same rows, and packing never puts a train and an eval example in one sequence.
        train, evaluation = _split(train, data_args.val_size, seed)
    train_source, eval_source = split_sources(data_args)
    return (
        _tokenized_nonempty(train, preprocess, stage, "training", train_source),
        _tokenized_nonempty(evaluation, preprocess, stage, "evaluation", eval_source) if evaluation is not None else None,
    )


def _tokenized_nonempty(rows, preprocess, stage: StageSpec, split: str, where: str) -> "ray.data.Dataset":
    """Tokenized rows, or a DataConfigError when none is left: that would reach Ray Train and
    fail there, four tracebacks deep."""
    result = tokenized(rows, preprocess)
    if result.count() == 0:
        raise DataConfigError(nothing_left(split, where, rows.take(BATCH_SIZE), rows.count(), preprocess, stage))
    return result


def aligned_mixed(names, data_args: DataArguments, stage: StageSpec, seed: int, lazy: bool = False) -> "ray.data.Dataset":
    """Every named dataset read and aligned (in Ray tasks), then mixed. ``lazy``: a lone dataset's
    alignment is left to run with what follows (mixing several reads their lengths, so they run)."""
    attrs = get_dataset_attrs(names, data_args.dataset_dir)
    check_stage_fields(attrs, stage.name, stage.dataset_need)  # before any work: dpo/rm need ranking, ...
    # Text datasets mixed with image datasets get an all-null _images column: one schema for all.
    images = any(attr.has_images for attr in attrs)
    aligned = [_aligned(attr, data_args, seed, images) for attr in attrs]
    if lazy and len(aligned) == 1:
        return aligned[0]
    return _mix([materialized(dataset) for dataset in aligned], data_args, seed, images)


def tokenized(rows, preprocess) -> "ray.data.Dataset":
    """Materialized, so training starts from blocks in the object store instead of competing with
    a running pipeline for CPUs."""
    return materialized(tokenize_windows(rows, preprocess))


def tokenize_windows(rows, preprocess) -> "ray.data.Dataset":
    """Tokenize (lazily) in windows of exactly BATCH_SIZE rows (the last may be shorter): sft packing
    and pt blocks fill sequences within one window, so the windows must not depend on how Ray
    happened to cut blocks."""
    windows = rows.repartition(target_num_rows_per_block=BATCH_SIZE, strict=True)
    return windows.map_batches(
        functools.partial(_tokenize_block, preprocess=preprocess), batch_size=BATCH_SIZE, batch_format="pyarrow"
    )


def _aligned(attr, data_args: DataArguments, seed: int, images: bool = False) -> "ray.data.Dataset":
    table = read_table(attr, data_args.max_samples, seed)
    check_not_empty(attr, table.num_rows)
    raw = ray.data.from_arrow(table)
    if data_args.skip_bad_rows:
        bad = materialized(raw.map_batches(functools.partial(_bad_rows_block, attr=attr), batch_format="pyarrow"))
        if bad.count():
            report_skipped(attr, [r["_error"] for r in bad.take(SHOWN_SKIPPED)], bad.count(), raw.count())
    return align_rows(raw, attr, data_args.skip_bad_rows, images)


def align_rows(raw, attr, skip_bad_rows: bool, images: bool = False) -> "ray.data.Dataset":
    """Raw rows (read_table's columns) -> aligned rows, lazily; ``images``: with an ``_images`` column
    even when this dataset has none (it is mixed with one that has)."""
    images = images or attr.has_images
    block = functools.partial(_align_block, attr=attr, skip_bad_rows=skip_bad_rows, images=images)
    return raw.map_batches(block, batch_format="pyarrow")


def _mix(datasets: list, data_args, seed, images: bool = False) -> "ray.data.Dataset":
    if len(datasets) == 1:
        return datasets[0]
    if data_args.mix_strategy == "concat":
        return datasets[0].union(*datasets[1:])
    # Interleaving is a seeded plan over the datasets' lengths (the registries' mix_plan, which
    # load_aligned uses too); aligned rows are small text, so the driver applies it.
    plan = mix_plan([ds.count() for ds in datasets], data_args.mix_strategy, data_args.interleave_probs, seed)
    tables = [_to_table(ds, images) for ds in datasets]
    offsets = list(itertools.accumulate([0] + [t.num_rows for t in tables]))
    return ray.data.from_arrow(_concat(tables, images).take([offsets[d] + r for d, r in plan]))


def _split(rows, val_size, seed) -> tuple:
    train_rows, val_rows = split_plan(rows.count(), val_size, seed)
    table = _to_table(rows, IMAGES_COLUMN in rows.columns())
    return ray.data.from_arrow(table.take(train_rows)), ray.data.from_arrow(table.take(val_rows))


def _to_table(dataset, images: bool = False):
    """A materialized dataset's rows as one pyarrow Table on the driver, in order."""
    return _concat(ray.get(dataset.to_arrow_refs()), images)


def _concat(tables, images: bool = False):
    """One table of aligned rows; with none (every block empty), an empty one of the aligned schema
    (with ``_images`` where the rows have images)."""
    import pyarrow as pa

    if tables:
        return pa.concat_tables(tables)
    return aligned_table({name: [] for name in ALIGNED_COLUMNS}, images=images)


@user_code
def _align_block(table, attr, skip_bad_rows, images=False):
    return aligned_table(align_batch(table.to_pydict(), attr, skip_bad_rows), images=images)


@user_code
def _bad_rows_block(table, attr):
    import pyarrow as pa

    return pa.table(bad_rows_batch(table.to_pydict(), attr))


@user_code
def _tokenize_block(table, preprocess):
    return tokenized_block(preprocess(table.to_pydict()))


