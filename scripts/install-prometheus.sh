#!/usr/bin/env bash
# Install real Prometheus 3.x and promtool binaries into .tools/bin (idempotent).
#
# Source, in order:
#   1. already installed in .tools/bin and reporting version 3.x: nothing to do;
#   2. PROMETHEUS_BIN / PROMTOOL_BIN, or prometheus/promtool 3.x on PATH: linked;
#   3. Debian's `prometheus` package from the `unstable` suite, fetched with
#      `apt-get download` through the Debian mirror this machine's apt already uses
#      (read from /etc/apt at run time) with a private, temporary apt state, so
#      the system's apt configuration and lists are left untouched; the packages
#      (`prometheus`, `promtool`) are unpacked with `dpkg -x` into .tools
#      (scripts/debian-packages.sh).
#
# Debian builds Prometheus without the OTLP receiver; the tests load series with
# `promtool tsdb create-blocks-from openmetrics` instead (see tests/stack).
# Exit status: 0 when both binaries are in place, 1 otherwise (with a reason).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${OTEL_TRAINING_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
SUITE="${PROMETHEUS_DEBIAN_SUITE:-unstable}"

log() { echo "install-prometheus: $*" >&2; }

is_v3() {  # is_v3 BINARY: the binary runs and reports version 3.x
    [ -x "$1" ] && "$1" --version 2>&1 | head -n1 | grep -Eq 'version 3\.'
}

installed() { is_v3 "$BIN/prometheus" && is_v3 "$BIN/promtool"; }

mkdir -p "$BIN"
if installed; then
    log "already installed: $("$BIN/prometheus" --version 2>&1 | head -n1)"
    exit 0
fi

# --- 2. binaries given or on PATH ---------------------------------------------------
prom="${PROMETHEUS_BIN:-$(command -v prometheus || true)}"
tool="${PROMTOOL_BIN:-$(command -v promtool || true)}"
if [ -n "$prom" ] && [ -n "$tool" ] && is_v3 "$prom" && is_v3 "$tool"; then
    ln -sf "$(readlink -f "$prom")" "$BIN/prometheus"
    ln -sf "$(readlink -f "$tool")" "$BIN/promtool"
    log "linked $prom and $tool"
    installed && exit 0
fi

# --- 3. Debian package from the unstable suite ------------------------------------------
# promtool is its own binary package in Debian.
DEBIAN_LOG_PREFIX=install-prometheus
. "$ROOT/scripts/debian-packages.sh"
debian_unpack "$TOOLS/prometheus-deb" "$SUITE" prometheus promtool || exit 1
for name in prometheus promtool; do
    src="$TOOLS/prometheus-deb/usr/bin/$name"
    [ -x "$src" ] || { log "$name not found in $DEBIAN_FETCHED"; exit 1; }
    ln -sf "$src" "$BIN/$name"
done

if installed; then
    log "installed $DEBIAN_FETCHED: $("$BIN/prometheus" --version 2>&1 | head -n1)"
    exit 0
fi
log "the unpacked binaries do not run or are not 3.x:"
"$BIN/prometheus" --version >&2 || true
exit 1
