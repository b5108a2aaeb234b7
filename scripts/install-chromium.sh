#!/usr/bin/env bash
# Install Debian's `chromium` for the HTML report's browser test (idempotent).
#
# Source, in order:
#   1. OTEL_TRAINING_CHROMIUM, or `chromium` on PATH, that runs: nothing to do;
#   2. `apt-get install chromium` (as root, or through password-less sudo), after
#      `apt-get update` when apt does not know the package or the install fails.
#
# Chromium needs dozens of shared libraries, so unlike Prometheus it is installed
# system-wide, not unpacked into .tools. The test (tests/test_html_report.py) runs it
# headless with the network off. Exit status: 0 when chromium runs, 1 otherwise (with
# a reason); offline, the browser test then skips, and under CI=true it fails.
set -euo pipefail

log() { echo "install-chromium: $*" >&2; }
runs() { [ -n "$1" ] && "$1" --headless --no-sandbox --version >/dev/null 2>&1; }

have="${OTEL_TRAINING_CHROMIUM:-$(command -v chromium || true)}"
if runs "$have"; then
    log "already installed: $("$have" --version 2>/dev/null | head -n1)"
    exit 0
fi

DEBIAN_LOG_PREFIX=install-chromium
. "$(dirname "$0")/debian-packages.sh"
debian_apt_install chromium || exit 1
if runs "$(command -v chromium || true)"; then
    log "installed: $(chromium --version 2>/dev/null | head -n1)"
    exit 0
fi
log "chromium was installed but does not run"
exit 1
