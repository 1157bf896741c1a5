"""The traffic a report's runs were given, and what it cost in energy, drawn beside the results.

A trace's arrival rate over the run (as sent, after speed, window and rate) and its prompt and
output lengths, so a reader sees which traffic the flags were ranked on; and, where the runs
recorded energy, joules per output token against the swept value.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_lab.reports.figures import plt, save_captioned
from vllm_lab.scenarios import Scenario


def trace_figure(runs: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """The first run's trace: requests per 10 s as sent, and its length histograms; None when
    the runs replayed no trace."""
    if runs.empty or "scenario_json" not in runs:
        return None
    scenario = Scenario.model_validate(json.loads(runs["scenario_json"].iloc[0]))
    if scenario.workload.source != "trace":
        return None
    from vllm_lab.traffic.traces import TraceError, replay_times, trace_requests

    try:
        rows = trace_requests(scenario.workload, scenario.load)
    except TraceError:
        return None  # the trace file is gone: the page says nothing it cannot show
    replay = scenario.load.replay
    times = np.array(replay_times(rows, replay) if replay else [r.t_s for r in rows])
    fig, (rate, lengths) = plt.subplots(1, 2, figsize=(10, 3.4))
    bins = np.arange(0.0, max(times.max(), 10.0) + 10.0, 10.0)
    counts, edges = np.histogram(times, bins)
    rate.step(edges[:-1], counts / 10.0, where="post", color="#1f77b4")
    rate.set(xlabel="time into the run (s)", ylabel="requests/s (10 s bins)",
             title=f"{Path(scenario.workload.path).name}: {len(rows):,} requests")
    lengths.hist([r.prompt_tokens for r in rows], bins=40, alpha=0.6, label="prompt tokens")
    lengths.hist([r.output_tokens for r in rows], bins=40, alpha=0.6, label="output tokens")
    lengths.set(xlabel="tokens", ylabel="requests", title="lengths")
    lengths.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save_captioned(fig, folder / "trace.png", caption)


def energy_figure(table: pd.DataFrame, param: str, folder: Path, caption: str) -> Path | None:
    """Joules per output token against a swept value; None when the points recorded no energy."""
    if "joules_per_output_token" not in table or table["joules_per_output_token"].isna().all():
        return None
    t = table.dropna(subset=["joules_per_output_token"])
    x = [str(v) for v in t[param]]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(x, t["joules_per_output_token"], color="#2ca02c")
    ax.set(xlabel=param, ylabel="joules per output token",
           title="energy per output token (lower is better)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save_captioned(fig, folder / "energy.png", caption)
