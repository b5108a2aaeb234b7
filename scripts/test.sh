#!/usr/bin/env bash
# Fresh machine to a full test run: install everything (package, test tools,
# framework integrations, the real stack: Collector, Prometheus + promtool, Jaeger,
# Alertmanager + amtool),
# check lint, format and types, then run the tests on the newest OpenTelemetry
# versions pyproject.toml allows and again on the lowest, and the core tests on the
# lowest and the newest torch release the package supports.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
took() { echo "test.sh: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }  # CONTRIBUTING.md's table of parts
bash scripts/setup.sh "test,distro,integrations"
took "the package's set-up"
# The real stack for the stack tests, built from upstream Go modules (scripts/stack/):
# the Collector, Prometheus with its OTLP receiver and promtool, Jaeger. Cached outside
# the clone: minutes the first time on a machine, seconds after. Offline, those tests
# skip with the reason; under CI=true they fail instead, so CI never passes without them.
bash scripts/install-stack.sh || echo "test.sh: could not build the stack; stack tests will skip (or fail in CI)" >&2
took "the stack's binaries"
# Real Alertmanager + amtool for the alert delivery test, installed the same way.
bash scripts/install-alertmanager.sh || echo "test.sh: could not install Alertmanager; its tests will skip (or fail in CI)" >&2
# Grafana's Apache-2.0 npm packages (@grafana/data, @grafana/schema) for the checks of the
# dashboards and interval rules against Grafana's own code and types (no Grafana server runs).
bash scripts/install-grafana-npm.sh || echo "test.sh: could not install Grafana's npm packages; their tests will skip (or fail in CI)" >&2
# Debian's chromium for the HTML report's browser test, installed the same way.
bash scripts/install-chromium.sh || echo "test.sh: could not install Chromium; the browser test will skip (or fail in CI)" >&2
# Debian's tmux for the live view's terminal tests (tests/test_top.py), installed the same way.
bash scripts/install-tmux.sh || echo "test.sh: could not install tmux; the live view's terminal tests will skip (or fail in CI)" >&2
export PATH="$PWD/.tools/bin:$PATH"
# The checks people use: ruff (lint + format) and mypy, on the package.
.venv/bin/ruff check otel_training
.venv/bin/ruff format --check otel_training
.venv/bin/mypy
took "the other tools and checks"
status=0
# A torch below the supported range, for tests/test_preflight.py (a venv, no tests of its own).
bash scripts/test-torch-range.sh below || status=$?
took "below the floor"
# The suite includes the package as a user gets it (tests/test_package.py): sdist and wheel
# built and twine-checked, the wheel run from a fresh virtual environment.
.venv/bin/python -m pytest -q -rs "$@" || status=$?
took "the suite, newest SDK"
bash scripts/test-sdk-lowest.sh "$@" || status=$?
took "the suite, lowest SDK"
# The tests marked `core` on both ends of the supported torch range (docs/configuration.md, "Supported versions").
bash scripts/test-torch-range.sh floor newest -- "$@" || status=$?
took "torch range"
exit "$status"
