"""The rule every registry here follows: one entry per name, a second one is a mistake."""

from __future__ import annotations

from typing import TypeVar

Entry = TypeVar("Entry")


def add_unique(table: dict[str, Entry], name: str, entry: Entry, kind: str) -> Entry:
    """Put ``entry`` under ``name``; ValueError if ``kind`` (e.g. "Stage") ``name`` exists already."""
    if name in table:
        raise ValueError(f"{kind} {name!r} is already registered.")
    table[name] = entry
    return entry
