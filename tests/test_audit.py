"""The server's audit of a run: vLLM's /metrics over the run against the client's own figures."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support.processes import TwinProcess
from vllm_lab import audit
from vllm_lab.traffic import Lengths, Load, Workload, run_load
from vllm_lab.traffic.scrape import frame

TTFT = "vllm:time_to_first_token_seconds"


def _scrape(ts: float, n: float, ttft_sum: float, e2e_sum: float, decode_sum: float,
            buckets: dict[float, float]) -> list:
    labels = json.dumps({"engine": "0", "model_name": "m"})
    rows = [(ts, "vllm:request_success_total", labels, n),
            (ts, "vllm:generation_tokens_total", labels, 100 * n),
            (ts, TTFT + "_count", labels, n), (ts, TTFT + "_sum", labels, ttft_sum),
            (ts, "vllm:e2e_request_latency_seconds_count", labels, n),
            (ts, "vllm:e2e_request_latency_seconds_sum", labels, e2e_sum),
            (ts, "vllm:request_decode_time_seconds_count", labels, n),
            (ts, "vllm:request_decode_time_seconds_sum", labels, decode_sum)]
    for le, c in buckets.items():
        rows.append((ts, TTFT + "_bucket", json.dumps({"engine": "0", "le": str(le), "model_name": "m"}), c))
    return rows


def test_the_server_view_is_the_difference_of_the_first_and_last_scrape():
    # 10 requests served before the run must not count; the run adds 20 with TTFT 0.2 s each,
    # e2e 1.5 s, decode 1.0 s: the API server handed the last token out 0.3 s after the engine.
    before = _scrape(0.0, 10, 1.0, 10.0, 5.0, {0.1: 10, 0.25: 10, 0.5: 10, float("inf"): 10})
    after = _scrape(9.0, 30, 5.0, 40.0, 25.0, {0.1: 10, 0.25: 30, 0.5: 30, float("inf"): 30})
    view = audit.server_view(frame(before + after))
    assert view.requests == 20 and view.generation_tokens == 2000
    assert view.means["ttft"] == pytest.approx(0.2) and view.means["e2e"] == pytest.approx(1.5)
    assert view.frontend_lag_s == pytest.approx(0.3)
    assert 0.1 < view.percentiles["ttft_p50"] < 0.25  # inside the bucket holding the median


def test_the_api_server_process_cpu_is_its_counter_over_the_span():
    """vLLM's one API-server process exports its CPU seconds: 4.5 more over 9 s is half a core.
    Several API-server processes export no process series: then there is no figure, not a 0."""
    before = _scrape(0.0, 10, 1.0, 10.0, 5.0, {float("inf"): 10}) + [(0.0, audit.PROCESS_CPU, "", 100.0)]
    after = _scrape(9.0, 30, 5.0, 40.0, 25.0, {float("inf"): 30}) + [(9.0, audit.PROCESS_CPU, "", 104.5)]
    view = audit.server_view(frame(before + after))
    assert view.api_cpu == pytest.approx(0.5) and view.as_summary()["server_api_cpu"] == pytest.approx(0.5)
    plain = audit.server_view(frame(before[:-1] + after[:-1]))
    assert plain.api_cpu is None and "server_api_cpu" not in plain.as_summary()


def test_the_engines_step_is_the_span_over_its_steps():
    """vLLM observes each step's tokens (iteration_tokens_total): 600 steps of 45,000 tokens over
    9 s are a 15-ms step of 75 tokens. A server without the histogram gives no figure."""
    labels = json.dumps({"engine": "0", "model_name": "m"})

    def steps(ts: float, count: float, tokens: float) -> list:
        return [(ts, audit.STEPS + "_count", labels, count), (ts, audit.STEPS + "_sum", labels, tokens)]

    before = _scrape(0.0, 10, 1.0, 10.0, 5.0, {float("inf"): 10}) + steps(0.0, 100, 5000)
    after = _scrape(9.0, 30, 5.0, 40.0, 25.0, {float("inf"): 30}) + steps(9.0, 700, 50_000)
    summary = audit.server_view(frame(before + after)).as_summary()
    assert summary["server_step_s"] == pytest.approx(0.015) and summary["server_step_tokens"] == 75
    plain = audit.server_view(frame(before[:-2] + after[:-2])).as_summary()
    assert "server_step_s" not in plain and "server_step_tokens" not in plain


def test_histogram_quantile_interpolates_inside_the_bucket():
    upper, cum = np.array([1.0, 2.0, np.inf]), np.array([0.0, 10.0, 10.0])
    assert audit.histogram_quantile(0.5, upper, cum) == pytest.approx(1.5)
    assert audit.histogram_quantile(0.5, upper, np.zeros(3)) is None


def _samples(ttft: float, e2e: float, n: int = 20) -> pd.DataFrame:
    return pd.DataFrame({"status": ["ok"] * n, "ttft_s": ttft, "e2e_s": e2e,
                         "tpot_s": (e2e - ttft) / 99, "output_tokens": 100})


def test_a_client_that_reads_its_streams_late_is_client_limited():
    before = _scrape(0.0, 0, 0.0, 0.0, 0.0, {float("inf"): 0})
    after = _scrape(9.0, 20, 4.0, 30.0, 20.0, {float("inf"): 20})
    view = audit.server_view(frame(before + after))
    # Server: TTFT 0.2 s, first to last token 1.3 s.
    on_time = audit.audit(_samples(0.21, 1.52), view)
    assert not on_time.client_limited and on_time.span_diff == pytest.approx(0.008, abs=1e-3)
    assert on_time.tokens_diff == 0
    late = audit.audit(_samples(0.21, 1.61), view)
    assert late.client_limited and "later than vLLM's API server" in late.reason


@pytest.mark.integration
def test_the_lab_client_agrees_with_the_twin_server(tmp_path: Path):
    """A real run against the twin: the same requests and tokens on both sides, and the decode
    span within the audit's tolerance."""
    twin = TwinProcess(tmp_path)
    try:
        load = Load(shape={"level": 4}, stop={"duration_s": 60, "max_requests": 24})
        workload = Workload(source="synthetic", input=Lengths(mean=64), output=Lengths(mean=32))
        r = run_load(twin.url, twin.model, workload, load, tmp_path / "run", scrape_interval_s=0.5)
    finally:
        twin.stop()
    view = audit.server_view(r.server_metrics)
    check = audit.audit(r.samples, view)
    assert view.requests == 24 and check.tokens_diff == 0
    assert view.api_cpu is not None  # the modelled API server's busy time, as vLLM exports its CPU
    assert view.steps > 0 and view.step_tokens >= view.steps  # the twin's steps, as vLLM counts them
    assert not check.client_limited, check.reason
    assert abs(check.span_diff) < audit.SPAN_TOLERANCE
