"""Datasets: dataset_info.json entries, file readers, the aligner, mixing and DataArguments.

Flow: ``DataArguments`` -> ``get_dataset_attrs`` -> ``check_stage_fields`` -> ``read_rows`` /
``read_table`` -> ``align_rows`` / ``align_batch`` -> ``mix`` / ``mix_plan`` -> ``train_val_split``.
``load_aligned`` runs all of it in one process.
"""

from .aligner import (
    ALIGNED_COLUMNS,
    AlignResult,
    align_batch,
    align_row,
    align_rows,
    aligned_schema,
    aligned_table,
    bad_rows_batch,
    skip_report,
)
from registries.datasets.data_args import DataArguments
from .errors import DataConfigError, DatasetRowError
from .formats import register_format
from .info import DatasetAttr, get_dataset_attrs, load_dataset_info, parse_entry
from .loading import LoadedData, load_aligned
from .mixing import mix, mix_plan, split_plan, train_val_split
from .readers import read_rows, read_table
from .stage_fields import check_stage_fields

__all__ = [
    "ALIGNED_COLUMNS",
    "AlignResult",
    "DataArguments",
    "DataConfigError",
    "DatasetAttr",
    "DatasetRowError",
    "LoadedData",
    "align_batch",
    "align_row",
    "align_rows",
    "aligned_schema",
    "aligned_table",
    "bad_rows_batch",
    "check_stage_fields",
    "get_dataset_attrs",
    "load_aligned",
    "load_dataset_info",
    "mix",
    "mix_plan",
    "parse_entry",
    "read_rows",
    "read_table",
    "register_format",
    "skip_report",
    "split_plan",
    "train_val_split",
]
