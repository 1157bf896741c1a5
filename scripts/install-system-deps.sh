#!/usr/bin/env bash
# System packages the lab's tests need on a fresh Debian/Ubuntu machine. Idempotent: installs only what is missing.
#   openssh-server/openssh-client: the network-namespace test fleet (tests/test_fleet.py) runs its own sshd per host
#   iproute2: `ip netns` and veth pairs for that fleet
#   procps: ps/pgrep-free process checks (ps) used by the serving role's stop assertions
#   prometheus (prometheus + promtool), prometheus-node-exporter: make monitor and tests/test_monitor.py
#   chromium: prints the quarterly report's PDF (make report PERIOD=...) and renders screenshots
#   poppler-utils: pdftoppm, to look at the PDF's pages as pictures
#   fonts-dejavu-core: the report's font, so the PDF looks the same everywhere
#   postgresql: an Optuna study on PostgreSQL (STUDY_STORAGE), in tests/test_search.py
set -euo pipefail
PKGS=(openssh-server openssh-client iproute2 procps prometheus prometheus-node-exporter chromium
      poppler-utils fonts-dejavu-core postgresql)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-system-deps: all present (${PKGS[*]})"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-system-deps: installed ${missing[*]}"
