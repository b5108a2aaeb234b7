#!/usr/bin/env bash
# The test suite (less the tests marked sdk_independent) on the lowest OpenTelemetry versions pyproject.toml allows
# (constraints-lowest.txt), in a virtualenv of its own (.venv-lowest), so .venv
# keeps the newest. Usage: scripts/test-sdk-lowest.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv-lowest/bin/python ]; then
  "$python" -m venv .venv-lowest
fi
# torch from this machine's shared installation (scripts/torch-shared.sh), not a copy in the venv.
bash scripts/torch-shared.sh .venv-lowest constraints-lowest.txt
# --no-compile: as in setup.sh.
.venv-lowest/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints-lowest.txt \
  torch -e ".[test,distro,integrations]"
.venv-lowest/bin/python -c "from importlib.metadata import version as v; print('lowest allowed: opentelemetry-sdk', v('opentelemetry-sdk'), '/ opentelemetry-instrumentation', v('opentelemetry-instrumentation'))"
# tests/test_package.py builds its own venv from constraints.txt: the same in both runs.
# Tests marked sdk_independent (tests/conftest.py) check nothing the SDK's version changes.
exec .venv-lowest/bin/python -m pytest -q -rs --ignore=tests/test_package.py -m "not sdk_independent" "$@"
