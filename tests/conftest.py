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


# The Ray test files that take longest (CI's JUnit, over ~80 s each), in that order. With
# --no-loadscope-reorder (scripts/run_tests.sh) pytest-xdist's --dist loadfile hands files to its
# two workers in collection order, so a long file collected last keeps one worker busy while the
# other has nothing left (xdist's own order, most tests first, put every long one-test file last).
# Starting the longest first leaves only short files for the end. A hint only: a file missing from
# it, or a stale order, costs time, never a result. test_rl_placement.py comes first because it
# replaces the worker's session Ray with a cluster of its own and back: run first, it precedes
# everything built on that Ray (module fixtures rebuild on the new one).
LONGEST_FIRST = (
    "e2e/test_rl_placement.py", "e2e/test_grpo_async.py", "webui/test_webui.py", "e2e/test_dpo.py",
    "e2e/test_rl_zero_ray.py", "e2e/test_grpo.py", "e2e/test_rl_resume.py", "e2e/test_job_submit.py",
    "e2e/test_console.py", "e2e/test_resume.py", "e2e/test_user_errors.py", "inference/test_serve_hardening.py",
    "inference/test_serve.py", "e2e/test_fault_tolerance.py", "e2e/test_grpo_multi_turn.py",
    "e2e/test_multinode.py", "e2e/test_ppo_remote_reward.py", "e2e/test_worker_parity.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts a real Ray with ``ray``, so ``pytest -m "not ray"`` is the fast
    loop: tests that use ``ray_session`` (directly or through another fixture) and everything
    under tests/e2e/. Then the longest files first (LONGEST_FIRST); the rest keep their order."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or Path(str(item.path)).is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.ray)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests_dir = Path(REPO_ROOT) / "tests"

    def place(item) -> int:
        path = Path(str(item.path))
        name = path.relative_to(tests_dir).as_posix() if path.is_relative_to(tests_dir) else ""
        return rank.get(name, len(rank))

    items.sort(key=place)  # stable: within a file, and among the unlisted files, the collected order holds


@pytest.fixture(scope="session")
def ray_session(request):
    """One real local Ray for the whole session (starting one costs ~6 s on 2 cores).

    Four logical CPUs: two 1-CPU train workers, plus room for Ray Data tasks and the Train
    controller on a 2-core machine.
    """
    if "not ray" in (request.config.option.markexpr or ""):
        # A test got past the ray marker (a fixture fetched with request.getfixturevalue is not in
        # its fixturenames): it would start Ray inside the fast loop and CI's Ray-free part.
        pytest.fail("a test selected by -m 'not ray' asked for ray_session: name the Ray fixture in the test's "
                    "signature or mark the test @pytest.mark.ray", pytrace=False)
    import ray

    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect

    connect(RayArguments(ray_num_cpus=4))
    yield ray
    from fabric.ray_session import shutdown

    shutdown()  # a second sooner than ray.shutdown()
