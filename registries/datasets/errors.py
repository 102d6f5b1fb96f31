"""The two kinds of data mistakes a user can make, each with an error that says where.

* ``DataConfigError``: the configuration is wrong (a DataArguments value, a dataset_info.json
  entry, a dataset that does not fit the stage). Raised before any row is read.
* ``DatasetRowError``: one row of one file is wrong. It carries the dataset, file, 1-based row
  and field so a user can open the file and go straight to the problem.

Both are ``registries.errors.UserError``s: front doors show their message without a traceback.
"""

from __future__ import annotations

from typing import Any

from registries.errors import UserError

SKIP_HINT = "Fix the row, or set skip_bad_rows: true to drop such rows and report them."


class DataConfigError(UserError):
    """A configuration mistake (arguments, dataset_info.json, stage requirements)."""


class DatasetRowError(UserError):
    """A bad row: ``row 17 of data/my.json (dataset 'my'): column 'output' is a list, expected a string``."""

    def __init__(self, dataset: str, file: str, row: int, field: str, problem: str):
        self.dataset = dataset
        self.file = file
        self.row = row
        self.field = field
        self.problem = problem
        super().__init__(f"{self.location}: {problem}. {SKIP_HINT}")

    @property
    def location(self) -> str:
        return f"row {self.row} of {self.file} (dataset {self.dataset!r})"

    @property
    def short(self) -> str:
        """One line without the hint, for skip reports that list many rows."""
        return f"{self.location}: {self.problem}"

    def __reduce__(self):
        # Ray ships exceptions between processes by pickling; the default reduce would call
        # __init__ with the single formatted message and fail.
        return (DatasetRowError, (self.dataset, self.file, self.row, self.field, self.problem))


def describe_type(value: Any) -> str:
    """JSON-flavoured type names with an article, as users see them in their files."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
