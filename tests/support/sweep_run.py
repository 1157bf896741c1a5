"""`scripts/lab.py sweep` as a user starts it, for the tests of faults during a live sweep: in its
own process group, its output to a file, Locust's process groups gathered while it runs, and what
is left of it once it ended. Everything is stopped by process id or group, never looked up by name.

    with sweep(tmp_path, inv, "faults", "max-num-seqs", "2,4", SETS, pids=...) as run:
        assert run.returncode == 0, run.output
        ...
        assert run.groups and run.left_behind() == {}
    # Only after a failure: what is left of the lab's, each Locust's and the servers' groups is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import process_table

REPO = Path(__file__).resolve().parents[2]

# serve.max-num-seqs=2: the scenario's own value is the first swept, so the sweep's reference
# point is one of its two points and no third server start joins them.
SETS = ["load.stop.duration_s=8", "workload.source=alpaca-like", "run.warmup_requests=1",
        "load.shape.level=2", "serve.max-num-seqs=2"]


def locust_groups(lab_pid: int) -> set[int]:
    """The process groups of the lab's Locust children (each run's Locust has a group of its own)."""
    groups = set()
    for pid, fields in process_table().items():
        if int(fields[1]) != lab_pid:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"locust" in cmdline:
            groups.add(int(fields[2]))
    return groups


def left_behind(lab_pid: int, groups: set[int], servers: list[int]) -> dict[int, int]:
    """Live processes of the lab's process group, of its Locust groups, or a server: pid -> group."""
    return {p: int(f[2]) for p, f in process_table().items()
            if f[0] != "Z" and (int(f[2]) in (lab_pid, *groups) or p in servers)}


@dataclass
class SweepRun:
    """One sweep as it ended: the lab's pid (its process group's id), exit status and output, the
    Locust groups seen while it ran and the servers' pids (each the leader of its own group)."""

    pid: int
    out: Path  # --out: the store (lab.db) and the reports
    returncode: int | None = None
    output: str = ""
    groups: set[int] = field(default_factory=set)
    servers: list[int] = field(default_factory=list)

    def left_behind(self) -> dict[int, int]:
        """Live processes of the lab's group, a Locust group or a server: pid -> group."""
        return left_behind(self.pid, self.groups, self.servers)


@contextlib.contextmanager
def sweep(folder: Path, inventory: Path, experiment: str, param: str, values: str, sets: list[str], *,
          pids: Path | None = None, during: Callable[[SweepRun], None] | None = None,
          timeout_s: float = 400) -> Iterator[SweepRun]:
    """Run `lab.py sweep --param PARAM --values VALUES` on cpu-demo and ``inventory`` to its end,
    its store and reports in ``folder``/reports, its output in ``folder``/lab.log (a file, not a
    pipe: the lab never waits on the test to read). ``during(run)`` is called after each look at
    the Locust groups while it runs; ``pids``, the file the inventory's vllm_executable writes each
    server's pid to. Yields the ended run to assert on; on leaving, whatever is left of the groups
    the test knows (the lab's, each Locust's, the servers') is killed: a failed test leaves nothing."""
    out = folder / "reports"
    cmd = [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", param, "--values", values,
           "--hardware", "cpu-demo", "--inventory", str(inventory), "--out", str(out),
           "--experiment", experiment, *[x for s in sets for x in ("--set", s)]]
    log = folder / "lab.log"
    with log.open("w") as sink:
        lab = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
                               process_group=0, env=dict(os.environ, PYTHONPATH=str(REPO)))
    run = SweepRun(pid=lab.pid, out=out)
    try:
        # Locust's process groups, gathered while the lab runs, to show none is left after it;
        # the bound only keeps a hang from holding the suite (a sweep takes a minute or two).
        deadline = time.monotonic() + timeout_s
        while lab.poll() is None and time.monotonic() < deadline:
            run.groups |= locust_groups(lab.pid)
            if during is not None:
                during(run)
            time.sleep(0.2)
        if lab.poll() is None:  # the sweep hung: killed, and its status says so
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
        run.returncode = lab.returncode
        run.servers = [int(p) for p in pids.read_text().split()] if pids and pids.exists() else []
        run.output = log.read_text()
        yield run
    finally:
        # Only after a failure: by the groups the test knows (the lab's, each Locust's, the servers').
        for group in {lab.pid, *run.groups, *run.servers} & set(run.left_behind().values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
