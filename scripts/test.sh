#!/usr/bin/env bash
# Fresh machine to a full test run: install everything (package, test tools,
# framework integrations, real Prometheus + promtool), then run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,distro,integrations"
bash scripts/install-prometheus.sh
export PATH="$PWD/.tools/bin:$PATH"
exec .venv/bin/python -m pytest -q -rs "$@"
