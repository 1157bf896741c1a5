"""Benchmark: how much CPU does this host give vLLM and the load, side by side?

Before tuning on a rented GPU host, where vLLM's engine core, its API-server processes and the
load generator share one container. Prints the cores (a container's quota, else the affinity),
the physical cores among them (a core's SMT threads count once) and, for 1 … N busy processes side
by side, each one's rate against one alone and the seconds the quota throttled them: a rate that
falls before N reaches the cores is cores shared as hardware threads (or with other tenants);
throttled time is the quota.

    make bench NAME=host-cpu [ARGS="3 1,4,8,16"]     # seconds a step (default 3), process counts
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

from vllm_lab.traffic import host_cpu


def spin(seconds: float, out) -> None:
    """Count loop turns for ``seconds``: one process's rate of plain Python work."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for _ in range(10_000):
            n += 1
    out.put(n / seconds)


def step(count: int, seconds: float) -> tuple[float, float | None]:
    """The mean rate of ``count`` processes spinning side by side, and the throttled seconds."""
    out = mp.Queue()
    procs = [mp.Process(target=spin, args=(seconds, out)) for _ in range(count)]
    before = host_cpu.throttled_s()
    for p in procs:
        p.start()
    rates = [out.get() for _ in procs]
    for p in procs:
        p.join()
    after = host_cpu.throttled_s()
    throttled = None if before is None or after is None else after - before
    return sum(rates) / count, throttled


def main(argv: list[str]) -> int:
    seconds = float(argv[0]) if argv else 3.0
    cores = host_cpu.cpus()
    asked = {int(c) for c in argv[1].split(",")} if len(argv) > 1 else {
        max(1, int(cores) // 2), int(cores), int(cores) + 4}
    counts = sorted(asked | {1})  # one alone is what the others are read against
    physical = host_cpu.physical_cores()
    print(f"cores {cores:g} (quota, else affinity); physical cores "
          f"{physical if physical is not None else 'not said by the kernel'}")
    print(f"{'processes':>9}  {'rate each vs one alone':>22}  {'throttled s':>11}")
    alone = 0.0
    for count in counts:
        rate, throttled = step(count, seconds)
        alone = alone or rate
        shown = "no count" if throttled is None else f"{throttled:.2f}"
        print(f"{count:>9}  {rate / alone:>22.0%}  {shown:>11}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
