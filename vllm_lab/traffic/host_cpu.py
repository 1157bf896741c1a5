"""The CPU the load generator's host gives the lab: how many cores, and how long a container's CPU
quota held everything on it back during a run.

A GPU host rented as a container may get fewer cores than it shows (a CFS quota, ``cpu.max``), and
where vLLM's engine core, its API-server processes and Locust share that quota, a run that asks for
more stalls them all at once: the engine's steps lengthen with the GPU idle, which reads as a slower
configuration, not as a starved host. The kernel counts that time (``throttled_usec`` in the
cgroup's ``cpu.stat``); a run records it beside its figures so two hosts of one GPU can be told
apart by what they are. Where the client runs on another host than the server (a fleet), these are
the client's host's figures.

Cores may also be hardware threads: where two of the cores a run may use are SMT siblings of one
physical core, they share its execution units, and a host of 16 such threads has 8 cores' worth of
work to share between vLLM and the load. A run records the physical cores among its cores too.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
SYSFS_CPU = Path("/sys/devices/system/cpu")
# A run its host's CPU quota stalled for more than this share of its sending is said to be (in the
# log and by make findings): its figures are the host's limit as much as the configuration's.
THROTTLED_SHARE_NOTED = 0.02


def cpus(root: Path = CGROUP) -> float:
    """Cores this process may use: a cgroup's quota where it sets one, else its CPU affinity."""
    cores = float(len(os.sched_getaffinity(0)))
    quota = _quota(root)
    return min(cores, quota) if quota else cores


def physical_cores(sysfs: Path = SYSFS_CPU) -> int | None:
    """Physical cores among the CPUs this process may run on: SMT siblings (one core's hardware
    threads) count once. None where the kernel does not say (no topology in sysfs)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        siblings = _first_text(sysfs / f"cpu{cpu}" / "topology",
                               ("core_cpus_list", "thread_siblings_list"))  # newer kernels, older
        if siblings is None:
            return None
        cores.add(siblings)
    return len(cores) or None


def _first_text(folder: Path, names: tuple[str, ...]) -> str | None:
    """The text of the first of ``names`` in ``folder`` that can be read (None where none can)."""
    for name in names:
        try:
            return (folder / name).read_text().strip()
        except OSError:
            continue
    return None


def throttled_s(root: Path = CGROUP) -> float | None:
    """Seconds the cgroup's quota has throttled it since it started (None where it has no count).

    cgroup v2 says ``throttled_usec`` in ``cpu.stat``; v1, ``throttled_time`` in nanoseconds in
    ``cpu/cpu.stat`` (or ``cpu,cpuacct/cpu.stat``).
    """
    stat = _read_stat(root / "cpu.stat")
    if "throttled_usec" in stat:
        return stat["throttled_usec"] / 1e6
    for v1 in ("cpu", "cpu,cpuacct"):
        stat = _read_stat(root / v1 / "cpu.stat")
        if "throttled_time" in stat:
            return stat["throttled_time"] / 1e9
    return None


def _quota(root: Path) -> float | None:
    """The quota in cores (v2 ``cpu.max``: "max 100000" or "400000 100000"; v1 the two files)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = float(quota), float(period)
    except ValueError:  # "max": no quota
        return None
    return q / p if q > 0 and p > 0 else None


def _read_stat(path: Path) -> dict[str, float]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stat = {}
    for line in lines:
        key, _, value = line.partition(" ")
        try:
            stat[key] = float(value)
        except ValueError:
            continue
    return stat
