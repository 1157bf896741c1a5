"""LiveBackend.measure_on: a client-limited run is run again once with more Locust processes,
and recorded as client-limited (kept out of every comparison) if it still is."""

from pathlib import Path

import pandas as pd
import pytest

from vllm_lab import scenarios, serving
from vllm_lab.backends import LiveBackend
from vllm_lab.traffic.runner import LoadResult
from vllm_lab.traffic.scripted_server import running


@pytest.fixture
def scripted_server_url():
    with running() as url:
        yield url


class Scripted(LiveBackend):
    """A backend whose runs say what the test wants; the server is a real /health answer away."""

    def __init__(self, limited_with: set[int], cores: int = 8):
        super().__init__("twin", Path("inventory/local.yml"))
        self._workers = []  # all local: no inventory lookup
        self.limited_with, self.cores, self.calls = limited_with, cores, []

    def _cores(self, workers):
        return self.cores

    def _run(self, scenario, instance, workdir, workers, processes):
        self.calls.append(processes)
        result = LoadResult(samples=pd.DataFrame(), server_metrics=pd.DataFrame(),
                            client_overloaded=processes in self.limited_with,
                            schedule_lag_p99_s=0.0, loop_lag_p99_s=0.05, cpu_fraction_max=0.99)
        return result, {"loadgen_processes": processes}


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
