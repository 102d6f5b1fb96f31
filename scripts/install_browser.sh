#!/usr/bin/env bash
# Headless Chromium and its chromedriver, for the web UI's browser tests (tests/webui). Debian's
# packages: a fresh machine has no browser, and selenium must not download one.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "install_browser.sh: not root and no sudo: install chromium and chromium-driver yourself (the browser tests skip without them)" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null; then
  echo "install_browser.sh: no apt-get here: install Chromium and a matching chromedriver on PATH yourself" >&2
  exit 1
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver >/dev/null
