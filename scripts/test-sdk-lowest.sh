#!/usr/bin/env bash
# The test suite on the lowest OpenTelemetry versions pyproject.toml allows.
# Installs them into .venv, runs pytest, then puts the newest allowed back (also
# when the run fails). Usage: scripts/test-sdk-lowest.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
# The floors of pyproject.toml's OpenTelemetry requirements (~= 1.45, >= 0.66b1).
lowest=(
  "opentelemetry-api==1.45.0" "opentelemetry-sdk==1.45.0" "opentelemetry-proto==1.45.0"
  "opentelemetry-exporter-otlp==1.45.0" "opentelemetry-exporter-otlp-proto-grpc==1.45.0"
  "opentelemetry-exporter-otlp-proto-http==1.45.0" "opentelemetry-exporter-otlp-proto-common==1.45.0"
  "opentelemetry-instrumentation==0.66b1" "opentelemetry-distro==0.66b1"
  "opentelemetry-semantic-conventions==0.66b1" "opentelemetry-instrumentation-system-metrics==0.66b1"
)
restore() { "${pip[@]}" --upgrade --upgrade-strategy only-if-needed -e ".[test,distro,integrations]" torch; }
trap restore EXIT
"${pip[@]}" "${lowest[@]}"
.venv/bin/python -c "from importlib.metadata import version as v; print('lowest OpenTelemetry SDK:', v('opentelemetry-sdk'), 'instrumentation', v('opentelemetry-instrumentation'))"
.venv/bin/python -m pytest -q -rs "$@"
