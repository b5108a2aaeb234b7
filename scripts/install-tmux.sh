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
SUDO=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        log "not root and no password-less sudo: install Debian's tmux (apt-get install tmux)"
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
install() { "${SUDO[@]}" apt-get install -y -qq tmux >/dev/null; }
if ! apt-cache show tmux >/dev/null 2>&1 || ! install; then
    "${SUDO[@]}" apt-get update -qq || { log "apt-get update failed"; exit 1; }
    install || { log "apt-get install tmux failed"; exit 1; }
fi
if tmux -V >/dev/null 2>&1; then
    log "installed: $(tmux -V)"
    exit 0
fi
log "tmux was installed but does not run"
exit 1
