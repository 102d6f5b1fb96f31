"""Typed access to one raw row, where every wrong value becomes a DatasetRowError naming it.

The format aligners read values only through ``RowContext``, so each check is written once
and every message has the same shape: ``row 17 of data/my.json (dataset 'my'): column
'output' is a list, expected a string``.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from .errors import DatasetRowError, describe_type
from .info import DatasetAttr

_MISSING = object()


class RowContext:
    def __init__(self, attr: DatasetAttr, record: Any, file: str, row: int):
        self.attr = attr
        self.record = record
        self.file = file
        self.row = row

    def fail(self, field: str, problem: str) -> NoReturn:
        raise DatasetRowError(self.attr.name, self.file, self.row, field, problem)

    # ------------------------------------------------------------------ raw values
    def value(self, column: str, required: bool) -> Any:
        """The column's value; None when absent or null and not required."""
        value = self.record.get(column, _MISSING)
        if value is _MISSING or value is None:
            if required:
                state = "is missing" if value is _MISSING else "is null"
                have = ", ".join(repr(k) for k in self.record) or "none"
                self.fail(column, f"column {column!r} {state} (the row has columns: {have})")
            return None
        return value

    def text(self, column: str | None, required: bool = False) -> str:
        """A string column; absent or null reads as "" unless required."""
        if column is None:
            return ""
        value = self.value(column, required)
        if value is None:
            return ""
        if not isinstance(value, str):
            self.fail(column, f"column {column!r} is {describe_type(value)}, expected a string")
        return value

    def structured(self, column: str, value: Any, expected: type, what: str) -> Any:
        """A list/object value; a JSON string of one is decoded (csv and some parquet files store them so)."""
        if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                self.fail(column, f"column {column!r} is a string that is not valid JSON ({err.msg}), expected {what}")
        if not isinstance(value, expected):
            self.fail(column, f"column {column!r} is {describe_type(value)}, expected {what}")
        return value

    # ------------------------------------------------------------------ shared columns
    def system(self) -> str:
        return self.text(self.attr.column("system"))

    def tools(self) -> str:
        """Tools as JSON text of a list (or one object) of function schemas; "" when none."""
        column = self.attr.column("tools")
        if column is None:
            return ""
        value = self.value(column, required=False)
        if value is None or value == "" or value == []:
            return ""
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as err:
                problem = f"column {column!r} is not valid JSON ({err.msg}), expected a JSON list of function schemas"
                self.fail(column, problem)
        else:
            parsed = value
        if not isinstance(parsed, (list, dict)):
            self.fail(column, f"column {column!r} is {describe_type(parsed)}, expected a JSON list of function schemas")
        for i, tool in enumerate(parsed if isinstance(parsed, list) else [parsed]):
            if not isinstance(tool, dict) or not ("name" in tool or isinstance(tool.get("function"), dict)):
                self.fail(f"{column}[{i}]", f"tool {i} in column {column!r} is not a function schema with a 'name'")
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    def kto_tag(self) -> bool | None:
        """None unless the dataset has a kto_tag column; then the row's true/false label."""
        column = self.attr.column("kto_tag")
        if column is None:
            return None
        value = self.value(column, required=True)
        if isinstance(value, bool):
            return value
        # csv cells are strings and some exports write labels as 0/1.
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        self.fail(column, f"column {column!r} is {value!r}, expected true or false")
