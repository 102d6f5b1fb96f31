"""Where the data is prepared: the one entry point, and the choice between the ways.

Tokenized train (and eval) datasets come from ``tokenized_path`` when it already holds them
(cache.py), else from a lazy stream (``streaming: true``, streaming.py), else from the driver
process for small files (tokenize_in_driver.py), else from Ray Data tasks across the cluster (ray_data.py).
Every way gives the same rows in the same order (tests/e2e/test_data_pipeline.py).
What the user should read (data ready, bad rows skipped, a reused tokenized_path) is logged at
INFO or above: the CLI's console shows this package's records.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import ray

from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError
from registries.datasets.info import train_and_eval_attrs
from registries.datasets.readers import data_files, source_paths
from registries.datasets.stage_fields import check_stage_fields
from stages.table import StageSpec

from . import cache
from .common import pipeline_context
from fabric.data.tokenize_in_driver import tokenized_in_driver
from .ray_data import tokenized_splits
from .streaming import streamed_splits

logger = logging.getLogger(__name__)

# preprocessing_engine "auto" tokenizes in the driver (tokenize_in_driver.py) up to this
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
    if cache.reusable(data_args):
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
        fingerprint = cache.fingerprint(data_args, stage, seed, tokenizer, template)
    reused = cache.reusable(data_args)
    where = "by Ray Data"
    started = time.time()
    with pipeline_context():
        if reused:
            train, evaluation = cache.load(data_args.tokenized_path, fingerprint)
        elif data_args.streaming:
            train, evaluation = streamed_splits(data_args, stage, seed, tokenizer, template)
        elif tokenizes_in_driver(data_args):
            where = "in the driver"
            train, evaluation = tokenized_in_driver(data_args, stage, seed, tokenizer, template)
        else:
            train, evaluation = tokenized_splits(data_args, stage, seed, tokenizer, template)
    # A stream is never counted: that would run the whole pipeline once before training.
    train_count = None if data_args.streaming and not reused else train.count()
    stats = {"train_examples": train_count, "eval_examples": evaluation.count() if evaluation else 0}
    if reused:
        logger.info("reusing tokenized data from %s: %s", data_args.tokenized_path, stats)
    else:
        logger.info("data ready in %.1fs (tokenized %s): %s", time.time() - started, where, stats)
        if data_args.tokenized_path:
            cache.save(data_args.tokenized_path, train, evaluation, fingerprint)
    return PreparedData(train, evaluation, stats)
