"""Work split over a role's ranks and put back in rank order.

Its own module, with no imports, because every role actor process loads it (through
fabric/actor_group.py): importing it must not pull in the controller's loop and, through the
loop's log helpers, transformers' trainer and peft (about 2 s per actor process).
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def split_evenly(items: list[T], parts: int) -> list[list[T]]:
    """``parts`` contiguous slices whose sizes differ by at most one (the first ones are longer)."""
    if parts < 1:
        raise ValueError(f"split_evenly needs at least one part, got {parts}.")
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [list(items[bounds[i]:bounds[i + 1]]) for i in range(parts)]


def concat(results: list[list[T]]) -> list[T]:
    """The inverse of split_evenly: per-rank lists back into one, in rank order."""
    return [item for part in results for item in part]
