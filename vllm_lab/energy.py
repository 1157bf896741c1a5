"""The GPUs' energy over a run's window, from what the host's telemetry scraped: the energy
counter (NVML's, as the DCGM exporter names it; the twin's power model exports the same series)
or, without one, the power samples integrated; per output token and per joule."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

ENERGY_COUNTER = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"   # mJ since the driver (or twin) started
POWER = "DCGM_FI_DEV_POWER_USAGE"                          # W


def energy_view(metrics: pd.DataFrame | None, t0: float, t1: float,
                output_tokens: float) -> dict[str, Any]:
    """The GPUs' energy over [t0, t1] and per output token, from the run's GPU series: each
    GPU's energy counter read at both ends (interpolated between scrapes), else its power samples
    integrated; {} when the run has neither."""
    if metrics is None or metrics.empty or t1 <= t0:
        return {}
    joules, source = _counter_energy(metrics, t0, t1), "energy counter"
    if joules is None:
        joules, source = _power_energy(metrics, t0, t1), "power samples"
    if joules is None:
        return {}
    out: dict[str, Any] = {"energy_j": joules, "power_mean_w": joules / (t1 - t0),
                           "energy_source": source}
    if output_tokens > 0 and joules > 0:
        out["joules_per_output_token"] = joules / output_tokens
        out["output_tokens_per_joule"] = output_tokens / joules
    return out


def _per_gpu(metrics: pd.DataFrame, name: str):
    rows = metrics[metrics["name"] == name]
    for _labels, g in rows.groupby("labels"):
        g = g.sort_values("ts")
        yield g["ts"].to_numpy(dtype=float), g["value"].to_numpy(dtype=float)


def _counter_energy(metrics: pd.DataFrame, t0: float, t1: float) -> float | None:
    total, seen = 0.0, False
    for ts, v in _per_gpu(metrics, ENERGY_COUNTER):
        if len(ts) < 2 or ts[0] > t0 or ts[-1] < t1:
            continue  # a counter that does not cover the window says nothing about it
        total += float(np.interp(t1, ts, v) - np.interp(t0, ts, v)) / 1000.0
        seen = True
    return total if seen else None


def _power_energy(metrics: pd.DataFrame, t0: float, t1: float) -> float | None:
    total, seen = 0.0, False
    for ts, v in _per_gpu(metrics, POWER):
        inside = (ts > t0) & (ts < t1)
        if len(ts) < 2 or inside.sum() < 1:
            continue
        grid = np.concatenate([[t0], ts[inside], [t1]])
        watts = np.interp(grid, ts, v)
        total += float(np.sum((watts[1:] + watts[:-1]) / 2 * np.diff(grid)))
        seen = True
    return total if seen else None
