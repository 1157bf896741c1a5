"""Faults during a live sweep: each run is recorded with its cause and the sweep goes on.

Locust killed with SIGKILL mid-run is the load generator failing, not the server: the run is
``loadgen-failed`` with "load generator failed" and the exit status Locust died of, the next point is
measured, and nothing of the killed run's process groups is left. A server whose streams never end
(the scripted server in its endless mode, started by the serve playbook as the inventory's
vllm_executable) fails each point as ``failed-requests``, its requests cut and classified
``overlong_stream``, and the sweep ends with every point recorded and nothing left running.
Started as a user would (scripts/lab.py, its own process group: tests/support/sweep_run.py) on a
private inventory, the module's sweeps on one host folder (provisioned once); stopped by process
group only.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.processes import private_inventory
from tests.support.scripted_server import running
from tests.support.sweep_run import REPO, SETS, SweepRun, sweep
from vllm_lab import scenarios
from vllm_lab.backends import LiveBackend
from vllm_lab.serving import Instance
from vllm_lab.store import Store


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Path:
    """The host folder (lab_host_root) the module's sweeps share, as tests/test_sweep_e2e.py's
    ``lab``: the first sweep provisions it (a venv and the lab's wheel), the next finds it
    provisioned. Each test keeps its own inventory (port, vllm_executable), store and reports."""
    return tmp_path_factory.mktemp("host")


@pytest.mark.integration
def test_locust_killed_mid_run_is_a_loadgen_failed_run_with_its_cause_and_the_sweep_goes_on(tmp_path, host):
    inv = private_inventory(tmp_path, lab_host_root=str(host))
    killed: set[int] = set()

    def kill_locust_mid_run(run: SweepRun) -> None:
        """The first point's Locust groups, killed 3 s after they are first seen."""
        if killed or not run.groups:
            return
        time.sleep(3)  # mid-run
        killed.update(run.groups)
        for group in killed:
            os.killpg(group, signal.SIGKILL)

    with sweep(tmp_path, inv, "faults", "max-num-seqs", "2,4", SETS, during=kill_locust_mid_run) as run:
        assert killed, "the first point's Locust never started\n" + run.output
        assert run.returncode == 0, run.output
        assert "Traceback" not in run.output, run.output
        runs = Store(run.out / "lab.db").runs("faults")
        by_value = dict(zip(runs["point"].map(lambda p: p["max-num-seqs"]), zip(runs["status"], runs["error"])))
        status, error = by_value[2]
        assert status == "loadgen-failed" and error.startswith("load generator failed: locust exited with -9"), error
        assert by_value[4][0] == "ok", by_value
        # Nothing is left: the killed Locust's groups, the next point's, the lab's own.
        assert run.left_behind() == {}
    # The server was not to blame: the instance is given back as after any sweep.
    lock = host / "serve/run/main.lock"
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


@pytest.mark.integration
@pytest.mark.slow
def test_a_server_whose_streams_never_end_fails_each_point_with_its_cause_and_the_sweep_goes_on(tmp_path, host):
    pids = tmp_path / "servers.pids"
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, pids=str(pids),
                                     server=str(REPO / "tests/support/scripted_server.py")))
    fake.chmod(0o755)
    inv = private_inventory(tmp_path, lab_host_root=str(host), vllm_executable=str(fake))
    # The load swept, so both points run on one server start. Eight tokens asked: a stream is cut
    # past 2 * 8 + 16 = 32 of them, a fraction of a second; the warm-up's reply never ends either.
    sets = ["load.stop.duration_s=4", "workload.source=synthetic", "workload.input={dist: fixed, mean: 16}",
            "workload.output={dist: fixed, mean: 8}", "run.warmup_requests=1", "load.shape.level=1"]
    with sweep(tmp_path, inv, "endless", "load.shape.level", "1,2", sets, pids=pids) as run:
        output = run.output
        assert run.returncode == 0, output  # failed points are data: the sweep itself succeeded
        assert "Traceback" not in output, output
        with Store(run.out / "lab.db") as store:
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
        assert run.groups and len(run.servers) == 1
        assert run.left_behind() == {}


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
