#!/usr/bin/env bash
# The tests marked `core` (step detection, phases, throughput, FLOPs, memory, reliability,
# the trace file, the summary and report, the integrations) on both ends of the supported
# torch range: constraints-torch-floor.txt and constraints-torch-newest.txt, each in a
# virtualenv of its own (.venv-torch-floor, .venv-torch-newest) with torch's default build
# from the package index (a CUDA build, which runs on the CPU), from this machine's one
# shared installation of that release (scripts/torch-shared.sh: ~4.6 GB, made on first use,
# outside the clone; the venv itself holds the rest, under 1 GB). A venv that already holds
# the pinned torch is reused.
# `below` (constraints-torch-below.txt, a release under the floor) only builds its venv:
# tests/test_preflight.py runs a loop there and expects the one "not instrumenting" line.
# Usage: scripts/test-torch-range.sh [floor|newest|below]... [-- PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
ends=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do ends+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#ends[@]} -gt 0 ] || ends=(floor newest)
status=0
for end in "${ends[@]}"; do
  pins="constraints-torch-$end.txt"
  venv=".venv-torch-$end"
  start=$SECONDS
  # constraints.txt with this end's pins in place of its own (torch, and any framework
  # release that needs another torch).
  merged=$(mktemp)
  names=$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$pins" | tr '\n' '|')
  grep -v -E "^(${names%|})==" constraints.txt > "$merged"
  grep -E '^[A-Za-z0-9_.-]+==' "$pins" >> "$merged"
  want=$(sed -n 's/^torch==//p' "$pins")
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  # The shared torch of this end into the venv (a copy of its own, from a venv made before,
  # is dropped), so the check below sees the pinned release. PIP_CONSTRAINT: as below.
  PIP_CONSTRAINT=/dev/null bash scripts/torch-shared.sh "$venv" "$merged"
  have=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('torch'))" 2>/dev/null || true)
  # PIP_CONSTRAINT: a machine-wide pip constraint may cap torch below the newest release.
  if [ "${have%%+*}" != "$want" ] || [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
    extras=".[test,distro,integrations]"
    [ "$end" = below ] && extras="."  # the package and torch: what a user's environment has
    # --no-compile: as in setup.sh.
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
      -c "$merged" torch -e "$extras"
    touch "$venv/.installed"
  fi
  rm -f "$merged"
  "$venv/bin/python" -c "import torch; print('torch range, $end: torch', torch.__version__)" 2>/dev/null
  if [ "$end" != below ]; then
    # PIP_CONSTRAINT: tests/test_package.py installs this torch into a fresh venv of its own.
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pytest -q -rs -m core -p no:cacheprovider "$@" || status=$?
  fi
  echo "torch range, $end: $((SECONDS - start)) s"
done
exit "$status"
