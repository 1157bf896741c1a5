"""The report registry, and the twin's prediction: recorded with a real-vLLM run, read by reports."""

from __future__ import annotations

import time

import pandas as pd
import pytest

from vllm_lab import backends, reports, scenarios
from vllm_lab.backends import LiveBackend, Measurement
from vllm_lab.reports import page
from vllm_lab.store import PREDICTION_KEY, RunRecord, Store, run_identity

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py


def _sweep_store(path, prediction: bool, server: dict | None = None, twin_api_cpu: dict | None = None,
                 backend: str = "vllm", api_cpu: dict | None = None, ttft_at_limit: dict | None = None):
    """A real-vLLM sweep of max-num-seqs 32 and 64; ``server``: vLLM's account of each point's
    TTFT (mean, queue, prefill seconds); ``twin_api_cpu``: the cores the prediction's API server
    was busy; ``backend``, ``api_cpu`` and ``ttft_at_limit``: a sweep of another backend, its API
    server's cores and its TTFT p50 predicted at that server's limit."""
    scenario = scenarios.resolve("default", "h200")
    store = Store(path)
    store.create_experiment("sw", "sweep", "default", {"param": "max-num-seqs"})
    for n in (32, 64):
        record = scenario.with_serve(**{"max-num-seqs": n}).to_record()
        summary = {"output_throughput": 1000.0 * n, "ttft_p50": 0.1, "tpot_p50": 0.01, "goodput": 2.0,
                   "meets_slo": True}
        if server:
            summary.update(zip(("server_ttft_mean", "server_queue_mean", "server_prefill_mean"),
                               server[n]))
        if api_cpu:
            summary["server_api_cpu"] = api_cpu[n]
        if ttft_at_limit and n in ttft_at_limit:
            summary["ttft_p50_api_limit"] = ttft_at_limit[n]
        if prediction:
            summary[PREDICTION_KEY] = {"backend": "predict", "profile": "h200-llama-3-8b",
                                       "profile_version": "abc", "predicted": True, "status": "ok",
                                       "error": "", "summary": {"output_throughput": 1100.0 * n,
                                                               "ttft_p50": 0.2, "tpot_p50": 0.01}}
            if twin_api_cpu:
                summary[PREDICTION_KEY]["summary"]["server_api_cpu"] = twin_api_cpu[n]
                if twin_api_cpu[n] >= 0.6:  # predicted once more at the API server's limit
                    summary[PREDICTION_KEY]["summary"]["ttft_p50_api_limit"] = 2.3
        store.record_run(RunRecord(
            experiment_id="sw", run_key=run_identity(record, 0), step="sweep", scenario_name="default",
            scenario=record, status="ok", started=time.time(), ended=time.time() + 1,
            point={"max-num-seqs": n}, gpu_model="NVIDIA H200", vllm_version="0.26.0", backend=backend,
            summary=summary))
    store.close()


@pytest.fixture
def no_twin(monkeypatch):
    """A report that ran the twin would fail here: it reads what the store recorded."""
    def refuse(*a, **k):
        raise AssertionError("a report ran the twin's predictor")
    monkeypatch.setattr(backends.PredictBackend, "measure", refuse)


def test_a_report_reads_the_recorded_prediction(tmp_path, no_twin):
    _sweep_store(tmp_path / "lab.db", prediction=True)
    index = reports.build(tmp_path / "lab.db", "sw", tmp_path)
    table = pd.read_csv(index.parent / "summary.csv")
    assert table["twin_output_throughput"].tolist() == [35200.0, 70400.0]
    assert table["twin_output_throughput_error"].round(3).tolist() == [0.1, 0.1]
    assert "no prediction recorded" not in index.read_text()
    # Every point has its prediction: the page shows them beside the measured figures.
    md = (index.parent / "report.md").read_text()
    assert "The twin's prediction, recorded with each run" in md and "+10.0%" in md


def test_a_prediction_near_the_twins_api_server_limit_says_its_ttft_is_least_sure(tmp_path, no_twin):
    """Past 0.6 of a core (twin.frontend.LIMIT_CPU) the twin's TTFT held out is off by 46%
    (median), below it 11%: the point's twin note says so, in the prediction's own figure."""
    _sweep_store(tmp_path / "lab.db", prediction=True, twin_api_cpu={32: 0.31, 64: 0.78})
    index = reports.build(tmp_path / "lab.db", "sw", tmp_path)
    notes = pd.read_csv(index.parent / "summary.csv")["twin_error"].fillna("").tolist()
    assert notes[0] == "" and notes[1].startswith("the twin's API server at 0.78 of a core, near its limit")
    assert notes[1].endswith("its TTFT is least sure here; TTFT p50 200 ms at the engine's limit, "
                             "up to 2,300 ms at the API server's")
    assert "its TTFT is least sure here" in (index.parent / "report.md").read_text()


def test_a_simulated_sweep_names_the_points_where_the_twins_api_server_nears_its_limit(tmp_path, no_twin):
    """BACKEND=predict on the H200's profile, the default scenario at 256 users: max-num-seqs 128
    has the twin's API server busy 0.70 of a core, 256 and 1024 0.85."""
    _sweep_store(tmp_path / "lab.db", prediction=False, backend="predict", api_cpu={32: 0.45, 64: 0.85},
                 ttft_at_limit={64: 4.702})
    md = (reports.build(tmp_path / "lab.db", "sw", tmp_path).parent / "report.md").read_text()
    assert ("the twin has vLLM's API server busy 0.6 of a core or more at max-num-seqs=64 (0.85; TTFT "
            "p50 100 ms at the engine's limit, up to 4,702 ms at the API server's): near that limit "
            "real vLLM settles at it") in md and "max-num-seqs=32 (" not in md
    # Real vLLM's own figure is a measurement, not the twin's: no such note.
    _sweep_store(tmp_path / "real.db", prediction=False, api_cpu={32: 0.45, 64: 0.85})
    assert "least sure" not in (reports.build(tmp_path / "real.db", "sw", tmp_path / "real").parent
                                / "report.md").read_text()


def test_an_old_store_says_no_prediction_recorded(tmp_path, no_twin):
    _sweep_store(tmp_path / "lab.db", prediction=False)
    index = reports.build(tmp_path / "lab.db", "sw", tmp_path)
    assert "no prediction recorded for 2 of 2 point(s)" in (index.parent / "report.md").read_text()
    assert pd.read_csv(index.parent / "summary.csv")["twin_output_throughput"].isna().all()


def test_a_real_vllm_run_records_the_twins_prediction_with_its_profile():
    scenario = scenarios.resolve("default", "h200")
    m = LiveBackend("vllm", inventory=None)._with_prediction(scenario, Measurement("ok", 0.0, 1.0))
    rec = m.summary[PREDICTION_KEY]
    assert rec["profile"] == scenario.hardware.twin_profile and len(rec["profile_version"]) == 12
    assert rec["predicted"] and rec["summary"]["output_throughput"] > 0
    twin = LiveBackend("twin", inventory=None)._with_prediction(scenario, Measurement("ok", 0.0, 1.0))
    assert PREDICTION_KEY not in twin.summary  # the twin predicting itself says nothing


def test_every_step_has_a_builder_and_one_formatter():
    assert {"baseline", "sweep", "combo", "tune", "stress", "claims"} <= set(reports.BUILDERS)
    assert page.fmt(float("nan")) == "–" and page.fmt(None, "text") == ""
    assert page.fmt(0.0123) == "0.0123" and page.fmt(12345.6) == "12,346"
    assert page.fmt(0.25, "pct") == "+25.0%" and page.fmt(0.4, "ms") == "400"


def test_a_stopped_sweep_names_the_values_it_planned_and_did_not_take(tmp_path, no_twin):
    """A deadline stopped the sweep before vLLM's default: the headline says so, on the page and
    in the console, rather than naming a best as if the plan were done."""
    _sweep_store(tmp_path / "lab.db", prediction=True)
    with Store(tmp_path / "lab.db") as store:
        store.update_meta("sw", values=[32, 64, 1024], reference={"max-num-seqs": 1024})
    index = reports.build(tmp_path / "lab.db", "sw", tmp_path)
    said = "max-num-seqs=1024 (vLLM's default), planned and not taken yet (RESUME=1 takes it)"
    assert said in (index.parent / "report.md").read_text()
    from vllm_lab.reports.console import results
    assert said in results(tmp_path / "lab.db", "sw").headline


def test_a_ttft_held_in_vllms_api_server_is_named_with_the_flag_for_it(tmp_path, no_twin):
    """vLLM's own account puts 1.24 s of a 1.35 s TTFT outside its queue and prefill (the H200 at
    256 users and 256 sequences): no engine flag helps there, and the page says which flag may.
    30 ms of a 90 ms TTFT is the API server's ordinary share: no note."""
    _sweep_store(tmp_path / "lab.db", prediction=True,
                 server={32: (0.09, 0.0, 0.06), 64: (1.35, 0.01, 0.1)})
    index = reports.build(tmp_path / "lab.db", "sw", tmp_path)
    md = (index.parent / "report.md").read_text()
    assert ("at max-num-seqs=64 vLLM's API server held each request 1,240 ms of its 1,350 ms TTFT "
            "(vLLM's /metrics: 10 ms queued, 100 ms from scheduling to first token)") in md
    assert md.count("--api-server-count") == 1
