"""Small data tokenized in the driver process instead of Ray Data tasks (``preprocessing_engine``).

Ray Data runs its map tasks in a worker process and keeps a stats actor and an autoscaling
coordinator: three processes that each import Ray Data (and the first, Transformers) before
they tokenize a row, ~7 CPU-seconds that a run on a few cores spends beside its starting train
workers. The driver has the tokenizer loaded already (it checked the model before Ray started),
and tokenizes ~0.5-0.9 MiB of JSON rows a second here, so data of a few MiB is ready while the
workers still import their libraries. It runs the registries' in-process path (read, align, mix,
split: ``load_aligned``) and the stage's preprocess function over the same windows of BATCH_SIZE
aligned rows as the Ray Data pipeline: the same rows, in the same order
(tests/e2e/test_data_pipeline.py). The result is a Ray Dataset over the driver's tables, which
reach the workers as object refs exactly as Ray Data's blocks do.
"""

from __future__ import annotations

from typing import Optional

import ray

from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError
from registries.datasets.loading import load_aligned
from stages.table import StageSpec

from .common import BATCH_SIZE, nothing_left, split_sources, tokenized_block


def tokenized_in_driver(data_args: DataArguments, stage: StageSpec, seed: int, tokenizer,
                        template) -> tuple["ray.data.Dataset", Optional["ray.data.Dataset"]]:
    """The tokenized train and eval datasets (eval None without one)."""
    sources = split_sources(data_args)  # for the error when tokenizing leaves no example
    loaded = load_aligned(data_args, stage.name, stage.dataset_need, seed)
    preprocess = stage.preprocess_fn(tokenizer, template, data_args)
    train = _tokenized_split(loaded.train, preprocess, stage, "training", sources[0])
    if not (data_args.eval_dataset or data_args.val_size):
        return train, None
    return train, _tokenized_split(loaded.eval, preprocess, stage, "evaluation", sources[1])


def _tokenized_split(rows: list[dict], preprocess, stage: StageSpec, split: str, where: str) -> "ray.data.Dataset":
    """One table per window of BATCH_SIZE aligned rows, as Ray Data's blocks; a DataConfigError
    when no example is left."""
    import pyarrow as pa

    windows = (rows[start : start + BATCH_SIZE] for start in range(0, len(rows), BATCH_SIZE))
    tables = [pa.table(tokenized_block(preprocess({key: [row[key] for row in window] for key in window[0]})))
              for window in windows]
    tables = [table for table in tables if table.num_rows]
    if not tables:
        raise DataConfigError(nothing_left(split, where, rows[:BATCH_SIZE], len(rows), preprocess, stage))
    # Not ray.data.from_arrow: it reads each table's metadata in a Ray task, which starts a worker
    # process (~2 s of start-up on 2 busy cores). from_blocks takes it from the tables here.
    return ray.data.from_blocks(tables)
