"""Mixing several datasets into one, and carving a validation split off it. Seeded, no Ray.

Both work as index *plans* over row counts, so the Ray layer can apply the same plan to Ray
datasets (or the driver to plain lists with ``mix`` / ``train_val_split``).

Strategies (the semantics of ``datasets.interleave_datasets``):

* ``concat``: every row of dataset 0, then dataset 1, ...
* ``interleave_under``: draw the next row from dataset i (round-robin, or with probability
  ``probs[i]``); each dataset is read in order; stop when a draw hits a dataset that has run out.
  Big datasets are under-sampled.
* ``interleave_over``: as above, but a dataset that runs out starts again from its first row;
  stop once every dataset has been read to its end at least once. Small datasets are over-sampled.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from typing import Sequence, TypeVar

from registries.datasets.data_args import MIX_STRATEGIES
from .errors import DataConfigError

T = TypeVar("T")


def mix_plan(
    sizes: Sequence[int], strategy: str = "concat", probs: Sequence[float] | None = None, seed: int = 42
) -> list[tuple[int, int]]:
    """The mixed order as (dataset index, row index) pairs."""
    if strategy not in MIX_STRATEGIES:
        raise DataConfigError(f"mix_strategy is {strategy!r}; expected one of {', '.join(MIX_STRATEGIES)}.")
    if strategy == "concat":
        return [(d, r) for d, size in enumerate(sizes) for r in range(size)]
    if probs is not None and len(probs) != len(sizes):
        raise DataConfigError(
            f"interleave_probs has {len(probs)} values for {len(sizes)} datasets; give one per dataset."
        )
    if len(sizes) == 1:
        return [(0, r) for r in range(sizes[0])]
    if any(size == 0 for size in sizes):
        empty = [i for i, s in enumerate(sizes) if s == 0]
        raise DataConfigError(f"Cannot interleave: dataset(s) at position {empty} have no rows left after loading.")

    pick = _picker(len(sizes), probs, seed)
    position = [0] * len(sizes)
    finished = [False] * len(sizes)  # read to the end at least once
    plan: list[tuple[int, int]] = []
    while True:
        d = pick()
        if position[d] == sizes[d]:
            if strategy == "interleave_under":
                return plan
            position[d] = 0  # over-sampling: start this dataset again
        plan.append((d, position[d]))
        position[d] += 1
        if position[d] == sizes[d]:
            finished[d] = True
            if strategy == "interleave_over" and all(finished):
                return plan


def mix(
    datasets: Sequence[Sequence[T]], strategy: str = "concat", probs: Sequence[float] | None = None, seed: int = 42
) -> list[T]:
    return [datasets[d][r] for d, r in mix_plan([len(ds) for ds in datasets], strategy, probs, seed)]


def val_count(n_rows: int, val_size: float) -> int:
    """How many of ``n_rows`` go to validation: a fraction (rounded up) or a row count."""
    if val_size <= 0:
        return 0
    count = math.ceil(val_size * n_rows) if val_size < 1 else int(val_size)
    if count >= n_rows:
        raise DataConfigError(
            f"val_size {val_size} asks for {count} validation rows, but the training data has only {n_rows}; "
            "lower val_size so some rows remain for training."
        )
    return count


def split_plan(n_rows: int, val_size: float, seed: int = 42) -> tuple[list[int], list[int]]:
    """(train indices, validation indices), each ascending; a seeded random choice of rows."""
    count = val_count(n_rows, val_size)
    order = list(range(n_rows))
    random.Random(seed).shuffle(order)
    return sorted(order[count:]), sorted(order[:count])


def train_val_split(rows: Sequence[T], val_size: float, seed: int = 42) -> tuple[list[T], list[T]]:
    train, val = split_plan(len(rows), val_size, seed)
    return [rows[i] for i in train], [rows[i] for i in val]


def _picker(n: int, probs: Sequence[float] | None, seed: int):
    if probs is None:
        cycle = itertools.cycle(range(n))
        return lambda: next(cycle)
    rng = random.Random(seed)
    bounds = list(itertools.accumulate(probs))
    # bisect on the running sum; min() guards a last bound just under 1.0 from float rounding.
    return lambda: min(bisect.bisect_right(bounds, rng.random() * bounds[-1]), n - 1)
