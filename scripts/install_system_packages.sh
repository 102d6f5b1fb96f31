#!/usr/bin/env bash
# The Debian packages the test suite drives as programs (the test command runs this):
#   chromium, chromium-driver  the web UI's browser tests (tests/webui)
#   tmux                       `rayfactory chat` in a real terminal (tests/inference/test_chat_cli.py)
#   golang-go                  the Ollama Modelfile's template run by Go's own text/template
#                              (tests/inference/test_gguf_export.py)
# Without them those tests skip with the reason, and fail under CI=true. Idempotent: a package whose
# command is already on PATH is not asked for, and with nothing missing apt-get does not run.
# Usage: install_system_packages.sh [PACKAGE ...] (default: all of the above).
set -euo pipefail

declare -A COMMAND=([chromium]=chromium [chromium-driver]=chromedriver [tmux]=tmux [golang-go]=go)
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=(chromium chromium-driver tmux golang-go)

missing=()
for package in "${wanted[@]}"; do
  command="${COMMAND[$package]:-$package}"
  if [ "$package" = golang-go ] && [ -x /usr/lib/go/bin/go ]; then  # Debian's go, not always on PATH
    continue
  fi
  command -v "$command" >/dev/null || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    echo "install_system_packages.sh: not root and no sudo: install ${missing[*]} yourself (the tests that need them skip)" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null; then
  echo "install_system_packages.sh: no apt-get here: install ${missing[*]} yourself (the tests that need them skip)" >&2
  exit 1
fi
# Quiet: apt's and debconf's output is shown only if the install fails.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "install_system_packages.sh: apt-get could not install ${missing[*]}" >&2
  exit 1
fi
