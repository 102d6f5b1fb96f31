"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray for the whole session (starting one costs ~6 s on 2 cores).

    Four logical CPUs: two 1-CPU train workers, plus room for Ray Data tasks and the Train
    controller on a 2-core machine.
    """
    import ray

    from fabric.args import RayArguments
    from fabric.ray_session import connect

    connect(RayArguments(ray_num_cpus=4))
    yield ray
    ray.shutdown()
