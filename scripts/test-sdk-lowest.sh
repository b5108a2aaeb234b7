#!/usr/bin/env bash
# The test suite on the lowest OpenTelemetry versions pyproject.toml allows
# (constraints-lowest.txt), then the newest (constraints.txt) put back, also when
# the run fails. Usage: scripts/test-sdk-lowest.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
otel=$(grep -o '^opentelemetry[a-z-]*' constraints-lowest.txt | tr '\n' ' ')
restore() { "${pip[@]}" -c constraints.txt $otel; }
trap restore EXIT
# shellcheck disable=SC2086
"${pip[@]}" -c constraints-lowest.txt $otel
.venv/bin/python -c "from importlib.metadata import version as v; print('OpenTelemetry SDK', v('opentelemetry-sdk'), '/ instrumentation', v('opentelemetry-instrumentation'))"
.venv/bin/python -m pytest -q -rs "$@"
