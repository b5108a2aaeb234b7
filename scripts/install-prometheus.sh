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
#      (`prometheus`, `promtool`) are unpacked with `dpkg -x` into .tools.
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
command -v apt-get >/dev/null && command -v dpkg >/dev/null || {
    log "apt-get/dpkg not available: cannot fetch the Debian package"; exit 1; }

# The Debian mirror this machine uses: the first `deb` source serving the release's
# own suite (not -security/-updates), from deb822 .sources or one-line .list files.
codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
    mirror="$(
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -f "$f" ] || continue
            awk -v want="$codename" '
                function flush() {
                    if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "") {
                        n = split(suites, s, " ")
                        for (i = 1; i <= n; i++) if (s[i] == want) { split(uris, u, " "); print u[1]; exit }
                    }
                    types = uris = suites = ""; enabled = ""
                }
                /^[ \t]*$/ { flush(); next }
                /^Types:/   { sub(/^Types:[ \t]*/, "");   types = $0 }
                /^URIs:/    { sub(/^URIs:[ \t]*/, "");    uris = $0 }
                /^Suites:/  { sub(/^Suites:[ \t]*/, "");  suites = $0 }
                /^Enabled:/ { sub(/^Enabled:[ \t]*/, ""); enabled = tolower($0) }
                END { flush() }' "$f"
        done | head -n1
    )"
fi
if [ -z "$mirror" ]; then
    mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | sed -e 's/\[[^]]*\]//' \
        | awk -v want="$codename" '$1 == "deb" && $3 == want { print $2; exit }')"
fi
[ -n "$mirror" ] || { log "no Debian mirror found in /etc/apt (set DEBIAN_MIRROR)"; exit 1; }

# Private, temporary apt state (removed on exit): the system's apt is untouched.
APT="$(mktemp -d "${TMPDIR:-/tmp}/install-prometheus.XXXXXX")"
trap 'rm -rf "$APT"' EXIT
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/sources.list.d" "$APT/debs"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
signed=""
[ -f "$keyring" ] && signed="[signed-by=$keyring] "
echo "deb ${signed}${mirror} ${SUITE} main" > "$APT/sources.list"

opts=(
    -o "Dir::Etc::sourcelist=$APT/sources.list"
    -o "Dir::Etc::sourceparts=$APT/sources.list.d"
    -o "Dir::State::Lists=$APT/lists"
    -o "Dir::Cache=$APT/cache"
    -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
    -o "Debug::NoLocking=1"
    -o "APT::Get::List-Cleanup=0"
    -q
)
# Running as root, apt would hand downloads to the `_apt` user, which cannot write
# into our private directories; download as the invoking user instead.
[ "$(id -u)" = 0 ] && opts+=(-o "APT::Sandbox::User=root")

log "fetching the prometheus package from Debian $SUITE"
apt-get "${opts[@]}" update >"$APT/update.log" 2>&1 || {
    log "apt-get update for $SUITE failed:"; tail -n 5 "$APT/update.log" >&2; exit 1; }
# promtool is its own binary package in Debian.
(cd "$APT/debs" && apt-get "${opts[@]}" download prometheus promtool) >"$APT/download.log" 2>&1 || {
    log "apt-get download prometheus promtool failed:"; tail -n 5 "$APT/download.log" >&2; exit 1; }

rm -rf "$TOOLS/prometheus-deb"
for deb in "$APT"/debs/*.deb; do
    dpkg -x "$deb" "$TOOLS/prometheus-deb"
done
for name in prometheus promtool; do
    src="$TOOLS/prometheus-deb/usr/bin/$name"
    [ -x "$src" ] || { log "$name not found in $(ls "$APT"/debs)"; exit 1; }
    ln -sf "$src" "$BIN/$name"
done

if installed; then
    log "installed $(cd "$APT/debs" && echo *.deb): $("$BIN/prometheus" --version 2>&1 | head -n1)"
    exit 0
fi
log "the unpacked binaries do not run or are not 3.x:"
"$BIN/prometheus" --version >&2 || true
exit 1
