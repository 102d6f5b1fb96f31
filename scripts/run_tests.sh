#!/usr/bin/env bash
# Install RayFactory with its test extras into .venv and run the whole test suite.
# Prints the 30 slowest tests (--durations=30, pyproject's addopts) and writes a JUnit XML report
# of the run to .ci/last-junit.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
# Programs some tests drive (Chromium for the web UI, tmux for the terminal chat, Go for the Ollama
# Modelfile's template); without them those tests skip (and fail under CI=true).
bash scripts/install_system_packages.sh || echo "run_tests.sh: some system packages are missing; the tests that need them will say so" >&2
mkdir -p .ci
exec .venv/bin/python -m pytest -q --junitxml=.ci/last-junit.xml "$@"
