"""The main job end to end on the twin: playbook -> twin -> Locust -> store -> report.

Runs the lab's own CLI as a user would (through `scripts/lab.py`, tests/support/e2e.py). A killed
server and a resume are tests/test_sweep_resume.py's, apart so the two run on two cores at once.
"""

import subprocess
import sys

import pandas as pd
import pytest

from tests.support.e2e import REPO, lab_cmd, private_lab, runs_by_value
from vllm_lab import scenarios
from vllm_lab.store import Store
from vllm_lab.summary import summarize

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return private_lab(tmp_path_factory)


@pytest.mark.timing
def test_sweep_report_matches_the_store(lab):
    # The scenario's own max-num-seqs (8) is the sweep's reference, among the values: no third point.
    # Four users: at one sequence three wait, a drain of about 7 s, so 16 s of load is steady.
    # Timing: both runs must be ok, and the audit calls a run whose client read its streams 3%
    # (5 ms) late client-limited; beside two other live tests on 2 cores both runs once were.
    out = subprocess.run(lab_cmd(lab, "--set", "serve.max-num-seqs=8", "--values", "1,8",
                                 "--set", "load.shape.level=4", "--set", "load.stop.duration_s=16",
                                 "--experiment", "e2e-sweep"), check=False,
                         capture_output=True, text=True, timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    index = lab / "reports/e2e-sweep/index.html"
    assert f"report: {index}" in out.stdout and index.is_file()
    store = Store(lab / "reports/lab.db")
    runs = runs_by_value(store, "e2e-sweep")
    assert set(runs["status"]) == {"ok"} and list(runs.index) == [1, 8], runs[["status", "error"]]
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
    # One running sequence queues the other three users: TTFT is far higher than at 8.
    assert runs.loc[1, "ttft_p50"] > 3 * runs.loc[8, "ttft_p50"]
    assert runs.loc[8, "output_throughput"] > 2 * runs.loc[1, "output_throughput"]
    html = index.read_text()
    assert "cpu-demo" in html and "vLLM 0.26.0" in html and "data:image/png;base64" in html


def test_claim_six_on_the_live_twin(lab):
    """`lab claims` on the live twin (the host the sweeps provisioned): the arms, the verdicts.
    Claim 6 (dtypes) runs all its arms on the scenario's own light traffic, so it stays short."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/lab.py"), "claims", "--claims", "6", "--hardware", "cpu-demo",
         "--inventory", str(lab / "inv.yml"), "--out", str(lab / "claims"), "--experiment", "claims-live",
         # 10 s: a window under half the time its load was sent is unsteady.
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
