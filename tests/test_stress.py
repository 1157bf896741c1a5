"""Stress: the knee of a staircase, spike recovery, soak drift; one short staircase on the live twin."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support.processes import private_inventory
from vllm_lab import plans, stress
from vllm_lab import reports as report
from vllm_lab.analysis.stress import (
    GROWTH_SLOPE,
    find_knee,
    level_verdict,
    levels_table,
    offered_rate,
    soak_drift,
    spike_behaviour,
    windows,
)
from vllm_lab.backends import PredictBackend
from vllm_lab.scenarios import ScenarioError, resolve
from vllm_lab.store import Store

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

REPO = Path(__file__).resolve().parent.parent


def table(rows):
    return pd.DataFrame([{"ok": True, "capacity_estimate": math.nan, **r} for r in rows])


def test_find_knee_and_refine():
    t = table([{"level": 2, "unbounded": False, "meets_slo": True},
               {"level": 4, "unbounded": False, "meets_slo": True},
               {"level": 6, "unbounded": False, "meets_slo": False},
               {"level": 8, "unbounded": True, "meets_slo": False, "capacity_estimate": 7.0}])
    knee = find_knee(t)
    assert knee["knee_unbounded"] == 7.0 and knee["bracket"] == (6.0, 8.0)
    assert knee["knee_slo"] == 4.0 and knee["knee"] == 4.0 and knee["max_sustainable"] == 4.0
    assert stress.refine_levels(t) == [6.5, 7.0, 7.5]
    never = table([{"level": 2, "unbounded": False, "meets_slo": True}])
    assert stress.refine_levels(never) == [3.0, 4.0]  # not overloaded yet: go higher


def test_knee_is_read_on_the_rate_the_runs_sent():
    """A level is the arrival process's mean: the knee uses the rate each run really offered."""
    samples = pd.DataFrame({"start_ts": 100 + np.arange(0, 60, 0.5)})  # 120 sends over 59.5 s
    assert offered_rate(samples, 3.0) == pytest.approx(119 / 59.5)
    assert offered_rate(samples.head(3), 3.0) == 3.0  # too few sends: the level
    t = table([{"level": 4.0, "offered": 3.7, "unbounded": False, "meets_slo": True},
               {"level": 5.0, "offered": 4.6, "unbounded": True, "meets_slo": False,
                "capacity_estimate": 4.0}])
    knee = find_knee(t)
    assert knee["knee_unbounded"] == 4.0 and knee["bracket"] == (4.0, 5.0)
    assert knee["knee_slo"] == 3.7 and knee["max_sustainable"] == 3.7


def test_a_marginal_overload_is_confirmed_by_a_longer_run(tmp_path):
    """Just under the capacity a short run's queue is still filling: the first level called
    unbounded by a small margin runs again 3x as long, and at a level run twice the longer run decides."""
    # Level 5 served 8% short of what it sent (the threshold is 5%): within twice it, marginal.
    marginal = table([{"level": 4.0, "unbounded": False, "meets_slo": True, "served": 4.0, "sent": 4.0,
                       "edges": 0.0},
                      {"level": 5.0, "unbounded": True, "meets_slo": False, "served": 4.6, "sent": 5.0,
                       "edges": 0.0},
                      {"level": 6.0, "unbounded": True, "meets_slo": False, "served": 4.8, "sent": 6.0,
                       "edges": 0.0}])
    assert stress.next_levels(marginal) == ([], [5.0])
    clear = marginal.assign(served=[4.0, 4.0, 4.8])  # 20% short: no doubt
    assert stress.next_levels(clear) == ([4.25, 4.5, 4.75], [])  # no doubt: refine the bracket
    assert stress.next_levels(marginal.assign(confirmed=[False, True, False])) == ([4.25, 4.5, 4.75], [])

    s = stress.stress_scenario(resolve("default", None, ["load.stop.duration_s=20"]), "ramp")
    points = stress.staircase_points(s, [2.0, 5.0]) + stress.confirm_points(s, [5.0])
    assert [p.scenario.load.stop.duration_s for p in points] == [20, 20, 60]
    plans.execute(plans.Plan("c", "stress", points, {"shape": "ramp"}), PredictBackend(),
                  tmp_path / "lab.db", tmp_path / "w")
    store = Store(tmp_path / "lab.db")
    t = levels_table(store, "c", store.runs("c"))
    assert list(t["level"]) == [2.0, 5.0] and list(t["confirmed"]) == [False, True]
    long_run = store.runs("c").loc[lambda r: r["point"].map(lambda p: p["load.shape.level"]) == 5.0]
    assert t["request_throughput"].iloc[1] == long_run.sort_values("duration_s")["request_throughput"].iloc[-1]


def test_bad_shape_is_one_sentence():
    with pytest.raises(ScenarioError, match="SHAPE='wave': allowed values are ramp, step, spike, soak"):
        stress.stress_scenario(resolve("default"), "wave")


def test_predictor_staircase_finds_the_capacity(tmp_path):
    """On the predictor the knee lies within 10% of the saturated capacity (queue at the server)."""
    s = stress.stress_scenario(resolve("default", None, ["load.stop.duration_s=30",
                                                         "serve.max-num-seqs=64"]), "ramp")
    capacity = stress.predicted_capacity(s)
    levels = [round(capacity * f, 3) for f in (0.5, 0.8, 1.2, 1.5)]
    plan = plans.Plan("st", "stress", stress.staircase_points(s, levels),
                      {"shape": "ramp", "params": ["load.shape.level"]})
    plans.execute(plan, PredictBackend(), tmp_path / "lab.db", tmp_path / "w")
    store = Store(tmp_path / "lab.db")
    t = levels_table(store, "st", store.runs("st"))
    knee = find_knee(t)
    assert not t[t["level"] <= 0.8 * capacity]["unbounded"].any()
    assert t[t["level"] >= 1.2 * capacity]["unbounded"].all()
    assert abs(knee["knee_unbounded"] / capacity - 1) < 0.10
    index = report.build(tmp_path / "lab.db", "st", tmp_path)
    assert (index.parent / "stress.png").exists() and "Knee at" in index.read_text()


def test_a_staircase_broken_from_its_first_level_names_no_knee_at_zero():
    """The guide's realtime-chat template on an H100 (reports/examples/h100, h100-chat-stairs-b):
    the SLO broken at every level, the server serving 10.9 req/s from 24 on. The knee lies below
    the lowest level; the headline says so instead of 'Knee at 0 req/s'."""
    from vllm_lab.reports.stress import _staircase_headline

    t = pd.DataFrame({"level": [12.0, 24.0, 36.0], "offered": [12.2, 24.4, 37.6], "ok": True,
                      "unbounded": [False, True, True], "meets_slo": False,
                      "capacity_estimate": [math.nan, 10.9, 10.9]})
    knee = find_knee(t)
    assert knee["knee"] == 0 and knee["knee_slo"] == 0 and knee["max_sustainable"] is None
    assert _staircase_headline(knee) == (
        "Knee below the lowest level asked; past 12.2 req/s the server serves less than it is "
        "sent: its work in flight grows; the SLO is broken from the lowest level on; no level was "
        "sustainable under the SLO.")


def synthetic_run(spike: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run of 60 s: base TTFT 50 ms, 200 ms during a spike at 20-30 s that drains by 36 s."""
    t = np.arange(0, 60, 0.1)
    ttft = np.full_like(t, 0.05)
    if spike:
        ttft[(t >= 20) & (t < 36)] = 0.2
    samples = pd.DataFrame({"start_ts": 1000 + t, "ttft_s": ttft, "tpot_s": 0.01 + t * 1e-4,
                            "e2e_s": ttft + 0.5, "status": "ok"})
    ts = 1000 + np.arange(0, 60, 1.0)
    waiting = np.where((ts - 1000 >= 20) & (ts - 1000 < 36), 30.0, 0.0) if spike else np.zeros_like(ts)
    metrics = pd.DataFrame({"ts": ts, "name": "vllm:num_requests_waiting", "labels": "", "value": waiting})
    kv = metrics.assign(name="vllm:kv_cache_usage_perc", value=0.2 + (ts - 1000) / 600)
    return samples, pd.concat([metrics, kv])


def test_spike_recovery_and_soak_drift():
    s = resolve("default", None, ["load.shape.kind=spike", "load.shape.spike_at_s=20",
                                  "load.shape.spike_s=10"])
    samples, metrics = synthetic_run(spike=True)
    found = spike_behaviour(windows(samples, metrics), s)
    assert found["peak_queue"] == 30 and 5 <= found["recovery_s"] <= 8
    samples, metrics = synthetic_run(spike=False)
    drift = soak_drift(windows(samples, metrics))
    assert drift["tpot_p50_drift"] > 0.2 and drift["kv_usage_drift"] > 0.2
    assert abs(drift["ttft_p50_drift"]) < 0.01


@pytest.mark.integration
@pytest.mark.slow
def test_live_twin_staircase(tmp_path):
    """A two-level staircase on the twin (cpu-demo): below capacity bounded, far above it not."""
    inventory = private_inventory(tmp_path)
    # Sends 125 ms apart at the top level: a send 50 ms late moves neither level's verdict. The
    # lab's 10-ms guard is for a client with a core of its own; on a 2-core machine that other
    # tests load too, a client at 3% CPU still waits 10-15 ms for a core (p99, a CI run).
    sets = ["workload.source=alpaca-like", "serve.max-num-seqs=8", "load.stop.duration_s=12",
            "run.warmup_requests=2", "load.max_schedule_lag_s=0.05"]
    cmd = [sys.executable, str(REPO / "scripts/lab.py"), "stress", "--shape", "ramp", "--levels", "1.5,8",
           "--refine", "0", "--hardware", "cpu-demo", "--inventory", str(inventory),
           "--out", str(tmp_path / "reports"), "--experiment", "live-st",
           *[x for s in sets for x in ("--set", s)]]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    store = Store(tmp_path / "reports/lab.db")
    t = levels_table(store, "live-st", store.runs("live-st")).set_index("level")
    assert set(t["status"]) == {"ok"}
    assert not t.loc[1.5, "unbounded"] and t.loc[8.0, "unbounded"]
    assert t.loc[8.0, "queue_growth"] > 0  # the twin's own vllm:num_requests_waiting grows
    assert (tmp_path / "reports/live-st/stress.png").exists()
    # Each run says what CPU its load generator's host gave it (a quota's throttled time where
    # the kernel counts it: this machine's, for the run's span).
    for r in store.runs("live-st").itertuples():
        summary = json.loads(r.summary_json)
        assert 1 <= summary["client_host_cpus"] <= os.cpu_count()
        assert 1 <= summary.get("client_host_physical_cores", 1) <= summary["client_host_cpus"]
        assert summary.get("client_host_throttled_s", 0.0) >= 0.0


def open_loop_run(capacity: float, e2e_growth: float = 0.0) -> pd.DataFrame:
    """40 s of arrivals at 10 req/s, 100 output tokens each, served first come first served by a
    server finishing ``capacity`` requests a second (a request waits for its turn, then streams
    for about a second), and each request's stream 1 s plus ``e2e_growth`` s for every second
    into the run (a batch that fills and slows, while keeping up)."""
    t = np.arange(0, 40, 0.1)
    own = 1.0 + e2e_growth * t
    done = np.maximum.accumulate(np.maximum(t + own, 1.0 / capacity * np.arange(1, len(t) + 1)))
    e2e = done - t
    ttft = np.maximum(e2e - own, 0.0) + 0.05  # the wait for its turn, then its first token
    return pd.DataFrame({"start_ts": 1000 + t, "ttft_s": ttft, "tpot_s": (e2e - ttft) / 99,
                         "e2e_s": e2e, "output_tokens": 100, "status": "ok"})


def test_overload_is_read_from_what_is_served_alike_with_or_without_vllms_queue():
    """A level is overloaded when the work in flight grows: served (each request counted by the
    tokens it got in the window) short of sent. A batch filling within a short level keeps up
    though its E2E climbs; the same samples get the same verdict on both backends, with vLLM's
    waiting-queue series (live) or without one (the predictor)."""
    summary = {"warmup_s": 10.0, "duration_s": 20.0, "meets_slo": True}
    filling = open_loop_run(capacity=1000.0, e2e_growth=0.04)
    over = open_loop_run(capacity=8.0)
    ts = 1000 + np.arange(0, 40, 1.0)
    growing = pd.DataFrame({"ts": ts, "name": "vllm:num_requests_waiting", "labels": "", "value": ts - 1000})
    flat = growing.assign(value=0.0)
    for metrics in (None, growing, flat):
        bounded = level_verdict(10.0, summary, filling, metrics)
        assert bounded["latency_growth"] > GROWTH_SLOPE  # the trend alone would have called it
        assert not bounded["unbounded"] and bounded["sustainable"]
        overloaded = level_verdict(10.0, summary, over, metrics)
        assert overloaded["unbounded"] and not overloaded["sustainable"]
        assert overloaded["capacity_estimate"] == pytest.approx(8.0, rel=0.05)
    assert level_verdict(10.0, summary, over, growing)["queue_growth"] > 0  # shown, not judged
