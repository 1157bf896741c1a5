"""The main job end to end on the twin: playbook -> twin -> Locust -> store -> report.

Runs the lab's own CLI as a user would (through `scripts/lab.py`), on a private inventory (its own
port and host folder), the cpu-demo GPU so two shared cores keep real time, and short runs.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.support.processes import private_inventory
from vllm_lab import scenarios
from vllm_lab.store import Store
from vllm_lab.summary import summarize

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 30 s of load: a closed loop's window ends at its last send, and a run whose fill and drain
# take more than its window is unsteady (store.RunStatus), not measured; one sequence at a time
# for six users drains for about 20 s on cpu-demo.
SETS = ["load.shape.level=6", "load.stop.duration_s=30", "workload.source=alpaca-like",
        "run.warmup_requests=2"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A private local inventory and reports folder."""
    tmp = tmp_path_factory.mktemp("e2e")
    private_inventory(tmp)
    return tmp


def lab_cmd(lab: Path, *args: str) -> list[str]:
    sets = [x for s in SETS for x in ("--set", s)]
    return [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", "max-num-seqs",
            "--hardware", "cpu-demo", "--inventory", str(lab / "inv.yml"), "--out", str(lab / "reports"),
            *sets, *args]


def runs_by_value(store: Store, exp: str) -> pd.DataFrame:
    runs = store.runs(exp)
    return runs.assign(value=runs["point"].map(lambda p: p["max-num-seqs"])).set_index("value")


def test_sweep_report_matches_the_store(lab):
    # The scenario's own max-num-seqs (8) is the sweep's reference, among the values: no third point.
    out = subprocess.run(lab_cmd(lab, "--set", "serve.max-num-seqs=8", "--values", "1,8",
                                 "--experiment", "e2e-sweep"), check=False,
                         capture_output=True, text=True, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    index = lab / "reports/e2e-sweep/index.html"
    assert f"report: {index}" in out.stdout and index.is_file()
    store = Store(lab / "reports/lab.db")
    runs = runs_by_value(store, "e2e-sweep")
    assert set(runs["status"]) == {"ok"} and list(runs.index) == [1, 8]
    table = pd.read_csv(lab / "reports/e2e-sweep/summary.csv").set_index("max-num-seqs")
    for value, run in runs.iterrows():
        # The report shows what the store holds ...
        for metric in ("output_throughput", "goodput", "ttft_p50", "tpot_p99", "e2e_p99"):
            assert table.loc[value, metric] == pytest.approx(run[metric], rel=1e-9)
        # ... and the store's summary is what the raw samples say.
        samples = store.samples("e2e-sweep", run["run_key"])
        assert len(samples) == run["requests"] > 0
        again = summarize(samples, scenarios.Scenario.model_validate_json(run["scenario_json"]).slo)
        assert again["ttft_p50"] == pytest.approx(run["ttft_p50"])
        assert store.server_metrics("e2e-sweep", run["run_key"])["name"].str.startswith("vllm:").any()
    # One running sequence queues the other five users: TTFT is far higher than at 8.
    assert runs.loc[1, "ttft_p50"] > 3 * runs.loc[8, "ttft_p50"]
    assert runs.loc[8, "output_throughput"] > 2 * runs.loc[1, "output_throughput"]
    html = index.read_text()
    assert "cpu-demo" in html and "vLLM 0.26.0" in html and "data:image/png;base64" in html


def twin_pid(lab: Path) -> int | None:
    for pidfile in (lab / "host").rglob("*.pid"):
        fields = pidfile.read_text().split()  # "pid starttime"
        if fields and fields[0].isdigit():
            return int(fields[0])
    return None


def test_killed_server_is_a_crashed_point_and_resume_finishes(lab):
    args = lab_cmd(lab, "--set", "serve.max-num-seqs=4", "--values", "2,4", "--experiment", "e2e-crash")
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
                pid = twin_pid(lab)
            time.sleep(0.3)
        assert pid, "the second point's server never started"
        time.sleep(2)
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # the twin's own process group
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    runs = runs_by_value(Store(lab / "reports/lab.db"), "e2e-crash")
    assert runs.loc[2, "status"] == "ok" and runs.loc[4, "status"] == "crashed", out
    first_ok = runs.loc[2, "started"]
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300,
                             cwd=REPO, check=False)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    runs = runs_by_value(Store(lab / "reports/lab.db"), "e2e-crash")
    assert dict(runs["status"]) == {2: "ok", 4: "ok"}
    assert runs.loc[2, "started"] == first_ok  # the finished point was kept, not measured again
    assert json.loads(runs.loc[4, "summary_json"]) is not None


def test_claim_six_on_the_live_twin(lab):
    """`lab claims` on the live twin (the host the sweeps provisioned): the arms, the verdicts.
    Claim 6 (dtypes) runs all its arms on the scenario's own light traffic, so it stays short."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/lab.py"), "claims", "--claims", "6", "--hardware", "cpu-demo",
         "--inventory", str(lab / "inv.yml"), "--out", str(lab / "claims"), "--experiment", "claims-live",
         # 10 s: a request drains for about 4 s here, and a window under half its run is unsteady.
         "--set", "load.stop.duration_s=10", "--set", "load.shape.level=4",
         "--set", "workload.source=alpaca-like", "--set", "run.warmup_requests=1"],
        check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = Store(lab / "claims/lab.db").runs("claims-live")
    assert sorted(runs["point"].map(lambda p: p["arm"])) == \
        ["base · defaults", "base · defaults", "base · dtype=float16", "base · dtype=float32"]
    status = dict(zip(runs["point"].map(lambda p: p["arm"]), runs["status"]))
    # float32 doubles the weights: on the small simulated GPU it does not fit, which is evidence.
    assert status["base · defaults"] == status["base · dtype=float16"] == "ok"
    assert status["base · dtype=float32"] in ("ok", "oom")
    table = pd.read_csv(lab / "claims/claims-live/verdicts.csv").set_index("claim")
    # The measured claim, and those no experiment can test here (swap; TP on one GPU).
    assert list(table.index) == [6, 7, 9]
    assert "float16 → bfloat16: output" in table.loc[6, "measured"]
