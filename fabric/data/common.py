"""What every way of preparing the data shares: the tokenizing window, where a split's rows come
from, why none is left, and a user's data error carried whole out of a Ray task.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Optional

import ray
from ray.exceptions import UserCodeException

from registries.datasets.data_args import DataArguments
from registries.datasets.errors import DataConfigError, DatasetRowError
from registries.datasets.stage_fields import DATASET_NEEDS
from registries.tokenize.vision import image_columns
from stages.table import StageSpec

BATCH_SIZE = 512  # rows per tokenize call; also the window sft packing and pt blocks fill sequences from


def tokenized_block(columns: dict[str, list]):
    """A tokenize function's output as the block both engines store: with images, a pyarrow Table
    whose image columns have fixed types (registries/tokenize/vision.py image_columns), so blocks
    unify and the patches are never Python floats; without, the columns as they are (Ray Data
    builds the block, the driver calls pa.table, as for any text stage)."""
    import pyarrow as pa

    typed = image_columns(columns)
    return columns if typed is columns else pa.table(typed)


def split_sources(data_args: DataArguments) -> tuple[str, str]:
    """Where the training and the evaluation examples come from, in the user's words."""
    train = f"dataset {', '.join(data_args.dataset)}"
    if data_args.eval_dataset:
        return train, f"eval_dataset {', '.join(data_args.eval_dataset)}"
    return train, f"the val_size share of {train}"


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


def user_code(fn):
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


def materialized(dataset) -> "ray.data.Dataset":
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
