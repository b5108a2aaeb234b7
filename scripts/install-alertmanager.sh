#!/usr/bin/env bash
# Install a real Alertmanager and amtool into .tools/bin (idempotent), for the stack
# tests that deliver an alert from Prometheus through Alertmanager to a webhook.
#
# Source, in order:
#   1. already installed in .tools/bin and running: nothing to do;
#   2. ALERTMANAGER_BIN / AMTOOL_BIN, or alertmanager (or prometheus-alertmanager) and
#      amtool on PATH: linked;
#   3. Debian's `prometheus-alertmanager` package (it holds both binaries) from the
#      `unstable` suite, fetched and unpacked into .tools (scripts/debian-packages.sh:
#      a private, temporary apt state; nothing installed system-wide). That binary looks for its
#      templates in /usr/share/prometheus/alertmanager: see "relocated" below.
#
# .tools/bin/alertmanager runs the binary under its upstream name.
# Exit status: 0 when both binaries are in place, 1 otherwise (with a reason).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${OTEL_TRAINING_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
SUITE="${ALERTMANAGER_DEBIAN_SUITE:-unstable}"

log() { echo "install-alertmanager: $*" >&2; }

runs() {  # runs BINARY: it starts and reports a version
    [ -x "$1" ] && "$1" --version 2>&1 | head -n1 | grep -Eq 'version [0-9]+\.[0-9]+'
}

installed() { runs "$BIN/alertmanager" && runs "$BIN/amtool"; }

mkdir -p "$BIN"
if installed; then
    log "already installed: $("$BIN/alertmanager" --version 2>&1 | head -n1)"
    exit 0
fi

# --- 2. binaries given or on PATH ---------------------------------------------------
am="${ALERTMANAGER_BIN:-$(command -v alertmanager || command -v prometheus-alertmanager || true)}"
tool="${AMTOOL_BIN:-$(command -v amtool || true)}"
if [ -n "$am" ] && [ -n "$tool" ] && runs "$am" && runs "$tool"; then
    ln -sf "$(readlink -f "$am")" "$BIN/alertmanager"
    ln -sf "$(readlink -f "$tool")" "$BIN/amtool"
    log "linked $am and $tool"
    installed && exit 0
fi

# --- 3. Debian package from the unstable suite ------------------------------------------
DEBIAN_LOG_PREFIX=install-alertmanager
. "$ROOT/scripts/debian-packages.sh"
debian_unpack "$TOOLS/alertmanager-deb" "$SUITE" prometheus-alertmanager || exit 1
deb="$TOOLS/alertmanager-deb"
src="$deb/usr/bin"
[ -x "$src/prometheus-alertmanager" ] && [ -x "$src/amtool" ] || {
    log "prometheus-alertmanager or amtool not found in $DEBIAN_FETCHED"; exit 1; }
ln -sf "$src/amtool" "$BIN/amtool"
# Debian's build reads its notification templates (default.tmpl) from the absolute
# /usr/share/prometheus/alertmanager, which only a system-wide install provides. A copy
# of the binary reads them from the relative usr//share/prometheus/alertmanager instead
# (the same length, so the Go string stays valid; "//" is "/"), and a wrapper runs it
# from the unpacked package, where that relative path holds the templates.
python3 - "$src/prometheus-alertmanager" "$src/alertmanager-relocated" <<'PY' || exit 1
import sys
old, new = b"/usr/share/prometheus/alertmanager", b"usr//share/prometheus/alertmanager"
data = open(sys.argv[1], "rb").read()
if old not in data:
    sys.exit("install-alertmanager: the template path is not in the binary: nothing to relocate")
open(sys.argv[2], "wb").write(data.replace(old, new))
PY
chmod 755 "$src/alertmanager-relocated"
rm -f "$BIN/alertmanager"
{
    echo '#!/bin/sh'
    echo '# Debian'"'"'s Alertmanager, relocated by scripts/install-alertmanager.sh: it runs from'
    echo '# its unpacked package, where it finds its templates. Give it absolute paths.'
    printf 'cd "%s" && exec "%s" "$@"\n' "$deb" "$src/alertmanager-relocated"
} > "$BIN/alertmanager"
chmod 755 "$BIN/alertmanager"

if installed; then
    log "installed $DEBIAN_FETCHED: $("$BIN/alertmanager" --version 2>&1 | head -n1)"
    exit 0
fi
log "the unpacked binaries do not run:"
"$BIN/alertmanager" --version >&2 || true
exit 1
