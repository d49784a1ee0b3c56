#!/usr/bin/env bash
# `redis.sh ensure`: put a redis-server binary on PATH for the remote-tier tests.
# The tests start their own server on a free loopback port, so a system service is never
# wanted: if the Debian package starts one, it is stopped again. Where nothing can be
# installed (no root, no apt), say so in one line and succeed: the Redis tests skip (CI fails).
set -euo pipefail

if [[ "${1:-}" != ensure ]]; then
    echo "usage: bash scripts/redis.sh ensure" >&2
    exit 2
fi

command -v redis-server >/dev/null 2>&1 && exit 0

skip() {
    echo "redis.sh: redis-server is not installed and $1; tests needing Redis will be skipped outside CI"
    exit 0
}

command -v apt-get >/dev/null 2>&1 || skip "there is no apt-get to install it"
if [[ "$(id -u)" -eq 0 ]]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    skip "installing it needs root (no password-less sudo)"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
apt() {
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get "$@" >>"$log" 2>&1
}

# The package lists may be stale or absent (fresh container): refresh only when needed.
if ! apt install -y -q redis-server; then
    if ! { apt update -q && apt install -y -q redis-server; }; then
        tail -n 20 "$log" >&2
        skip "apt-get could not install it (output above)"
    fi
fi

# Stop the service the package may have started (systemd hosts start it on install).
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then
    "${as_root[@]}" systemctl stop redis-server >>"$log" 2>&1 || true
elif command -v service >/dev/null 2>&1 && service redis-server status >/dev/null 2>&1; then
    "${as_root[@]}" service redis-server stop >>"$log" 2>&1 || true
fi

if ! command -v redis-server >/dev/null 2>&1; then
    tail -n 20 "$log" >&2
    skip "the redis-server package did not put it on PATH"
fi
