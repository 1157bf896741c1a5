"""Faults during a live sweep: each run is recorded with its cause and the sweep goes on.

Locust killed with SIGKILL mid-run is the load generator failing, not the server: the run is
``loadgen-failed`` with "load generator failed" and the exit status Locust died of, the next point is
measured, and nothing of the killed run's process groups is left. A server whose streams never end
(the scripted server in its endless mode, started by the serve playbook as the inventory's
vllm_executable) fails each point as ``failed-requests``, its requests cut and classified
``overlong_stream``, and the sweep ends with every point recorded and nothing left running.
Started as a user would (scripts/lab.py, its own process group) on a private inventory; stopped by
process group only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.processes import private_inventory, process_table
from tests.support.scripted_server import running
from vllm_lab import scenarios
from vllm_lab.backends import LiveBackend
from vllm_lab.serving import Instance
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


# `vllm serve --config FILE` as the inventory's vllm_executable (where an image's vLLM would be):
# the scripted server on the config's address, every stream endless; its pid written first (it
# execs: that pid is the server's, and the serve playbook makes it the leader of its own group).
FAKE_VLLM = '''#!{python}
import os, sys, yaml
cfg = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
with open({pids!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
os.execv(sys.executable, [sys.executable, {server!r}, "--host", cfg["host"], "--port", str(cfg["port"]),
                          "--mode", "endless", "--ttft-ms", "20", "--itl-ms", "5", "--no-precise"])
'''


def left_behind(lab_pid: int, groups: set[int], servers: list[int]) -> dict[int, int]:
    """Live processes of the lab's process group, of its Locust groups, or a scripted server:
    pid -> group."""
    return {p: int(f[2]) for p, f in process_table().items()
            if f[0] != "Z" and (int(f[2]) in (lab_pid, *groups) or p in servers)}


@pytest.mark.integration
@pytest.mark.slow
def test_a_server_whose_streams_never_end_fails_each_point_with_its_cause_and_the_sweep_goes_on(tmp_path):
    pids = tmp_path / "servers.pids"
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, pids=str(pids),
                                     server=str(REPO / "tests/support/scripted_server.py")))
    fake.chmod(0o755)
    inv = private_inventory(tmp_path, vllm_executable=str(fake))
    out = tmp_path / "reports"
    # The load swept, so both points run on one server start. Eight tokens asked: a stream is cut
    # past 2 * 8 + 16 = 32 of them, a fraction of a second; the warm-up's reply never ends either.
    sets = ["load.stop.duration_s=4", "workload.source=synthetic", "workload.input={dist: fixed, mean: 16}",
            "workload.output={dist: fixed, mean: 8}", "run.warmup_requests=1", "load.shape.level=1"]
    cmd = [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", "load.shape.level",
           "--values", "1,2", "--hardware", "cpu-demo", "--inventory", str(inv), "--out", str(out),
           "--experiment", "endless", *[x for s in sets for x in ("--set", s)]]
    log = tmp_path / "lab.log"  # a file, not a pipe: the lab never waits on the test to read
    with log.open("w") as sink:
        lab = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
                               process_group=0, env=dict(os.environ, PYTHONPATH=str(REPO)))
    groups: set[int] = set()
    servers: list[int] = []
    try:
        # Locust's process groups, gathered while the lab runs, to show none is left after it;
        # the bound only keeps a hang from holding the suite (the sweep takes a minute or two).
        deadline = time.monotonic() + 400
        while lab.poll() is None and time.monotonic() < deadline:
            groups |= locust_groups(lab.pid)
            time.sleep(0.2)
        if lab.poll() is None:  # the sweep hung: killed, and its status below says so
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
        servers = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        output = log.read_text()
        assert lab.returncode == 0, output  # failed points are data: the sweep itself succeeded
        assert "Traceback" not in output, output
        with Store(out / "lab.db") as store:
            runs = store.runs("endless")  # oldest first
            samples = [store.samples("endless", key) for key in runs["run_key"]]
        assert list(runs["point"].map(lambda p: p["load.shape.level"])) == [1, 2], output
        assert (runs["status"] == "failed-requests").all(), runs[["status", "error"]]
        for error in runs["error"]:
            assert "most: overlong_stream" in error and "the server ignores max_tokens" in error, error
        # Every request of both points was cut and classified; the second began after the first ended.
        assert all(len(s) and set(s["error"]) == {"overlong_stream"} for s in samples)
        assert runs["started"].iloc[1] >= runs["ended"].iloc[0]
        # Nothing the test started is left: the lab's process group, each Locust's, the server.
        assert groups and len(servers) == 1
        assert left_behind(lab.pid, groups, servers) == {}
    finally:
        # Only after a failure: by the groups the test knows (the lab's, each Locust's, the server's).
        for group in {lab.pid, *groups, *servers} & set(left_behind(lab.pid, groups, servers).values()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def metrics(url: str) -> str:
    """The scripted server's /metrics text."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["endless", "broken", "http500", "empty", "malformed"])
def test_a_warm_up_against_a_misbehaving_server_ends_and_lets_the_point_go_on(mode):
    """The warm-up after a start reads a reply with no stream parser to cut it: a reply that never
    ends is read only so far, and one cut off mid-body is the server's fault, not an exception."""
    scenario = scenarios.resolve("default", hardware="cpu-demo", overrides=["run.warmup_requests=2"])
    with running("--mode", mode, "--ttft-ms", "20", "--itl-ms", "5", "--no-precise") as url:
        instance = Instance(host="localhost", url=url, port=int(url.rsplit(":", 1)[1]), log_path="")
        LiveBackend("twin", REPO / "inventory/local.yml")._warm_up(scenario, instance)
        # Both reached the server, and the warm-up left no reply being sent (it closed the endless one).
        idle = 'vllm:num_requests_running{model_name="scripted"} 0'
        deadline = time.monotonic() + 30  # the server notices a closed socket at its next write
        while time.monotonic() < deadline and idle not in metrics(url):
            time.sleep(0.1)
        assert 'vllm:request_success_total{model_name="scripted"} 2' in metrics(url)
        assert idle in metrics(url)
