#!/usr/bin/env bash
# Install RayFactory with its test extras into .venv and run the whole test suite.
# Prints each part's 30 slowest tests (--durations=30, pyproject's addopts), writes a JUnit XML report
# per part (.ci/last-junit-no-ray.xml, .ci/last-junit-ray.xml) and ends with the whole run's time and
# its 30 slowest tests (scripts/slowest_tests.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
# Programs some tests drive (Chromium for the web UI, tmux for the terminal chat, Go for the Ollama
# Modelfile's template); without them those tests skip (and fail under CI=true).
bash scripts/install_system_packages.sh || echo "run_tests.sh: some system packages are missing; the tests that need them will say so" >&2
mkdir -p .ci
if [ "$#" -gt 0 ]; then  # a chosen selection: one pytest run, as given
    exec .venv/bin/python -m pytest -q --junitxml=.ci/last-junit.xml "$@"
fi
# The default suite in two parts, each on two pytest-xdist workers with their share of the cores for
# torch (tests/conftest.py). First the tests that start no Ray; the shared caches they fill are locked
# (tests/locks.py). Then the Ray tests, a test file per worker at a time (--dist loadfile: a module's
# fixtures, a trained model or a serve app, are built once): each worker has its own local Ray,
# whose processes descend from it, and every port is chosen free. A Ray test is CPU-bound for about
# two thirds of its time (starting processes, waiting on them); two at once took 220 s where one at a
# time took 317 s (tests/e2e/test_grpo.py and test_user_errors.py). --no-loadscope-reorder: files are
# handed out in collection order, longest first (tests/conftest.py), not xdist's most-tests-first,
# which left the long one-test files for last.
status=0
.venv/bin/python -m pytest -q -n 2 -m "not slow and not ray" --junitxml=.ci/last-junit-no-ray.xml || status=$?
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and ray" --junitxml=.ci/last-junit-ray.xml || status=$?
.venv/bin/python scripts/slowest_tests.py .ci/last-junit-no-ray.xml .ci/last-junit-ray.xml --top 30 || true
exit "$status"
