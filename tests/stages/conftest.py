"""Fixtures the stage tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def isolated():
    """The python sandbox isolates here; else the test skips, and fails under CI=true (tests/ci.py)."""
    from stages.rl.agents.sandbox import SandboxUnavailable, check_isolation
    from tests.ci import skip_or_fail_in_ci

    try:
        check_isolation()
    except SandboxUnavailable as exc:
        skip_or_fail_in_ci(f"this machine cannot isolate a sandboxed run ({exc.piece})")
