"""Whether this test run is CI's: the one reading of the ``CI`` environment variable in tests/.

CI is on for "1", "true" or "yes" (any case, surrounding blanks ignored). There, a test whose
prerequisite is missing (a tool, a package, a registry) fails instead of skipping, so a check the
suite claims is never silently left out of CI.
"""

from __future__ import annotations

import os

import pytest

CI_VALUES = ("1", "true", "yes")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def skip_or_fail_in_ci(reason: str, allow_module_level: bool = False) -> None:
    """Skip the test (or, at module level, the module) on a developer's machine; fail it in CI.
    At module level the failure is a collection error, which fails the run."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: this must run in CI, so it is a failure, not a skip)", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)
