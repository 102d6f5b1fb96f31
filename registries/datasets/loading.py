"""The whole data path in one process: names -> checked attrs -> rows -> aligned -> mixed -> split.

The Ray layer runs the same steps distributed (read_table -> map_batches(align_batch) -> mix
and split plans); this in-process version serves tests, small runs and the web UI preview.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .aligner import SHOWN_SKIPPED, align_rows, skipped_summary, with_images_column
from registries.datasets.data_args import DataArguments
from .errors import DataConfigError, DatasetRowError
from .info import DatasetAttr, get_dataset_attrs
from .mixing import mix, train_val_split
from .readers import read_rows
from .stage_fields import check_stage_fields

logger = logging.getLogger(__name__)


@dataclass
class LoadedData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    skipped: list[DatasetRowError] = field(default_factory=list)


def load_aligned(args: DataArguments, stage: str, need: str = "plain", seed: int = 42) -> LoadedData:
    """``need`` is what the stage needs each dataset to carry (stage_fields.DATASET_NEEDS)."""
    train_attrs = get_dataset_attrs(args.dataset, args.dataset_dir)
    eval_attrs = get_dataset_attrs(args.eval_dataset, args.dataset_dir)
    check_stage_fields(train_attrs + eval_attrs, stage, need)  # fail before reading anything

    skipped: list[DatasetRowError] = []
    train = _load_mixed(train_attrs, args, seed, skipped)
    evaluation = _load_mixed(eval_attrs, args, seed, skipped)
    if args.val_size > 0:
        train, evaluation = train_val_split(train, args.val_size, seed)
    return LoadedData(train, evaluation, skipped)


def load_one(attr: DatasetAttr, args: DataArguments, seed: int, skipped: list[DatasetRowError]) -> list[dict[str, Any]]:
    rows = read_rows(attr, args.max_samples, seed)
    check_not_empty(attr, len(rows))
    result = align_rows(rows, attr, args.skip_bad_rows)
    if result.skipped:
        skipped += result.skipped
        report_skipped(attr, [e.short for e in result.skipped[:SHOWN_SKIPPED]], len(result.skipped), len(rows))
    return result.examples


def report_skipped(attr: DatasetAttr, shown: list[str], skipped: int, total: int) -> None:
    """Rows skipped by skip_bad_rows, reported; skipping every row means the entry is wrong."""
    if skipped == total:
        raise DataConfigError(
            f"Dataset {attr.name!r}: all {total} rows were bad and skipped, e.g. {shown[0]}. "
            f"Check its entry in {attr.info_path} (formatting, columns, tags)."
        )
    logger.warning("dataset %r: %s", attr.name, skipped_summary(shown, skipped, total))


def check_not_empty(attr: DatasetAttr, rows: int) -> None:
    """A dataset whose source holds no rows is a mistake in the config, not an empty run."""
    if rows == 0:
        raise DataConfigError(
            f"Dataset {attr.name!r} is empty: {attr.source} (file_name in {attr.info_path}) holds no rows. "
            "Fill it, or remove the dataset from the config."
        )


def _load_mixed(attrs: list[DatasetAttr], args: DataArguments, seed: int, skipped: list) -> list[dict[str, Any]]:
    parts = [load_one(attr, args, seed, skipped) for attr in attrs]
    if any(attr.has_images for attr in attrs):  # one set of columns when text and image datasets mix
        parts = [with_images_column(part) for part in parts]
    return mix(parts, args.mix_strategy, args.interleave_probs, seed) if parts else []
