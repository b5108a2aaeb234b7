# Sourced by scripts/install-alertmanager.sh, install-chromium.sh and install-tmux.sh:
#
#   debian_apt_install PACKAGE
#
# installs PACKAGE system-wide with the system's apt (as root, or through password-less
# sudo), after `apt-get update` when apt does not know the package or the install fails
# (for tools that need the system's shared libraries). Returns 1 with a reason on stderr.
#
#   debian_unpack DEST SUITE PACKAGE...
#
# fetches the named Debian binary packages of SUITE with `apt-get download` through the
# Debian mirror this machine's apt already uses (read from /etc/apt at run time, or
# DEBIAN_MIRROR), with a private, temporary apt state, so the system's apt configuration
# and lists are left untouched; then unpacks them with `dpkg -x` into DEST (replaced).
# Nothing is installed system-wide. Returns 1 with a reason on stderr on failure;
# DEBIAN_FETCHED holds the names of the .deb files fetched.

debian_log() { echo "${DEBIAN_LOG_PREFIX:-debian-packages}: $*" >&2; }

debian_apt_install() {
    local pkg=$1
    local sudo=()
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            debian_log "not root and no password-less sudo: install Debian's $pkg (apt-get install $pkg)"
            return 1
        fi
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show "$pkg" >/dev/null 2>&1 || ! "${sudo[@]}" apt-get install -y -qq "$pkg" >/dev/null; then
        "${sudo[@]}" apt-get update -qq || { debian_log "apt-get update failed"; return 1; }
        "${sudo[@]}" apt-get install -y -qq "$pkg" >/dev/null || { debian_log "apt-get install $pkg failed"; return 1; }
    fi
}

debian_mirror() {
    # The first `deb` source serving the release's own suite (not -security/-updates),
    # from deb822 .sources or one-line .list files.
    local codename mirror
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
    [ -n "$mirror" ] || return 1
    echo "$mirror"
}

debian_unpack() {
    local dest="$1" suite="$2"
    shift 2
    command -v apt-get >/dev/null && command -v dpkg >/dev/null || {
        debian_log "apt-get/dpkg not available: cannot fetch Debian packages"; return 1; }
    local mirror
    mirror="$(debian_mirror)" || { debian_log "no Debian mirror found in /etc/apt (set DEBIAN_MIRROR)"; return 1; }

    # Private, temporary apt state (removed on return): the system's apt is untouched.
    local apt
    apt="$(mktemp -d "${TMPDIR:-/tmp}/debian-packages.XXXXXX")"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/sources.list.d" "$apt/debs"
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg signed=""
    [ -f "$keyring" ] && signed="[signed-by=$keyring] "
    echo "deb ${signed}${mirror} ${suite} main" > "$apt/sources.list"

    local opts=(
        -o "Dir::Etc::sourcelist=$apt/sources.list"
        -o "Dir::Etc::sourceparts=$apt/sources.list.d"
        -o "Dir::State::Lists=$apt/lists"
        -o "Dir::Cache=$apt/cache"
        -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
        -o "Debug::NoLocking=1"
        -o "APT::Get::List-Cleanup=0"
        -q
    )
    # Running as root, apt would hand downloads to the `_apt` user, which cannot write
    # into our private directories; download as the invoking user instead.
    [ "$(id -u)" = 0 ] && opts+=(-o "APT::Sandbox::User=root")

    debian_log "fetching $* from Debian $suite"
    if ! apt-get "${opts[@]}" update >"$apt/update.log" 2>&1; then
        debian_log "apt-get update for $suite failed:"; tail -n 5 "$apt/update.log" >&2
        rm -rf "$apt"; return 1
    fi
    if ! (cd "$apt/debs" && apt-get "${opts[@]}" download "$@") >"$apt/download.log" 2>&1; then
        debian_log "apt-get download $* failed:"; tail -n 5 "$apt/download.log" >&2
        rm -rf "$apt"; return 1
    fi
    rm -rf "$dest"
    local deb
    for deb in "$apt"/debs/*.deb; do
        dpkg -x "$deb" "$dest"
    done
    DEBIAN_FETCHED="$(cd "$apt/debs" && echo *.deb)"
    rm -rf "$apt"
}
