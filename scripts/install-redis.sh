#!/usr/bin/env bash
# Installs redis-server from Debian's packages: the job store tests start real ones
# (tests/server/redis_support.py). Needs root (CI runs .ci/run as root); a no-op when it is
# already installed. Tests skip without it only outside CI.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[install-redis] redis-server is missing; as root: apt-get install -y redis-server" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends redis-server >/dev/null
# The package may start a system service where an init system runs; the tests start their own.
redis-server --version
