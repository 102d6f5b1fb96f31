#!/usr/bin/env bash
# Install RayFactory into .venv and run the quickstart: LoRA sft of an embedded tiny model on our
# synthetic arithmetic data, 2 Ray Train workers on a local Ray, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/rayfactory train configs/quickstart.yaml "$@"
