#!/usr/bin/env bash
# `make test` runs this first, so the whole suite runs rather than skipping what this machine lacks:
# the system programs the integration tests start are installed here (scripts/install-system-deps.sh)
# where root or passwordless sudo allows it; otherwise, or when the fleet tests cannot make network
# namespaces, it stops at once with one sentence naming what is missing and how to get it.
set -uo pipefail
cd "$(dirname "$0")/.."

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
have_initdb() { have initdb || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; }
have_chromium() { have chromium || have chromium-browser || have google-chrome || have google-chrome-stable; }

# A program the tests start -> the Debian package that brings it (and the tests that need it).
missing_packages() {
  local m=()
  have sshd || m+=("openssh-server (the fleet tests)")
  { have ssh && have ssh-keygen; } || m+=("openssh-client (the fleet tests)")
  have ip || m+=("iproute2 (the fleet tests)")
  have ps || m+=("procps (the serving tests)")
  { have prometheus && have promtool; } || m+=("prometheus (the monitoring tests)")
  have prometheus-node-exporter || m+=("prometheus-node-exporter (the monitoring tests)")
  have_chromium || m+=("chromium (the quarterly PDF and report browser tests)")
  have_initdb || m+=("postgresql (the Optuna-on-PostgreSQL test)")
  local IFS=","
  echo "${m[*]}"
}

can_install() {
  command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null; }
}

missing=$(missing_packages)
if [ -n "$missing" ] && can_install; then
  echo "make test: installing the system packages the tests need (scripts/install-system-deps.sh)"
  bash scripts/install-system-deps.sh || true
  missing=$(missing_packages)
fi
fail() { echo "make test: $1; or run make test-fast for the tests that start no process" >&2; exit 2; }
if [ -n "$missing" ]; then
  fail "missing ${missing//,/, }, and this machine gives no root or passwordless sudo to install them: run sudo scripts/install-system-deps.sh (Debian or Ubuntu) first"
fi
if [ "$(id -u)" -ne 0 ]; then
  fail "the network-namespace fleet tests (tests/test_fleet.py, tests/test_traffic_distributed.py) need root for ip netns: run make test as root, e.g. sudo make test or in a container"
fi
probe="labprobe$$"
if ! err=$(ip netns add "$probe" 2>&1); then
  fail "ip netns add fails here (${err}), so the fleet tests cannot run: use a machine or a privileged container that allows network namespaces"
fi
ip netns del "$probe"
echo "make test: system dependencies present, running every test"
