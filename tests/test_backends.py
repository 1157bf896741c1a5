"""LiveBackend.measure_on: a client-limited run is run again once with more Locust processes,
and recorded as client-limited (kept out of every comparison) if it still is; a run whose requests
failed is failed-requests, with no second run."""

from pathlib import Path

import pandas as pd
import pytest

from tests.support.scripted_server import running
from vllm_lab import scenarios, serving
from vllm_lab.backends import LiveBackend
from vllm_lab.traffic.runner import LoadResult


@pytest.fixture
def scripted_server_url():
    with running() as url:
        yield url


class Scripted(LiveBackend):
    """A backend whose runs say what the test wants; the server is a real /health answer away."""

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


def _instance(url: str) -> serving.Instance:
    return serving.Instance(host="localhost", url=url, port=int(url.rsplit(":", 1)[1]), log_path="")


def test_a_limited_run_is_run_again_with_twice_the_processes(tmp_path, scripted_server_url):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with={3})
    m = b.measure_on(s, _instance(scripted_server_url), tmp_path)
    assert b.calls == [3, 6] and m.status == "ok" and m.summary["loadgen_rerun_of"] == 3


def test_a_run_still_limited_is_recorded_as_client_limited(tmp_path, scripted_server_url):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with={3, 6})
    m = b.measure_on(s, _instance(scripted_server_url), tmp_path)
    assert b.calls == [3, 6] and m.status == "client-limited"
    assert "could not keep up" in m.error and "99% CPU" in m.error


def test_a_run_whose_requests_were_refused_is_failed_requests_and_not_run_again(tmp_path,
                                                                               scripted_server_url):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with={3, 6}, samples=_samples(ok=0, failed=40))
    m = b.measure_on(s, _instance(scripted_server_url), tmp_path)
    assert b.calls == [3] and m.status == "failed-requests"
    assert m.error.startswith("40 of 40 requests failed (100%); most: HTTP 401 (40)")
    assert "serve.api-key" in m.error and m.summary["failed_requests_rate"] == 1.0


@pytest.mark.parametrize("threshold,status", [(None, "ok"), ("0.01", "failed-requests")])
def test_the_threshold_is_the_scenarios(tmp_path, scripted_server_url, threshold, status):
    over = [f"load.failed_requests_threshold={threshold}"] if threshold else []
    s = scenarios.resolve("default", overrides=["load.shape.level=64", *over])
    b = Scripted(limited_with=set(), samples=_samples(ok=97, failed=3, http_status=400))
    assert b.measure_on(s, _instance(scripted_server_url), tmp_path).status == status


def test_timeouts_alone_leave_the_run_ok(tmp_path, scripted_server_url):
    s = scenarios.resolve("default", overrides=["load.shape.level=64"])
    b = Scripted(limited_with=set(), samples=_samples(ok=10, failed=30, error="timeout", http_status=0))
    assert b.measure_on(s, _instance(scripted_server_url), tmp_path).status == "ok"
