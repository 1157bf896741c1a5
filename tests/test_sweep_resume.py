"""A sweep on the live twin whose server is killed mid-point: that point is crashed, the one before
it kept, and a resume measures only what is missing (tests/support/e2e.py runs the CLI)."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.support.e2e import REPO, lab_cmd, private_lab, runs_by_value
from tests.support.processes import server_pid
from vllm_lab.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return private_lab(tmp_path_factory)


def test_killed_server_is_a_crashed_point_and_resume_finishes(lab):
    # Three users on four sequences or more: no queue, so 12 s of load is a steady run.
    args = lab_cmd(lab, "--set", "serve.max-num-seqs=4", "--values", "4,8", "--experiment", "e2e-crash",
                   "--set", "load.shape.level=3", "--set", "load.stop.duration_s=12")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        store_path = lab / "reports/lab.db"
        deadline = time.time() + 300
        # Wait until the first point is recorded and the second point's load is running.
        while time.time() < deadline:
            if store_path.exists() and len(Store(store_path).runs("e2e-crash")) == 1:
                break
            time.sleep(0.5)
        pid = None
        while time.time() < deadline and pid is None:
            work = lab / "reports/.work/e2e-crash"
            if len(list(work.glob("*/samples"))) >= 2:
                pid = server_pid(lab)
            time.sleep(0.3)
        assert pid, "the second point's server never started"
        time.sleep(2)
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # the twin's own process group
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    runs = runs_by_value(Store(lab / "reports/lab.db"), "e2e-crash")
    assert runs.loc[4, "status"] == "ok" and runs.loc[8, "status"] == "crashed", out
    first_ok = runs.loc[4, "started"]
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300,
                             cwd=REPO, check=False)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    runs = runs_by_value(Store(lab / "reports/lab.db"), "e2e-crash")
    assert dict(runs["status"]) == {4: "ok", 8: "ok"}
    assert runs.loc[4, "started"] == first_ok  # the finished point was kept, not measured again
    assert json.loads(runs.loc[8, "summary_json"]) is not None
