"""scripts/gc_probe/sitecustomize.py: the line a second it writes for a probed process, here its
event loop's lag, read from a real Python process started with the probe on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "gc_probe"

# An asyncio program that blocks its loop for 80 ms twice a second for 2.6 s; the marker in its
# command line is what the probe is told to match.
BLOCKING = """
import asyncio, time  # loop-lag-probe-test
async def main():
    end = time.monotonic() + 2.6
    while time.monotonic() < end:
        await asyncio.sleep(0.42)
        time.sleep(0.08)
asyncio.run(main())
"""


# Two loops one after the other, as `vllm bench serve` called twice in one process runs them: the
# first idle for 1.5 s, the second blocked for 80 ms twice a second.
TWO_LOOPS = """
import asyncio, time  # loop-lag-probe-test
asyncio.run(asyncio.sleep(1.5))
async def main():
    end = time.monotonic() + 2.6
    while time.monotonic() < end:
        await asyncio.sleep(0.42)
        time.sleep(0.08)
asyncio.run(main())
"""


def _probed(tmp_path, program: str = BLOCKING, **env) -> pd.DataFrame:
    out = tmp_path / "probe"
    run = subprocess.run(
        [sys.executable, "-c", program], check=False, capture_output=True, text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(PROBE), "LAB_GC_PROBE": str(out),
             "LAB_GC_PROBE_MATCH": "loop-lag-probe-test", "LAB_GC_PROBE_THREADS_S": "0", **env})
    assert run.returncode == 0, run.stderr
    (path,) = out.glob("gc-*.csv")
    return pd.read_csv(path, comment="#")


@pytest.mark.integration
@pytest.mark.untimed  # a lower bound only: a slower machine makes the waits longer, not shorter
def test_the_probe_times_how_long_the_event_loop_keeps_a_ready_callback_waiting(tmp_path):
    lines = _probed(tmp_path, LAB_GC_PROBE_LOOP_MS="5")
    assert {"loop_n", "loop_mean_ms", "loop_max_ms"} <= set(lines.columns)
    timed = lines.dropna(subset=["loop_max_ms"])
    assert len(timed) >= 2 and (timed["loop_n"] > 20).all()   # a callback every 5 ms
    assert timed["loop_max_ms"].max() >= 60                       # an 80-ms block, seen
    assert timed["loop_mean_ms"].max() < timed["loop_max_ms"].max()
    # Off: the columns stay, empty.
    off = _probed(tmp_path / "off", LAB_GC_PROBE_LOOP_MS="0")
    assert off["loop_n"].isna().all() and len(off) >= 2


@pytest.mark.integration
@pytest.mark.untimed
def test_the_probe_times_each_loop_a_process_runs_in_turn(tmp_path):
    lines = _probed(tmp_path, TWO_LOOPS, LAB_GC_PROBE_LOOP_MS="5")
    timed = lines.dropna(subset=["loop_max_ms"])
    assert timed["loop_max_ms"].max() >= 60  # the second loop's 80-ms blocks, seen
