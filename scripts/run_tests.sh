#!/usr/bin/env bash
# Install RayFactory with its test extras into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
# The web UI's tests drive a real headless Chromium; without one they skip (and fail under CI=true).
bash scripts/install_browser.sh || echo "run_tests.sh: no headless Chromium; the browser tests will say so" >&2
exec .venv/bin/python -m pytest -q "$@"
