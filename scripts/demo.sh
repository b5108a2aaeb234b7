#!/usr/bin/env bash
# Fresh machine to a demo run: install, then train a small job and print its breakdown.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/otel-training demo "$@"
