"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# Every end-to-end test starts Ray one way or another: the ray_session fixture, the rayfactory CLI
# in a subprocess (which starts its own local Ray), or `ray start --head`.
E2E_DIR = Path(REPO_ROOT) / "tests" / "e2e"


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker gets its share of the cores for torch's threads
    (set before any test imports torch): N workers of all-core thread pools on a 2-core machine
    would spend their time waiting on each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts a real Ray with ``ray``, so ``pytest -m "not ray"`` is the fast
    loop: tests that use ``ray_session`` (directly or through another fixture) and everything
    under tests/e2e/."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or Path(str(item.path)).is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray for the whole session (starting one costs ~6 s on 2 cores).

    Four logical CPUs: two 1-CPU train workers, plus room for Ray Data tasks and the Train
    controller on a 2-core machine.
    """
    import ray

    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect

    connect(RayArguments(ray_num_cpus=4))
    yield ray
    from fabric.ray_session import shutdown

    shutdown()  # a second sooner than ray.shutdown()
