#!/usr/bin/env bash
# Fresh machine to a demo run: install, then train a small job and print its breakdown.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# A child process, not exec: an exec'd process keeps this shell's start time, and the
# demo's start-up (process start to the first step) would hold the installation.
.venv/bin/otel-training demo "$@"
