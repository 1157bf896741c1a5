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
