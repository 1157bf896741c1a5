#!/usr/bin/env bash
# Runs a command, and everything it starts, at the lowest CPU priority this machine gives.
#
#   bash scripts/run-idle.sh COMMAND [ARG ...]
#
# Where a cpu cgroup can be made (root, with cgroup v1's cpu controller or v2's), the command runs
# in one marked cpu.idle: its processes get the cycles the rest of the machine leaves, and give a
# core back the moment another process wakes. Every process it starts stays in that cgroup, even
# one that opens a session of its own (a server, a Locust worker). The idle scheduling class or a
# nice value alone does not hold for those: where the kernel groups processes by session
# (autogroup, the default of most distributions), each new session is weighted as one ordinary
# task whatever its class, so a server the command starts would compete as an equal. Elsewhere
# the command runs in the idle class (chrt), else at nice 19.
set -u
cgroup=
for base in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup; do
  rmdir "$base"/vllm-lab-idle.* 2>/dev/null  # those a killed run left: only an empty one goes
  dir=$base/vllm-lab-idle.$$
  mkdir "$dir" 2>/dev/null || continue
  if echo 1 > "$dir/cpu.idle" 2>/dev/null && echo $$ > "$dir/cgroup.procs" 2>/dev/null; then
    cgroup=$dir
    break
  fi
  rmdir "$dir" 2>/dev/null
done

if [[ -z $cgroup ]]; then
  idle=()
  chrt --idle 0 true 2>/dev/null && idle=(chrt --idle 0)
  exec "${idle[@]}" nice -n 19 "$@"
fi

# Back to the parent, so the cgroup can go; one a stray process still holds stays (and is harmless).
leave() { echo $$ > "${cgroup%/*}/cgroup.procs" 2>/dev/null && rmdir "$cgroup" 2>/dev/null; }
trap leave EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"$@"
