"""vllm_lab.backends without a server: how LiveBackend.measure_on maps a run to a status (a
client-limited run is run again once with more Locust processes, and recorded as client-limited,
kept out of every comparison, if it still is; a run whose requests failed is failed-requests, with
no second run; a server gone silent is crashed), how a failed start is recorded, and PredictBackend
on a small scenario. Runs against real servers are in test_api_key.py and test_sweep_e2e.py."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from vllm_lab import backends, scenarios, serving
from vllm_lab.backends import START_STATUS, LiveBackend, PredictBackend, predicted_requests
from vllm_lab.scenarios import ScenarioError
from vllm_lab.summary import closed_loop_gaps
from vllm_lab.traffic.arrivals import planned_arrivals
from vllm_lab.traffic.runner import LoadResult, TrafficError

URL = "http://127.0.0.1:8000"


@pytest.fixture
def health(monkeypatch):
    """The server's /health status as measure_on sees it (200 unless a test says otherwise).

    The scripted runs scrape no /metrics: the server's account of a run is taken as given here
    (test_a_live_run_vllm_gave_no_account_of_is_unaudited checks the rule itself)."""
    answers = {"status": 200}
    monkeypatch.setattr(backends, "_get", lambda url, timeout=5.0: answers["status"])
    monkeypatch.setattr(backends, "_unaudited", lambda summary: "")
    return answers


def test_a_live_run_vllm_gave_no_account_of_is_unaudited():
    from vllm_lab.run_summary import RunSummary

    read = {"output_throughput": 100.0}
    assert "no two scrapes" in backends._unaudited(RunSummary.of(read))
    silent = backends._unaudited(RunSummary.of(read, server_requests=5.0, server_generation_tokens=0.0))
    assert "counted no generated token while the client read 100 tok/s" in silent
    assert backends._unaudited(RunSummary.of(read, server_requests=5.0,
                                             server_generation_tokens=800.0)) == ""


class Scripted(LiveBackend):
    """A backend whose runs say what the test wants, on a server whose /health is stubbed."""

    def __init__(self, limited_with: set[int], cores: int = 8, samples: pd.DataFrame | None = None):
        super().__init__("twin", Path("inventory/local.yml"))
        self._workers = []  # all local: no inventory lookup
        self.limited_with, self.cores, self.calls = limited_with, cores, []
        self.samples = _samples(ok=20) if samples is None else samples

    def _cores(self, workers):
        return self.cores

    def _run(self, scenario, instance, workdir, workers, processes):
        self.calls.append(processes)
        result = LoadResult(samples=self.samples, server_metrics=pd.DataFrame(),
                            client_overloaded=processes in self.limited_with,
                            schedule_lag_p99_s=0.0, loop_lag_p99_s=0.05, cpu_fraction_max=0.99)
        return result, {"loadgen_processes": processes}


def _samples(ok: int, failed: int = 0, error: str = "http_error", http_status: int = 401) -> pd.DataFrame:
    return pd.DataFrame({"status": ["ok"] * ok + ["error"] * failed,
                         "error": [""] * ok + [error] * failed,
                         "http_status": [200] * ok + [http_status] * failed})


def _instance(url: str = URL) -> serving.Instance:
    return serving.Instance(host="localhost", url=url, port=int(url.rsplit(":", 1)[1]), log_path="")


def test_a_limited_run_is_run_again_with_twice_the_processes(tmp_path, health):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with={3})
    m = b.measure_on(s, _instance(), tmp_path)
    assert b.calls == [3, 6] and m.status == "ok" and m.summary["loadgen_rerun_of"] == 3


def test_a_run_still_limited_is_recorded_as_client_limited(tmp_path, health):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with={3, 6})
    m = b.measure_on(s, _instance(), tmp_path)
    assert b.calls == [3, 6] and m.status == "client-limited"
    assert "could not keep up" in m.error and "99% CPU" in m.error


def test_a_run_whose_requests_were_refused_is_failed_requests_and_not_run_again(tmp_path, health):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with={3, 6}, samples=_samples(ok=0, failed=40))
    m = b.measure_on(s, _instance(), tmp_path)
    assert b.calls == [3] and m.status == "failed-requests"
    assert m.error.startswith("40 of 40 requests failed (100%); most: HTTP 401 (40)")
    assert "serve.api-key" in m.error and m.summary["failed_requests_rate"] == 1.0


@pytest.mark.parametrize("threshold,status", [(None, "ok"), ("0.01", "failed-requests")])
def test_the_threshold_is_the_scenarios(tmp_path, health, threshold, status):
    over = [f"load.failed_requests_threshold={threshold}"] if threshold else []
    s = scenarios.resolve("default", overrides=["load.shape.level=64", *over])
    b = Scripted(limited_with=set(), samples=_samples(ok=97, failed=3, http_status=400))
    assert b.measure_on(s, _instance(), tmp_path).status == status


def test_timeouts_alone_leave_the_run_ok(tmp_path, health):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with=set(), samples=_samples(ok=10, failed=30, error="timeout", http_status=0))
    assert b.measure_on(s, _instance(), tmp_path).status == "ok"


def test_a_server_that_stops_answering_health_is_crashed_even_when_requests_failed(tmp_path, health):
    health["status"] = 503
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with=set(), samples=_samples(ok=0, failed=40))
    m = b.measure_on(s, _instance(), tmp_path)
    assert m.status == "crashed" and "stopped answering /health" in m.error


def test_warm_up_runs_follow_each_start_and_only_a_start(tmp_path, health, monkeypatch):
    """run.warmup_runs: after a server starts, the scenario's own load is run and discarded that
    many times before the measured run; a server reused for the next run gets none."""
    starts = []
    monkeypatch.setattr(serving, "start", lambda flags, **kw: starts.append(flags) or
                        serving.Instances([_instance()]))
    monkeypatch.setattr(serving, "stop", lambda *a, **kw: None)
    monkeypatch.setattr(backends, "_post", lambda *a, **k: 200)
    s = scenarios.resolve("default", overrides=["load.shape.level=64", "run.warmup_runs=2"])
    b = Scripted(limited_with=set())
    phases = []
    b.hooks = type("Hooks", (), {"phase": lambda self, name, **i: phases.append(name),
                                 "figures": lambda self, **f: None})()
    m = b.measure(s, None, tmp_path)
    assert len(starts) == 1 and len(b.calls) == 3 and m.status == "ok"
    assert [p for p in phases if p.startswith("warm-up")] == [
        "warm-up run 1 of 2 (discarded)", "warm-up run 2 of 2 (discarded)"]
    # What came before the run is its host time, apart from the run's own span.
    assert m.summary.server_start_s >= 0 and m.summary.warmup_runs_s >= 0
    reused = b.measure(s, None, tmp_path)
    assert len(starts) == 1 and len(b.calls) == 4  # the same flags: the server is reused
    assert reused.summary.server_start_s is None and reused.summary.warmup_runs_s is None
    b.measure(s.with_serve(**{"max-num-seqs": 8}), None, tmp_path)
    assert len(starts) == 2 and len(b.calls) == 7  # a new start: its own warm-up runs
    b.measure(scenarios.resolve("default", overrides=["load.shape.level=64"]), None, tmp_path)
    assert len(starts) == 3 and len(b.calls) == 8  # none asked (the default)


@pytest.mark.parametrize("cause, status", [
    ("oom", "oom"), ("refused-flag", "failed-start"), ("start-timeout", "timeout"), ("crashed", "crashed"),
    ("unreachable", "unreachable"), ("refused-config", "failed-start"), ("something-new", "failed-start"),
])
def test_a_failed_start_is_recorded_with_the_stores_status(tmp_path, monkeypatch, cause, status):
    """Every cause serving can report becomes one of the store's statuses, the log's evidence kept."""
    b = LiveBackend("twin", Path("inventory/local.yml"))

    def refuse(scenario, host):
        raise serving.ServeError(cause, "EngineCore failed to start.\nthe last line", host="gpu-1")

    monkeypatch.setattr(b, "_ensure_server", refuse)
    m = b.measure(scenarios.resolve("default"), "gpu-1", tmp_path)
    assert m.status == status and m.host == "gpu-1"
    assert m.error.startswith(f"{cause}: ") and "the last line" in m.error
    assert m.samples is None and set(m.summary) == {"server_start_s"}  # its host time: the start's
    assert 0 <= m.summary.server_start_s == pytest.approx(m.ended - m.started)


def test_every_start_status_is_one_the_store_knows():
    from vllm_lab.store import STATUSES

    assert {*serving.CAUSES, "unreachable", "refused-config"} <= set(START_STATUS)
    assert set(START_STATUS.values()) <= set(STATUSES)


def _tiny(*overrides: str) -> scenarios.Scenario:
    return scenarios.resolve("default", hardware="cpu-demo", overrides=["load.shape.level=2", *overrides])


def test_predict_backend_predicts_a_closed_loop_run():
    s = _tiny()
    m = PredictBackend().measure(s, None, Path("unused"))
    assert m.status == "ok" and m.host == "predictor" and m.error == ""
    assert len(m.samples) == 2 * PredictBackend.REQUESTS_PER_USER == m.summary["requests"]
    assert set(m.samples["status"]) == {"ok"} and (m.samples["ttft_s"] > 0).all()
    assert (m.samples["e2e_s"] >= m.samples["ttft_s"]).all()
    assert m.summary["output_throughput"] > 0 and 0 <= m.summary["kv_usage_max"] <= 1
    # The engine's steps, read as vLLM's /metrics give a measured run's (audit.ServerView).
    assert m.summary["server_step_s"] > 0 and m.summary["server_step_tokens"] >= 1
    assert m.ended >= m.started
    # The same scenario (and seed) predicts the same run.
    again = PredictBackend().measure(s, None, Path("unused"))
    assert again.summary["ttft_p50"] == m.summary["ttft_p50"]


def test_a_prediction_near_the_api_servers_limit_is_also_made_at_that_limit():
    """256 users of the default traffic on the H200's profile: the twin has vLLM's API server
    busy 0.85 of a core, and predicted with the server's costs at its own limit (every excess
    request waiting for admission) TTFT p50 is many times longer; at 32 users (0.2 of a core) no
    second prediction is made, nor in a search's probes (band=False)."""
    from vllm_lab.twin.profile import API_LIMIT_REQUEST_S, at_api_limit, load_profile

    s = scenarios.resolve("default", "h200", ["load.shape.level=256", "load.stop.duration_s=10"])
    m = PredictBackend(band=True).measure(s, None, Path("unused"))
    assert m.summary["server_api_cpu"] >= 0.6
    assert m.summary["ttft_p50_api_limit"] > 5 * m.summary["ttft_p50"]
    assert "ttft_p50_api_limit" not in PredictBackend().measure(s, None, Path("unused")).summary
    light = scenarios.resolve("default", "h200", ["load.shape.level=32", "load.stop.duration_s=10"])
    assert "ttft_p50_api_limit" not in PredictBackend(band=True).measure(light, None, Path("u")).summary
    # At the limit a request costs 2 ms and a token 80 us; a chat request's total stays.
    base = load_profile("h200-llama-3-8b").coefficients
    limit = at_api_limit(load_profile("h200-llama-3-8b")).coefficients
    assert limit.frontend_request_s == API_LIMIT_REQUEST_S and limit.frontend_token_s == 80e-6
    assert (limit.frontend_request_s + limit.frontend_chat_s
            == pytest.approx(base.frontend_request_s + base.frontend_chat_s))


def test_the_predictor_draws_a_closed_loop_from_one_pool():
    # Variable lengths and a request count: users take the next request whenever they are free,
    # so N stay in flight until fewer than N requests are left, as in the live client.
    s = _tiny("load.shape.level=8", "load.stop.max_requests=96", "workload.source=sharegpt-like")
    m = PredictBackend().measure(s, None, Path("unused"))
    df = m.samples
    assert len(df) == 96 and (df.status == "ok").all()
    gaps = closed_loop_gaps(df.start_ts, df.start_ts + df.e2e_s, 8)
    assert len(gaps) == 96 - 8 and gaps.min() >= 0 and gaps.mean() < 0.01  # the 1.5 ms turnaround
    assert m.summary["window_reason"].endswith("to the last send")


def test_the_predictor_replays_the_live_runs_arrival_schedule():
    s = _tiny("load.mode=open", "load.shape.level=4", "load.stop.max_requests=100", "run.seed=4")
    m = PredictBackend().measure(s, None, Path("unused"))
    planned = np.fromiter(planned_arrivals(s.load, 4), float)
    assert np.allclose(np.sort(m.samples.scheduled_ts), planned)
    assert m.summary["window_reason"].endswith("to the last scheduled arrival")
    ramp = _tiny("load.mode=open", "load.shape.kind=ramp", "load.shape.level=20",
                 "load.shape.ramp_s=5", "load.stop.duration_s=10")
    sends = PredictBackend().measure(ramp, None, Path("unused")).samples.scheduled_ts
    assert np.allclose(np.sort(sends), np.fromiter(planned_arrivals(ramp.load, 0), float))
    # The ramp's shape (1 -> 20 req/s over 5 s, then 20): about 52 arrivals, then 100.
    assert (sends < 5).sum() < 0.75 * (sends >= 5).sum()


def test_the_predictors_shared_prefix_is_part_of_the_prompt():
    # The live workload's prompt is its drawn length in all, the system prompt included.
    s = _tiny("workload.source=synthetic", "workload.input={dist: fixed, mean: 2048}",
              "workload.output={dist: fixed, mean: 8}", "workload.shared_prefix_ratio=0.6")
    reqs = predicted_requests(s, 4)
    assert {len(r.prompt_tokens) for r in reqs} == {2048}
    assert reqs[0].prompt_tokens[:1228] == reqs[1].prompt_tokens[:1228]


@pytest.mark.parametrize("override, status, says", [
    ("serve.gpu-memory-utilization=0.01", "oom", "oom: No available memory for the cache blocks"),
    ("serve.dtype=float8", "failed-start", "refused-flag: argument --dtype: invalid choice: 'float8'"),
    ("serve.max-num-partial-prefills=2", "failed-start",
     "refused-flag: NotImplementedError: Concurrent Partial Prefill is not supported"),
])
def test_predict_backend_records_what_vllm_would_refuse(override, status, says):
    m = PredictBackend().measure(_tiny(override), None, Path("unused"))
    assert m.status == status and m.error.startswith(says) and m.samples is None


def test_predict_backend_refuses_a_level_it_cannot_simulate():
    # A level the schema allows (at most load.shape's 10^6) but the predictor cannot simulate.
    with pytest.raises(ScenarioError, match="the predictor would simulate 8,000,000 requests"):
        PredictBackend.check(_tiny("load.shape.level=1000000"))
    assert PredictBackend.check(_tiny("load.mode=open", "load.stop.duration_s=10")) == 20


class FailingLoad(Scripted):
    """A backend whose load generator fails the way the test says."""

    def __init__(self, error: Exception):
        super().__init__(limited_with=set())
        self.error = error

    def _run(self, scenario, instance, workdir, workers, processes):
        raise self.error


@pytest.mark.parametrize("error", [
    TrafficError("locust exited with -9 and wrote no samples; output tail:\nKilled"),
    PermissionError(13, "Permission denied", "/data/prompts.jsonl"),
], ids=["locust-killed", "workload-unreadable"])
def test_a_failed_load_generator_is_a_loadgen_failed_run_with_its_cause(tmp_path, health, error):
    """Not the server's failure: its own status, which a search does not count against the flags
    (search.CONFIG_FAILURES) and a resume measures again (store.RETRIED_ON_RESUME)."""
    from vllm_lab.search import CONFIG_FAILURES
    from vllm_lab.store import RETRIED_ON_RESUME

    s = scenarios.resolve("default")
    m = FailingLoad(error).measure_on(s, _instance(), tmp_path)
    assert m.status == "loadgen-failed" and m.error.startswith("load generator failed: ")
    assert m.status not in CONFIG_FAILURES and m.status in RETRIED_ON_RESUME
    assert ("exited with -9" in m.error) if isinstance(error, TrafficError) else \
        ("PermissionError" in m.error and "prompts.jsonl" in m.error)


def test_a_full_disk_during_a_run_ends_the_command():
    import errno

    with pytest.raises(OSError, match="No space"):
        FailingLoad(OSError(errno.ENOSPC, "No space left on device")).measure_on(
            scenarios.resolve("default"), _instance(), Path("/nonexistent"))


def test_predict_backend_serves_the_urgent_class_first_under_the_priority_policy():
    """scenarios/mixed-priority: a fifth of the requests sent with priority -1, 64 users against a
    batch of 32. vLLM's fcfs keeps both classes in one queue; --scheduling-policy priority lets
    the urgent ones pass it, the others waiting longer for it, at the same throughput."""
    def run(policy):
        s = scenarios.resolve("mixed-priority", "h200", [f"serve.scheduling-policy={policy}",
                                                         "load.stop.duration_s=10"])
        m = PredictBackend().measure(s, None, Path("unused"))
        assert set(m.samples["priority"]) == {-1, 0}
        return m.summary

    fcfs, priority = run("fcfs"), run("priority")
    assert fcfs["ttft_p50_urgent"] == pytest.approx(fcfs["ttft_p50_others"], rel=0.25)
    assert priority["ttft_p50_urgent"] < 0.2 * priority["ttft_p50_others"]
    assert priority["ttft_p50_others"] > fcfs["ttft_p50_others"]
    assert priority["output_throughput"] == pytest.approx(fcfs["output_throughput"], rel=0.05)


def test_a_sweeps_detail_table_shows_each_priority_class(tmp_path):
    """The sweep's second table has the urgent class's TTFT and the others' where the runs sent
    several priorities, and no such columns where they sent one."""
    from vllm_lab.analysis.points import point_table
    from vllm_lab.reports.sweep import detail_table

    def table(name, overrides):
        s = scenarios.resolve(name, "h200", ["load.stop.duration_s=5", *overrides])
        m = PredictBackend().measure(s, None, Path("unused"))
        runs = pd.DataFrame([{"point": {"x": 1}, "status": "ok", "error": "", "backend": "predict",
                              "summary": m.summary, **{k: m.summary.get(k) for k in
                                                       ("ttft_p50", "output_throughput")}}])
        return detail_table(point_table(runs, ["x"]), ["x"])

    mixed = table("mixed-priority", ["serve.scheduling-policy=priority"])
    assert {"TTFT p50 urgent ms", "TTFT p99 others ms"} <= set(mixed.columns)
    assert mixed["TTFT p50 urgent ms"].iloc[0] < mixed["TTFT p50 others ms"].iloc[0]
    assert not any("urgent" in c for c in table("default", ["load.shape.level=2"]).columns)
