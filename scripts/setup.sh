#!/usr/bin/env bash
# Create .venv and install otel-training with its instruments extra (torch), numpy, and
# what the given extras need.
# Usage: scripts/setup.sh [EXTRAS]   (e.g. "test,distro,integrations")
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# torch is pinned through constraints.txt: a CPU build is enough for the demo and tests.
# It comes from this machine's one shared installation of that release, made on first use
# (scripts/torch-shared.sh: ~4.6 GB with its CUDA wheels, outside the clone); pip below
# finds it already satisfied.
bash scripts/torch-shared.sh .venv constraints.txt
# numpy: otel-training does not need it, but torch warns at the demo's first tensor without it.
# --no-compile: Python compiles what it imports, when it first imports it; compiling every
# installed file up front (transformers, lightning, ...) was most of pip's CPU time here.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt \
  -e ".[instruments${extras:+,$extras}]" numpy
