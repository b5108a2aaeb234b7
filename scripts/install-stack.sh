#!/usr/bin/env bash
# Build the stack's binaries from upstream Go modules and link them into .tools/bin (and
# the cache's bin/, where `otel-training stack up` finds them without --bin-dir):
#   otelcol     the OpenTelemetry Collector, from scripts/stack/otelcol-builder.yaml
#               (exactly the components collector-config/*.yaml use), by the Collector Builder
#   prometheus  Prometheus 3 with its OTLP receiver, and promtool, of the same release
#   jaeger      Jaeger v2 (OTLP in, an HTTP query API): the trace store the tests put
#               where Tempo stands (Tempo and Grafana are AGPL: never built here)
# Versions: scripts/stack/versions.env (one file; docker-compose.yml's tags follow it).
#
# Built binaries are kept outside the clone, keyed by version and manifest, in
# $OTEL_TRAINING_CACHE_DIR (default ${XDG_CACHE_HOME:-~/.cache}/otel-training/stack), so a
# repeat, or another clone on the same machine, takes seconds. Go's module and build
# caches live there too while building and are emptied after a successful build
# (about 8 GB otherwise); OTEL_TRAINING_KEEP_GO_CACHES=1 keeps them.
# A binary given as OTELCOL_BIN, PROMETHEUS_BIN, PROMTOOL_BIN or JAEGER_BIN is linked
# instead of built (release binaries on a cluster without Go; docs/stack.md).
#
# Usage: scripts/install-stack.sh [otelcol|prometheus|jaeger ...]   (default: all three)
# Exit status: 0 when every binary asked for is in place, 1 otherwise (with the reason).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${OTEL_TRAINING_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
CACHE="${OTEL_TRAINING_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-training}/stack"
# shellcheck source=stack/versions.env
. "$ROOT/scripts/stack/versions.env"
MANIFEST="$ROOT/scripts/stack/otelcol-builder.yaml"

log() { echo "install-stack: $*" >&2; }

mkdir -p "$BIN" "$CACHE/bin"
export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOPATH="$CACHE/go/path"
export CGO_ENABLED=0 GOFLAGS="-trimpath -modcacherw" GOTOOLCHAIN=local
built_any=0

have_go() {
    command -v go >/dev/null 2>&1 || { log "no 'go' on PATH: cannot build $1 (give ${2}=PATH to a release binary instead)"; return 1; }
}

link() {  # link SOURCE NAME: .tools/bin/NAME and the cache's bin/NAME -> SOURCE, once SOURCE runs
    "$1" --version >/dev/null 2>&1 || "$1" version >/dev/null 2>&1 || { log "$1 does not run"; return 1; }
    ln -sfn "$1" "$BIN/$2"
    ln -sfn "$1" "$CACHE/bin/$2"  # where `otel-training stack up` looks after PATH
}

key() {  # key FILE...: a short hash of files' contents (the manifest is part of the key)
    cat "$@" | sha256sum | cut -c1-12
}

otelcol() {
    if [ -n "${OTELCOL_BIN:-}" ]; then link "$(readlink -f "$OTELCOL_BIN")" otelcol; return; fi
    local dir="$CACHE/otelcol-$OTELCOL_VERSION-$(key "$MANIFEST" "$ROOT/scripts/stack/versions.env")"
    if [ ! -x "$dir/otelcol-training" ]; then
        have_go otelcol OTELCOL_BIN || return 1
        local builder="$CACHE/builder-$OTELCOL_VERSION/builder"
        if [ ! -x "$builder" ]; then
            log "installing the Collector Builder v$OTELCOL_VERSION"
            GOBIN="$CACHE/builder-$OTELCOL_VERSION" go install "go.opentelemetry.io/collector/cmd/builder@v$OTELCOL_VERSION"
        fi
        local work; work="$(mktemp -d "$CACHE/otelcol-build.XXXXXX")"
        sed -e "s|\${OTELCOL_VERSION}|$OTELCOL_VERSION|g" -e "s|\${OTELCOL_CONTRIB_VERSION}|$OTELCOL_CONTRIB_VERSION|g" \
            -e "s|\${OTELCOL_PROVIDERS_VERSION}|$OTELCOL_PROVIDERS_VERSION|g" -e "s|\${OUTPUT_PATH}|$work/out|g" \
            "$MANIFEST" > "$work/manifest.yaml"
        log "building the Collector $OTELCOL_VERSION (8 components; about 2 minutes on 2 cores)"
        (cd "$work" && "$builder" --config=manifest.yaml --ldflags="-s -w") >"$work/build.log" 2>&1 || {
            tail -n 30 "$work/build.log" >&2; log "the Collector build failed (log: $work/build.log)"; return 1; }
        mkdir -p "$dir" && mv "$work/out/otelcol-training" "$dir/" && rm -rf "$work"
        built_any=1
    fi
    link "$dir/otelcol-training" otelcol
}

tools_module() {  # tools_module DIR PACKAGE@VERSION...: a module requiring the programs as tools
    local dir="$1"; shift
    mkdir -p "$dir"
    [ -f "$dir/go.mod" ] || (cd "$dir" && go mod init otel-training.local/stack-tools >/dev/null 2>&1)
    (cd "$dir" && for p in "$@"; do go get -tool "$p"; done)
}

prometheus() {
    if [ -n "${PROMETHEUS_BIN:-}" ] && [ -n "${PROMTOOL_BIN:-}" ]; then
        link "$(readlink -f "$PROMETHEUS_BIN")" prometheus && link "$(readlink -f "$PROMTOOL_BIN")" promtool; return; fi
    local dir="$CACHE/prometheus-$PROMETHEUS_VERSION"
    if [ ! -x "$dir/prometheus" ] || [ ! -x "$dir/promtool" ]; then
        have_go prometheus PROMETHEUS_BIN || return 1
        local tag="v0.$((10#${PROMETHEUS_VERSION%%.*} * 100 + 10#$(echo "$PROMETHEUS_VERSION" | cut -d. -f2))).${PROMETHEUS_VERSION##*.}"
        local src="$CACHE/src/prometheus-$PROMETHEUS_VERSION" m=github.com/prometheus/prometheus
        log "building Prometheus $PROMETHEUS_VERSION ($m@$tag) and promtool (about 5 minutes and 3.5 GB of memory on 2 cores)"
        tools_module "$src" "$m/cmd/prometheus@$tag" "$m/cmd/promtool@$tag"
        local v=github.com/prometheus/common/version
        (cd "$src" && go build -ldflags="-s -w -X $v.Version=$PROMETHEUS_VERSION -X $v.Branch=HEAD -X $v.BuildUser=otel-training" \
            -o "$src/out/" "$m/cmd/prometheus" "$m/cmd/promtool")
        mkdir -p "$dir" && mv "$src/out/prometheus" "$src/out/promtool" "$dir/" && rm -rf "$src"
        built_any=1
    fi
    link "$dir/prometheus" prometheus && link "$dir/promtool" promtool
}

jaeger() {
    if [ -n "${JAEGER_BIN:-}" ]; then link "$(readlink -f "$JAEGER_BIN")" jaeger; return; fi
    local dir="$CACHE/jaeger-$JAEGER_MODULE_VERSION"
    if [ ! -x "$dir/jaeger" ]; then
        have_go jaeger JAEGER_BIN || return 1
        local src="$CACHE/src/jaeger-$JAEGER_MODULE_VERSION" m=github.com/jaegertracing/jaeger
        log "building Jaeger v2 ($m@v$JAEGER_MODULE_VERSION; about 3.5 minutes on 2 cores)"
        tools_module "$src" "$m/cmd/jaeger@v$JAEGER_MODULE_VERSION"
        (cd "$src" && go build -ldflags="-s -w" -o "$src/out/" "$m/cmd/jaeger")
        mkdir -p "$dir" && mv "$src/out/jaeger" "$dir/" && rm -rf "$src"
        built_any=1
    fi
    link "$dir/jaeger" jaeger
}

wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=(otelcol prometheus jaeger)
# One build at a time per cache: two clones on one machine share it.
exec 9>"$CACHE/.lock"
flock 9
status=0
for name in "${wanted[@]}"; do
    case "$name" in
        otelcol|prometheus|jaeger) "$name" || { log "$name: not installed"; status=1; } ;;
        *) log "unknown binary '$name' (accepted: otelcol, prometheus, jaeger)"; exit 2 ;;
    esac
done
if [ "$built_any" = 1 ] && [ "${OTEL_TRAINING_KEEP_GO_CACHES:-0}" != 1 ]; then
    # The binaries are kept; the caches that made them are not needed for a repeat.
    go clean -cache >/dev/null 2>&1 || true
    go clean -modcache >/dev/null 2>&1 || true
fi
[ "$status" = 0 ] && log "in $BIN: $(cd "$BIN" && ls | tr '\n' ' ')"
exit "$status"
