#!/usr/bin/env bash
# Headless Chromium and its chromedriver, for the web UI's browser tests (tests/webui). Debian's
# packages: a fresh machine has no browser, and selenium must not download one.
# scripts/install_system_packages.sh installs them with the suite's other programs.
set -euo pipefail
exec bash "$(dirname "$0")/install_system_packages.sh" chromium chromium-driver
