"""Ray Data: read -> align (map_batches) -> mix -> split -> tokenize + mask (map_batches).

The registries do the work (pure functions over column batches, seeded index plans for mixing
and splitting); this module only decides where it runs: small data in the driver process
(fabric/driver_tokenizing.py), the rest in Ray Data tasks across the cluster. Rows keep their
file order end to end, so the result equals running the same functions in one process
(tests/e2e/test_data_pipeline.py).
What the user should read (data ready, bad rows skipped, a reused tokenized_path) is logged at
INFO or above: the CLI's console shows this package's records.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import ray
from ray.exceptions import UserCodeException

from registries.datasets.aligner import ALIGNED_COLUMNS, align_batch, aligned_table, bad_rows_batch
from registries.datasets.args import DataArguments
from registries.datasets.errors import DataConfigError, DatasetRowError
from registries.datasets.info import get_dataset_attrs, train_and_eval_attrs
from registries.datasets.aligner import SHOWN_SKIPPED
from registries.datasets.loading import check_not_empty, report_skipped
from registries.datasets.mixing import mix_plan, split_plan
from registries.datasets.readers import data_files, read_table, source_paths
from registries.datasets.stage_fields import DATASET_NEEDS, check_stage_fields
from stages.table import StageSpec

from . import tokenized_cache

logger = logging.getLogger(__name__)

BATCH_SIZE = 512  # rows per tokenize call; also the window sft packing and pt blocks fill sequences from
# preprocessing_engine "auto" tokenizes in the driver (fabric/driver_tokenizing.py) up to this
# many bytes of data files, all datasets together: ~2-4 s of the driver's time here, hidden behind
# the workers' start. Beyond it, Ray Data's parallel tasks pay for their processes
# (benchmarks/README.md, "Small data in the driver").
DRIVER_MAX_BYTES = 2 * 2**20


def tokenizes_in_driver(data_args: DataArguments) -> bool:
    """Whether the driver tokenizes: ``preprocessing_engine: driver``, or "auto" with small local
    files (a hub dataset's size is not known before it is read: Ray Data reads it)."""
    if data_args.preprocessing_engine != "auto":
        return data_args.preprocessing_engine == "driver"
    attrs = train_and_eval_attrs(data_args)
    if any(attr.load_from != "file" for attr in attrs):
        return False
    return sum(os.path.getsize(path) for attr in attrs for path in data_files(attr)) <= DRIVER_MAX_BYTES


@dataclass
class PreparedData:
    train: "ray.data.Dataset"
    eval: Optional["ray.data.Dataset"]
    stats: dict


def check_data(data_args: DataArguments, stage: StageSpec) -> None:
    """The data mistakes that need no row read, raised before Ray starts any work: a dataset name
    dataset_info.json lacks, a missing file, a dataset that does not fit the stage (dpo on
    single answers). A reusable tokenized_path needs none of it."""
    if tokenized_cache.reusable(data_args):
        return
    if not data_args.dataset:
        raise DataConfigError(
            "Data arguments: dataset is not set, so there is nothing to train on. Set dataset to one or more "
            f"names from {os.path.join(data_args.dataset_dir, 'dataset_info.json')}, e.g. dataset: arith_train."
        )
    attrs = train_and_eval_attrs(data_args)
    check_stage_fields(attrs, stage.name, stage.dataset_need)
    source_paths(attrs)  # names a missing file or folder


def prepare_datasets(data_args: DataArguments, stage: StageSpec, seed: int, tokenizer, template) -> PreparedData:
    """Tokenized train (and eval) datasets, from ``tokenized_path`` when it already holds them.

    Equal, row for row, to the in-process path: ``load_aligned`` (read, align, mix, split) and
    then the stage's preprocess function over consecutive windows of BATCH_SIZE aligned rows.
    """
    fingerprint = None  # only a tokenized_path needs it (it stats every source file)
    if data_args.tokenized_path:
        fingerprint = tokenized_cache.fingerprint(data_args, stage, seed, tokenizer, template)
    reused = tokenized_cache.reusable(data_args)
    where = "by Ray Data"
    started = time.time()
    with pipeline_context():
        if reused:
            train, evaluation = tokenized_cache.load(data_args.tokenized_path, fingerprint)
        elif data_args.streaming:
            from .streaming_data import streamed_splits

            train, evaluation = streamed_splits(data_args, stage, seed, tokenizer, template)
        elif tokenizes_in_driver(data_args):
            from .driver_tokenizing import tokenized_in_driver

            where = "in the driver"
            train, evaluation = tokenized_in_driver(data_args, stage, seed, tokenizer, template)
        else:
            train, evaluation = _tokenized_splits(data_args, stage, seed, tokenizer, template)
    # A stream is never counted: that would run the whole pipeline once before training.
    train_count = None if data_args.streaming and not reused else train.count()
    stats = {"train_examples": train_count, "eval_examples": evaluation.count() if evaluation else 0}
    if reused:
        logger.info("reusing tokenized data from %s: %s", data_args.tokenized_path, stats)
    else:
        logger.info("data ready in %.1fs (tokenized %s): %s", time.time() - started, where, stats)
        if data_args.tokenized_path:
            tokenized_cache.save(data_args.tokenized_path, train, evaluation, fingerprint)
    return PreparedData(train, evaluation, stats)


def _tokenized_splits(data_args: DataArguments, stage: StageSpec, seed: int, tokenizer, template) -> tuple:
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


def split_sources(data_args: DataArguments) -> tuple[str, str]:
    """Where the training and the evaluation examples come from, in the user's words."""
    train = f"dataset {', '.join(data_args.dataset)}"
    if data_args.eval_dataset:
        return train, f"eval_dataset {', '.join(data_args.eval_dataset)}"
    return train, f"the val_size share of {train}"


def _tokenized_nonempty(rows, preprocess, stage: StageSpec, split: str, where: str) -> "ray.data.Dataset":
    """Tokenized rows, or a DataConfigError when none is left: that would reach Ray Train and
    fail there, four tracebacks deep."""
    result = tokenized(rows, preprocess)
    if result.count() == 0:
        raise DataConfigError(nothing_left(split, where, rows.take(BATCH_SIZE), rows.count(), preprocess, stage))
    return result


def nothing_left(split: str, where: str, sample: list[dict], total: int, preprocess, stage: StageSpec) -> str:
    """Why no tokenized example is left from ``total`` aligned rows: the stage's tokenizer counts
    what it skipped, and why, in ``sample`` (the first of them)."""
    stats: Counter = Counter()
    if sample:
        preprocess.func({k: [r[k] for r in sample] for k in sample[0]}, stats=stats, **preprocess.keywords)
    reasons = ", ".join(f"{k.removeprefix('skipped_').replace('_', ' ')}: {n}" for k, n in stats.items()) or "none"
    return (
        f"No {split} examples are left for stage {stage.name!r} from {where}: all {total} aligned rows were "
        f"dropped when tokenizing (rows skipped, by reason, in the first {len(sample)}: {reasons}). Stage "
        f"{stage.name!r} trains on {DATASET_NEEDS[stage.dataset_need]}: use a dataset of such rows."
    )


def aligned_mixed(names, data_args: DataArguments, stage: StageSpec, seed: int, lazy: bool = False) -> "ray.data.Dataset":
    """Every named dataset read and aligned (in Ray tasks), then mixed. ``lazy``: a lone dataset's
    alignment is left to run with what follows (mixing several reads their lengths, so they run)."""
    attrs = get_dataset_attrs(names, data_args.dataset_dir)
    check_stage_fields(attrs, stage.name, stage.dataset_need)  # before any work: dpo/rm need ranking, ...
    aligned = [_aligned(attr, data_args, seed) for attr in attrs]
    if lazy and len(aligned) == 1:
        return aligned[0]
    return _mix([_run(dataset) for dataset in aligned], data_args, seed)


def tokenized(rows, preprocess) -> "ray.data.Dataset":
    """Materialized, so training starts from blocks in the object store instead of competing with
    a running pipeline for CPUs."""
    return _run(tokenize_windows(rows, preprocess))


def tokenize_windows(rows, preprocess) -> "ray.data.Dataset":
    """Tokenize (lazily) in windows of exactly BATCH_SIZE rows (the last may be shorter): sft packing
    and pt blocks fill sequences within one window, so the windows must not depend on how Ray
    happened to cut blocks."""
    windows = rows.repartition(target_num_rows_per_block=BATCH_SIZE, strict=True)
    return windows.map_batches(
        functools.partial(_tokenize_block, preprocess=preprocess), batch_size=BATCH_SIZE, batch_format="pyarrow"
    )


def _aligned(attr, data_args: DataArguments, seed: int) -> "ray.data.Dataset":
    table = read_table(attr, data_args.max_samples, seed)
    check_not_empty(attr, table.num_rows)
    raw = ray.data.from_arrow(table)
    if data_args.skip_bad_rows:
        bad = _run(raw.map_batches(functools.partial(_bad_rows_block, attr=attr), batch_format="pyarrow"))
        if bad.count():
            report_skipped(attr, [r["_error"] for r in bad.take(SHOWN_SKIPPED)], bad.count(), raw.count())
    return align_rows(raw, attr, data_args.skip_bad_rows)


def align_rows(raw, attr, skip_bad_rows: bool) -> "ray.data.Dataset":
    """Raw rows (read_table's columns) -> aligned rows, lazily."""
    return raw.map_batches(functools.partial(_align_block, attr=attr, skip_bad_rows=skip_bad_rows), batch_format="pyarrow")


def _mix(datasets: list, data_args, seed) -> "ray.data.Dataset":
    if len(datasets) == 1:
        return datasets[0]
    if data_args.mix_strategy == "concat":
        return datasets[0].union(*datasets[1:])
    # Interleaving is a seeded plan over the datasets' lengths (the registries' mix_plan, which
    # load_aligned uses too); aligned rows are small text, so the driver applies it.
    plan = mix_plan([ds.count() for ds in datasets], data_args.mix_strategy, data_args.interleave_probs, seed)
    tables = [_to_table(ds) for ds in datasets]
    offsets = list(itertools.accumulate([0] + [t.num_rows for t in tables]))
    return ray.data.from_arrow(_concat(tables).take([offsets[d] + r for d, r in plan]))


def _split(rows, val_size, seed) -> tuple:
    train_rows, val_rows = split_plan(rows.count(), val_size, seed)
    table = _to_table(rows)
    return ray.data.from_arrow(table.take(train_rows)), ray.data.from_arrow(table.take(val_rows))


def _to_table(dataset):
    """A materialized dataset's rows as one pyarrow Table on the driver, in order."""
    return _concat(ray.get(dataset.to_arrow_refs()))


def _concat(tables):
    import pyarrow as pa

    return pa.concat_tables(tables) if tables else aligned_table({name: [] for name in ALIGNED_COLUMNS})


class CarriedDataError(UserCodeException):
    """A user's data mistake raised in a Ray Data task, carried whole to the driver.

    Ray Data wraps a UDF's exception in a UserCodeException that is pickled without its cause,
    so the driver would only see "UDF failed to process a data block" and a remote traceback.
    With ``raise_original_map_exception`` (see ``pipeline_context``) it passes this one on as
    is; being a UserCodeException, Ray Data still reports it as the user's, not as its own bug.
    """

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error

    def __reduce__(self):
        return (CarriedDataError, (self.error,))


def _udf(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (DatasetRowError, DataConfigError) as err:
            raise CarriedDataError(err) from None
        except Exception as err:  # what Ray Data itself does without raise_original_map_exception
            raise UserCodeException("UDF failed to process a data block.") from err

    return run


@contextlib.contextmanager
def pipeline_context():
    """The execution settings this pipeline relies on, whoever else uses Ray Data in the process.

    Datasets created inside copy the current DataContext, so they keep these settings:
    ``preserve_order`` (rows keep their file order: the windows that sft packing and pt blocks
    fill, the seeded split and the tokenized_path cache all depend on it) and
    ``raise_original_map_exception`` (a user's data error arrives whole, see ``CarriedDataError``).
    """
    context = ray.data.DataContext.get_current()
    saved = context.raise_original_map_exception, context.execution_options.preserve_order
    context.raise_original_map_exception = True
    context.execution_options.preserve_order = True
    try:
        yield
    finally:
        context.raise_original_map_exception, context.execution_options.preserve_order = saved


@_udf
def _align_block(table, attr, skip_bad_rows):
    return aligned_table(align_batch(table.to_pydict(), attr, skip_bad_rows))


@_udf
def _bad_rows_block(table, attr):
    import pyarrow as pa

    return pa.table(bad_rows_batch(table.to_pydict(), attr))


@_udf
def _tokenize_block(table, preprocess):
    return preprocess(table.to_pydict())


def _run(dataset) -> "ray.data.Dataset":
    """Materialize, turning a user's data error raised inside a Ray task back into itself."""
    with user_errors_raised():
        return dataset.materialize()


@contextlib.contextmanager
def user_errors_raised():
    """Running a pipeline inside: a user's data error raised in a Ray task comes out as itself."""
    try:
        yield
    except ray.exceptions.RayTaskError as err:
        cause = carried_user_error(err)
        if cause is not None:
            raise cause from None
        raise


def carried_user_error(err: BaseException) -> Optional[Exception]:
    """The data error a UDF raised: RayTaskError(CarriedDataError).cause is the CarriedDataError."""
    cause = getattr(err, "cause", None)
    return cause.error if isinstance(cause, CarriedDataError) else None
