"""Reusing tokenized data (``tokenized_path``): the datasets saved as parquet next to a
fingerprint of everything their rows depend on, so that a later run with other settings or
edited source files fails with what changed instead of training on stale rows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Optional

import ray

from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError
from registries.datasets.info import train_and_eval_attrs
from registries.datasets.readers import source_paths
from stages.table import StageSpec

logger = logging.getLogger(__name__)

META = "rayfactory_tokenized.json"


# DataArguments that do not change a single tokenized row; every other one is in the fingerprint,
# so a new data option is covered without anyone remembering to list it here.
# padding_free lays out batches, not rows; both preprocessing engines give the same rows.
ROW_NEUTRAL = ("tokenized_path", "overwrite_cache", "padding_free", "preprocessing_engine")


def fingerprint(data_args: DataArguments, stage: StageSpec, seed: int, tokenizer, template) -> dict:
    """What the tokenized rows depend on: every data setting, the stage's tokenization, the
    tokenizer and template, and each source file (dataset_info.json and the files it names)."""
    settings = {k: v for k, v in dataclasses.asdict(data_args).items() if k not in ROW_NEUTRAL}
    return {
        **settings,
        "stage": stage.name,
        "tokenize": stage.tokenize,
        "template": template.name,
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        # The seed picks the validation rows and the interleaving order; otherwise it changes nothing.
        "data_seed": seed if data_args.val_size or data_args.mix_strategy != "concat" else None,
        "files": _source_files(data_args),
    }


def _source_files(data_args: DataArguments) -> Optional[dict[str, list[int]]]:
    """path -> [size, mtime_ns] of every file the rows come from; None where they are not here
    (a cache made elsewhere and copied, with the data left behind)."""
    try:
        paths = source_paths(train_and_eval_attrs(data_args))
    except DataConfigError:
        return None
    return {path: [(info := os.stat(path)).st_size, info.st_mtime_ns] for path in sorted(paths)}


def reusable(data_args) -> bool:
    """``tokenized_path`` holds a saved run's data (whether it fits this run, load() checks)."""
    path = data_args.tokenized_path
    return bool(path) and not data_args.overwrite_cache and os.path.exists(os.path.join(path, META))


def save(path: str, train, evaluation, fingerprint: dict) -> None:
    """Write the tokenized datasets and, last, the fingerprint that marks the folder reusable."""
    # Ray's write_parquet appends files to a folder: clear what an earlier run wrote (only our
    # own entries), the marker first, so a crash mid-write never leaves a folder that looks reusable.
    for name in (META, "train", "eval"):
        target = os.path.join(path, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.remove(target)
    os.makedirs(path, exist_ok=True)
    train.write_parquet(os.path.join(path, "train"))
    if evaluation is not None:
        evaluation.write_parquet(os.path.join(path, "eval"))
    with open(os.path.join(path, META), "w", encoding="utf-8") as f:
        json.dump(fingerprint, f, indent=2)
    logger.info("tokenized data saved to %s; later runs reuse it", path)


def load(path: str, fingerprint: dict) -> tuple["ray.data.Dataset", Optional["ray.data.Dataset"]]:
    """The saved train and eval datasets, materialized; a DataConfigError if the settings or the
    source files changed since they were saved."""
    with open(os.path.join(path, META), encoding="utf-8") as f:
        saved = json.load(f)
    changed = sorted(k for k in fingerprint if k != "files" and saved.get(k) != fingerprint[k])
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {fingerprint[k]!r}" for k in changed)
        raise DataConfigError(
            f"tokenized_path {path} was made with different settings ({details}). Set "
            "overwrite_cache: true to tokenize again into it, or point tokenized_path at a new folder."
        )
    files = fingerprint["files"]
    if files is None:
        logger.warning("the source data is not here; reusing %s as it was saved", path)
    elif files != saved.get("files"):
        was = saved.get("files") or {}
        edited = [f for f in files if was.get(f) != files[f]] + [f for f in was if f not in files]
        raise DataConfigError(
            f"tokenized_path {path} was made from other data: {', '.join(edited)} changed since (size or "
            "modification time). Set overwrite_cache: true to tokenize the current data into it, or point "
            "tokenized_path at a new folder."
        )
    train = ray.data.read_parquet(os.path.join(path, "train"))
    eval_dir = os.path.join(path, "eval")
    evaluation = ray.data.read_parquet(eval_dir) if os.path.isdir(eval_dir) else None
    return train.materialize(), evaluation.materialize() if evaluation is not None else None
