#!/usr/bin/env bash
# Install Debian's `tmux` for the live view's terminal tests (tests/test_top.py drives
# `otel-training top` in a real terminal: send-keys, capture-pane). Idempotent.
#
# Source, in order: `tmux` on PATH that runs: nothing to do; else `apt-get install tmux`
# (as root, or through password-less sudo), after `apt-get update` when apt does not
# know the package or the install fails. Exit status: 0 when tmux runs, 1 otherwise
# (with a reason); the terminal tests then skip, and under CI=true they fail.
set -euo pipefail

log() { echo "install-tmux: $*" >&2; }

if command -v tmux >/dev/null && tmux -V >/dev/null 2>&1; then
    log "already installed: $(tmux -V)"
    exit 0
fi
DEBIAN_LOG_PREFIX=install-tmux
. "$(dirname "$0")/debian-packages.sh"
debian_apt_install tmux || exit 1
if tmux -V >/dev/null 2>&1; then
    log "installed: $(tmux -V)"
    exit 0
fi
log "tmux was installed but does not run"
exit 1
