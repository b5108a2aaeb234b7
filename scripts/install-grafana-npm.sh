#!/usr/bin/env bash
# Install Grafana's Apache-2.0 npm packages, pinned to the compose file's Grafana
# (12.4.0), into .tools/grafana-npm for tests/stack/test_grafana_npm.py (idempotent).
#
#   @grafana/data    rangeutil: the frontend's interval rules
#   @grafana/schema  the dashboard and panel types (TypeScript declarations)
#   typescript       reads those declarations (the version @grafana/schema builds with)
#
# Versions and the whole tree are pinned by scripts/grafana-npm/package.json and its
# package-lock.json (written with --omit-lockfile-registry-resolved: npm fetches from
# whatever registry its configuration names, and checks each package's integrity).
# `npm ci` runs with --ignore-scripts: no package's install script runs. The download
# cache is outside the clone, in ${XDG_CACHE_HOME:-~/.cache}/otel-training/npm.
# Nothing of Grafana's server or of its AGPL frontend is installed.
# Exit status: 0 when the packages are in place, 1 otherwise (with a reason); the
# tests then skip, and under CI=true they fail.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/scripts/grafana-npm"
DEST="$ROOT/.tools/grafana-npm"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/otel-training/npm"

log() { echo "install-grafana-npm: $*" >&2; }

# The install is current when it was made from these exact package files.
want="$(cat "$SRC/package.json" "$SRC/package-lock.json" | sha256sum | cut -d' ' -f1)"
if [ -f "$DEST/.installed" ] && [ "$(cat "$DEST/.installed")" = "$want" ] \
    && [ -d "$DEST/node_modules/@grafana/data" ] && [ -d "$DEST/node_modules/@grafana/schema" ]; then
    log "already installed"
    exit 0
fi

command -v node >/dev/null || { log "node not found (Node.js 18 or later is needed)"; exit 1; }
command -v npm >/dev/null || { log "npm not found"; exit 1; }
major="$(node -p 'process.versions.node.split(".")[0]')"
[ "$major" -ge 18 ] || { log "node $(node --version) is too old (18 or later is needed)"; exit 1; }

mkdir -p "$DEST" "$CACHE"
rm -f "$DEST/.installed"
cp "$SRC/package.json" "$SRC/package-lock.json" "$DEST/"
if ! (cd "$DEST" && npm ci --no-audit --no-fund --ignore-scripts --prefer-offline \
        --loglevel=error --cache "$CACHE" >&2); then
    log "npm ci failed (offline, or the registry refused a package)"
    exit 1
fi
echo "$want" >"$DEST/.installed"
log "installed: $(cd "$DEST" && node -p 'const v = (n) => require(`./node_modules/${n}/package.json`).version;
    `@grafana/data ${v("@grafana/data")}, @grafana/schema ${v("@grafana/schema")}, typescript ${v("typescript")}`')"
