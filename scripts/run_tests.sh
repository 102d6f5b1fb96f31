#!/usr/bin/env bash
# Install RayFactory with its test extras into .venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
exec .venv/bin/python -m pytest -q "$@"
