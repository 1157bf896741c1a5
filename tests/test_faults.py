"""Faults during a live run on the twin: the run is recorded with its cause and the sweep goes on.

Locust killed with SIGKILL mid-run is the load generator failing, not the server: the run is
``loadgen-failed`` with "load generator failed" and the exit status Locust died of, the next point is
measured, and nothing of the killed run's process groups is left. Started as a user would
(scripts/lab.py, its own process group) on a private inventory; stopped by process group only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import private_inventory, process_table
from vllm_lab.store import Store

REPO = Path(__file__).resolve().parent.parent
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


@pytest.mark.integration
def test_locust_killed_mid_run_is_a_loadgen_failed_run_with_its_cause_and_the_sweep_goes_on(tmp_path):
    inv = private_inventory(tmp_path)
    out = tmp_path / "reports"
    cmd = [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", "max-num-seqs",
           "--values", "2,4", "--hardware", "cpu-demo", "--inventory", str(inv), "--out", str(out),
           "--experiment", "faults", *[x for s in SETS for x in ("--set", s)]]
    lab = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 300
        groups: set[int] = set()
        while time.monotonic() < deadline and not groups:
            assert lab.poll() is None, lab.communicate()[0]
            groups = locust_groups(lab.pid)
            time.sleep(0.2)
        assert groups, "the first point's Locust never started"
        time.sleep(3)  # mid-run
        for group in groups:
            os.killpg(group, signal.SIGKILL)
        output, _ = lab.communicate(timeout=300)
    finally:
        if lab.poll() is None:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
    assert lab.returncode == 0, output
    assert "Traceback" not in output, output
    runs = Store(out / "lab.db").runs("faults")
    by_value = dict(zip(runs["point"].map(lambda p: p["max-num-seqs"]), zip(runs["status"], runs["error"])))
    status, error = by_value[2]
    assert status == "loadgen-failed" and error.startswith("load generator failed: locust exited with -9"), error
    assert by_value[4][0] == "ok", by_value
    left = [p for p, f in process_table().items() if int(f[2]) in groups and f[0] != "Z"]
    assert left == []
    # The server was not to blame: the instance is given back as after any sweep.
    lock = tmp_path / "host/serve/run/main.lock"
    assert not lock.exists() or not lock.read_text().strip()
