"""The regression watch against a live twin: a baseline, then a probe on the same flags passes and
a probe after a redeploy with much slower flags is flagged; the bound follows the spread."""

from __future__ import annotations

import pandas as pd
import pytest

from vllm_lab import watch
from vllm_lab.store import Store


def test_the_bound_follows_the_baselines_spread():
    tight, loose = [100.0, 101.0, 99.0], [100.0, 130.0, 70.0]
    assert watch.bound(tight, +1) > watch.bound(loose, +1)  # a noisy baseline tolerates more
    assert watch.bound(tight, +1) < 100 < watch.bound(tight, -1)
    # Identical repeats still leave room for the probe's own resolution (the sd floor).
    assert watch.bound([100.0, 100.0, 100.0], +1) < 100


def _runs(baseline: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"point": [{"role": "baseline"}] * len(baseline), "status": "ok",
                         "output_throughput": baseline, "ttft_p50": 0.1, "tpot_p50": 0.02,
                         "e2e_p50": 1.0})


def test_judge_flags_only_what_leaves_the_interval():
    runs = _runs([1000.0, 1020.0, 990.0])
    assert watch.judge(runs, {"output_throughput": 985.0, "ttft_p50": 0.1}).regressed == []
    verdict = watch.judge(runs, {"output_throughput": 600.0, "ttft_p50": 0.3})
    assert verdict.regressed == ["output_throughput", "ttft_p50"]
    assert "REGRESSION" in verdict.lines[0] and "n=3" in verdict.lines[0]


def test_judge_needs_a_baseline():
    with pytest.raises(watch.WatchError, match="BASELINE=1"):
        watch.judge(_runs([1000.0]), {"output_throughput": 1.0})


@pytest.mark.integration
@pytest.mark.slow
def test_probe_on_slower_flags_is_flagged_and_same_flags_are_not(tmp_path):
    from tests.support.processes import TwinProcess

    store = tmp_path / "lab.db"
    short = ["load.stop.duration_s=6"]
    twin = TwinProcess(tmp_path)
    try:
        lines: list[str] = []
        same = watch.run_schedule(store, url=twin.url, baseline=True, repeats=3,
                                  probe_overrides=short, workdir=tmp_path / "work", echo=lines.append)
    finally:
        twin.stop()
    assert not same, "\n".join(lines)
    # The same deployment redeployed with one sequence per step instead of vLLM's default 256.
    slow = TwinProcess(tmp_path, "--max-num-seqs", "1", port=twin.port)
    try:
        lines = []
        slower = watch.run_schedule(store, url=slow.url, probe_overrides=short,
                                    workdir=tmp_path / "work", echo=lines.append)
    finally:
        slow.stop()
    assert slower, "\n".join(lines)
    runs = Store(store).runs()
    assert set(runs["step"]) == {"watch"} and runs["experiment_id"].nunique() == 1
    roles = runs["point"].map(lambda p: p["role"]).tolist()
    assert roles == ["baseline"] * 3 + ["probe"] * 2
    flags = runs["summary"].map(lambda s: s.get("regression")).tolist()
    assert flags[3:] == [False, True]
    assert "output_throughput" in runs.iloc[-1]["summary"]["regressed_metrics"]


def test_a_probe_past_the_failed_requests_threshold_is_failed_requests():
    from vllm_lab.failures import RequestFailures

    assert watch._probe_status(RequestFailures(100, 1, "HTTP 500", 1, ""), 0.05)[0] == "ok"
    status, error = watch._probe_status(RequestFailures(100, 10, "HTTP 500", 10, ""), 0.05)
    assert status == "failed-requests" and error.startswith("10 of 100 requests failed")
    assert watch._probe_status(RequestFailures(40, 40, "HTTP 400", 40, ""), 0.05)[0] == "crashed"
    assert watch._probe_status(RequestFailures(0, 0, "", 0, ""), 0.05)[0] == "crashed"


def test_a_failing_probe_is_a_regression_whatever_its_figures():
    verdict = watch.judge(_runs([1000.0, 1010.0, 990.0]), {"output_throughput": 1000.0},
                          "10 of 100 requests failed (10%); most: HTTP 500 (10)")
    assert verdict.regressed == ["failed_requests"]
    assert verdict.lines[0].startswith("failed requests: 10 of 100") and "REGRESSION" in verdict.lines[0]


@pytest.mark.integration
def test_failed_requests_are_a_regression_and_a_failing_baseline_is_refused(tmp_path):
    """The probe asks 64 + 32 tokens: a twin redeployed with a 64-token context refuses them all."""
    from tests.support.processes import TwinProcess

    store = tmp_path / "lab.db"
    short = ["load.stop.duration_s=4"]
    good = TwinProcess(tmp_path)
    try:
        assert not watch.run_schedule(store, url=good.url, baseline=True, repeats=2,
                                      probe_overrides=short, workdir=tmp_path / "work", echo=print)
    finally:
        good.stop()
    failing = TwinProcess(tmp_path, "--max-model-len", "64", port=good.port)
    try:
        lines: list[str] = []
        assert watch.run_schedule(store, url=failing.url, probe_overrides=short,
                                  workdir=tmp_path / "work", echo=lines.append)
        assert "REGRESSION in failed_requests" in lines[0] and "HTTP 400" in lines[1], lines
        with pytest.raises(watch.WatchError, match="baseline probe 1 of 2 is crashed .*HTTP 400.*"
                                                    "the one before is kept"):
            watch.run_schedule(store, url=failing.url, baseline=True, repeats=2,
                               probe_overrides=short, workdir=tmp_path / "work", echo=print)
    finally:
        failing.stop()
    runs = Store(store).runs()
    roles = runs["point"].map(lambda p: p["role"]).tolist()
    assert roles == ["baseline"] * 2 + ["probe"] * 2 + ["refused-baseline"]
    assert list(runs["status"]) == ["ok", "ok", "ok", "crashed", "crashed"]
