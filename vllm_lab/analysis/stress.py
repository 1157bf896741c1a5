"""What a stress run says: whether a level's work in flight grows without bound, the knee of a
staircase, a spike's recovery and a soak's drift, from the runs in the store.

Only an open loop has an offered load: a closed loop's users wait for their answers, so its queue
can never grow without bound; the staircase levels are open-loop runs (``vllm_lab.stress`` plans
them). Each level starts from an empty server, so a queue (and E2E) that grows within a run is that
level's own doing.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab.run_summary import RunSummary
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store
from vllm_lab.summary import served_share

# Time in the system (E2E) rising by more than this many seconds per second of the run: for
# arrivals at rate L and a capacity C, N(t) grows at L - C and by Little's law a request arriving
# at t stays about N(t)/C, so E2E climbs at L/C - 1 s/s. Shown beside each level, not judged: in a
# 30-s level a large batch that is still filling climbs as fast as an overload does (a predictor
# run of 300 s settles where the first 30 s climbed 0.19 s/s), and vLLM's waiting queue, the
# other sign, stays empty where the backlog sits in the running batch or in the API server.
GROWTH_SLOPE = 0.03
# Served within this share of offered is keeping up: a short run's Poisson arrivals and the
# requests in flight at its window's edges move the two apart by a few percent, no more.
SERVED_TOLERANCE = 0.05
# ... and by the requests in flight at the edges, a count that varies as a Poisson one does: a
# shortfall within this many of its standard deviations (sqrt of those in flight) is that noise.
# At 1.5 req/s over 12 s, two requests of about 20 are 10%: the share alone would call it short.
IN_FLIGHT_SIGMAS = 2.0
LEVEL_COLUMNS = ("request_throughput", "output_throughput", "goodput", "errors", "ttft_p50",
                 "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p90", "e2e_p99", "tpot_p99", "queue_len_max",
                 "preemptions")


def latency_growth(samples: pd.DataFrame) -> float:
    """Slope of latency (s) against send time (s) over a run; unfinished requests count to its end."""
    if samples is None or samples.empty or len(samples) < 10:
        return 0.0
    t = samples["start_ts"].to_numpy(dtype=float)
    t = t - t.min()
    end = float(np.nanmax(t + samples["e2e_s"].fillna(0).to_numpy(dtype=float)))
    # E2E with every request's own length replaced by the mean: TTFT + TPOT x mean output. The
    # lengths' spread would otherwise drown the trend; queueing (TTFT) and batch growth (TPOT) stay.
    mean_out = float(samples["output_tokens"].fillna(0).mean()) if "output_tokens" in samples else 0.0
    tpot = samples["tpot_s"].fillna(0).to_numpy(dtype=float) if "tpot_s" in samples else 0.0
    e2e = samples["ttft_s"].to_numpy(dtype=float) + tpot * max(mean_out - 1, 0)
    e2e = np.where(np.isnan(e2e), np.maximum(end - t, 0.0), e2e)  # never answered: waited all along
    # The first third is the fill from an empty server (batches and TPOT grow to steady state):
    # a transient, not growth without bound.
    late = t >= np.ptp(t) / 3
    if late.sum() < 5 or np.ptp(t[late]) <= 0:
        return 0.0
    return float(np.polyfit(t[late], e2e[late], 1)[0])


def queue_growth(metrics: pd.DataFrame | None, until: float | None = None) -> float | None:
    """Slope (requests/s) of the server's waiting queue, from /metrics; None without a series.

    Only the arrival window counts (scrapes up to ``until``, the last send): once arrivals stop,
    the run drains its in-flight requests and the queue falls, whatever the load was.
    """
    if metrics is None or metrics.empty:
        return None
    if until is not None:
        metrics = metrics[metrics["ts"] <= until]
    waiting = metrics[metrics["name"] == "vllm:num_requests_waiting"].groupby("ts")["value"].sum()
    if len(waiting) < 3:
        return None
    t = waiting.index.to_numpy(dtype=float)
    return float(np.polyfit(t - t[0], waiting.to_numpy(dtype=float), 1)[0])


def offered_rate(samples: pd.DataFrame | None, level: float) -> float:
    """Requests/s the run really offered: sends over the arrival window (the level without samples).

    A level is the arrival process's mean rate; one run draws one realisation of it, and the
    predictor and Locust draw it from the same seed at every level, so every level of a
    staircase is off by the same factor (7% low for 540 Poisson arrivals of one seed), and a
    live client that falls behind sends less still. The knee is read on this axis.
    """
    if samples is None or len(samples) < 10:
        return level
    t = samples["start_ts"].to_numpy(dtype=float)
    span = float(np.nanmax(t) - np.nanmin(t))
    return (len(t) - 1) / span if span > 0 else level


def served_and_sent(samples: pd.DataFrame | None,
                    summary: Mapping[str, Any]) -> tuple[float | None, float | None, float]:
    """Requests/s served and sent inside the run's steady window, both from its samples over the
    same span (a Poisson run's arrivals over all of it differ from those in a part of it), served
    as the summary counts it (``summary.served_share``): a run recorded before that count read
    its served rate short by the requests in flight at the window's end, and is read alike.
    Third: the rate the requests in flight at the window's edges can move them apart by
    (``IN_FLIGHT_SIGMAS`` standard deviations of that count, by Little's law served x E2E)."""
    s = RunSummary.of(summary)
    if samples is None or samples.empty or s.warmup_s is None or not s.duration_s:
        return None, None, 0.0
    sends = samples["start_ts"].to_numpy(dtype=float)
    t0 = float(np.nanmin(sends)) + s.warmup_s
    t1 = t0 + s.duration_s
    ok = samples[samples["status"] == "ok"] if "status" in samples else samples
    served = float(served_share(ok, t0, t1).sum()) / s.duration_s
    e2e = float(ok["e2e_s"].mean()) if len(ok) and "e2e_s" in ok else 0.0
    edges = IN_FLIGHT_SIGMAS * np.sqrt(max(served * e2e, 0.0)) / s.duration_s
    return served, float(((sends >= t0) & (sends <= t1)).sum()) / s.duration_s, edges


def level_verdict(level: float, summary: Mapping[str, Any], samples: pd.DataFrame,
                  metrics: pd.DataFrame | None) -> dict[str, Any]:
    """One staircase level: bounded or not, the SLO verdict, and the capacity it implies.

    A level is sustainable when the server serves what it is offered (served within
    ``SERVED_TOLERANCE`` of the rate sent inside the same window, less the noise of the requests
    in flight at its edges) and the SLO holds. Served is counted by the tokens each request got
    inside the window (``served_and_sent``), so sent less served is how fast the work in flight
    grows, wherever it waits: vLLM's queue, its running batch or its API server. Both backends
    are judged by it alike, from their samples; the E2E trend and vLLM's waiting queue are shown
    beside it (``latency_growth``, ``queue_growth``), as neither tells a short level's fill from
    an overload (``GROWTH_SLOPE``). An overloaded level served what the server could: that is
    the capacity it implies.
    """
    last_send = float(samples["start_ts"].max()) if samples is not None and len(samples) else None
    served, sent, edges = served_and_sent(samples, summary)
    short = served is not None and sent is not None \
        and served < (1 - SERVED_TOLERANCE) * sent - edges
    meets = bool(RunSummary.of(summary).meets_slo)
    return {"level": level, "offered": offered_rate(samples, level), "served": served, "sent": sent,
            "edges": edges, "served_short": short, "latency_growth": latency_growth(samples),
            "queue_growth": queue_growth(metrics, until=last_send), "unbounded": short,
            "meets_slo": meets, "sustainable": meets and not short,
            "capacity_estimate": served if short else math.nan}


def find_knee(levels: pd.DataFrame) -> dict[str, Any]:
    """The knee, the highest load that holds, and the highest that holds under the SLO.

    ``levels`` has one row per offered load (level, unbounded, meets_slo, capacity_estimate, ok;
    ``offered``, the rate a run really sent, where known). The loads returned are on the offered
    axis; ``bracket`` (the last bounded and the first unbounded level) is in levels, for the
    ramp's next round. The unbounded-growth knee is the capacity the lowest overloaded level
    implies (what it served), kept inside the bracket.
    """
    t = levels[levels["ok"]].sort_values("level")
    out: dict[str, Any] = {"knee": None, "knee_unbounded": None, "knee_slo": None,
                           "max_sustainable": None, "bracket": None}
    if t.empty:
        return out
    x = offered_axis(t)
    bad = t[t["unbounded"]]
    if len(bad):
        first_bad = float(bad["level"].iloc[0])
        below = t[(t["level"] < first_bad)]
        last_good = float(below["level"].iloc[-1]) if len(below) else 0.0
        lo = float(x[below.index[-1]]) if len(below) else 0.0
        hi = float(x[bad.index[0]])
        # The lowest overloaded level is the closest to the knee: its queue grows the least, so
        # the service rate it saw is the one at the knee (higher levels preempt and slow down).
        est = float(bad["capacity_estimate"].iloc[0])
        est = hi if math.isnan(est) else est
        out["knee_unbounded"] = min(max(est, lo), hi) if lo <= hi else est
        out["bracket"] = (last_good, first_bad)
    broken = t[~t["meets_slo"]]
    if len(broken):
        first = float(broken["level"].iloc[0])
        below = t[t["level"] < first]
        out["knee_slo"] = float(x[below.index[-1]]) if len(below) else 0.0
    knees = [k for k in (out["knee_unbounded"], out["knee_slo"]) if k is not None]
    out["knee"] = min(knees) if knees else None
    good = sustainable(t)
    holds = t[good]
    if len(holds):
        # The highest level below which every level holds: a level that holds past a broken
        # one is luck, not capacity.
        fails = t[~good]
        limit = float(fails["level"].iloc[0]) if len(fails) else math.inf
        ok_below = holds[holds["level"] < limit]
        out["max_sustainable"] = float(x[ok_below.index[-1]]) if len(ok_below) else None
    return out


def sustainable(levels: pd.DataFrame) -> pd.Series:
    """Per level: served as offered with a bounded queue, and the SLO met (``level_verdict``)."""
    return levels["meets_slo"].astype(bool) & ~levels["unbounded"].astype(bool)


def offered_axis(levels: pd.DataFrame) -> pd.Series:
    """The load each level really offered (its level where a run has no samples): every knee and
    capacity is read on it."""
    return levels["offered"].fillna(levels["level"]) if "offered" in levels else levels["level"]


def levels_table(store: Store, exp_id: str, runs: pd.DataFrame) -> pd.DataFrame:
    """One row per offered level: the summary, the growth verdict and the SLO verdict."""
    rows = []
    runs = _longest_per_level(runs)
    for _, run in runs.iterrows():
        level = float(run["point"]["load.shape.level"])
        ok = run["status"] == "ok"  # a client-limited level tells nothing of the server
        row = {"level": level, "ok": ok, "status": run["status"], "confirmed": run["confirmed"],
               **{m: run[m] for m in LEVEL_COLUMNS if m in run}}
        if ok:
            verdict = level_verdict(level, RunSummary.of_row(run),
                                           store.samples(exp_id, run["run_key"]),
                                           store.server_metrics(exp_id, run["run_key"]))
            row.update(verdict)
        else:
            row.update(unbounded=False, meets_slo=False, sustainable=False, latency_growth=math.nan,
                       capacity_estimate=math.nan, queue_growth=None)
        rows.append(row)
    return pd.DataFrame(rows).sort_values("level").reset_index(drop=True)


def _longest_per_level(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs of each level's longest duration (a confirmation supersedes the short run)."""
    if runs.empty:
        return runs.assign(confirmed=pd.Series(dtype=bool))
    duration = runs["scenario_json"].map(lambda j: json.loads(j)["load"]["stop"]["duration_s"] or 0.0)
    level = runs["point"].map(lambda p: float(p["load.shape.level"]))
    longest = duration.groupby(level).transform("max")
    return runs.assign(confirmed=duration.groupby(level).transform("nunique") > 1)[duration == longest]


def windows(samples: pd.DataFrame, metrics: pd.DataFrame | None, width_s: float = 2.0) -> pd.DataFrame:
    """The run in windows of ``width_s``: arrivals, completions, errors, TTFT p50/p99, queue, KV."""
    if samples is None or samples.empty:
        return pd.DataFrame()
    t0 = float(samples["start_ts"].min())
    s = samples.assign(t=samples["start_ts"] - t0, end=samples["start_ts"] - t0 + samples["e2e_s"])
    edges = np.arange(0, float(np.nanmax(s["end"].fillna(s["t"]))) + width_s, width_s)
    rows = []
    for a, b in itertools.pairwise(edges):
        sent = s[(s["t"] >= a) & (s["t"] < b)]
        ok = sent[sent["status"] == "ok"]
        row = {"t": a, "offered": len(sent) / width_s,
               "completed": float(((s["end"] >= a) & (s["end"] < b) & (s["status"] == "ok")).sum()) / width_s,
               "errors": float((sent["status"] != "ok").sum()),
               "ttft_p50": float(ok["ttft_s"].median()) if len(ok) else math.nan,
               "ttft_p99": float(ok["ttft_s"].quantile(0.99)) if len(ok) else math.nan,
               "tpot_p50": float(ok["tpot_s"].median()) if len(ok) else math.nan}
        rows.append(row)
    out = pd.DataFrame(rows)
    if metrics is not None and not metrics.empty:
        for name, col in (("vllm:num_requests_waiting", "waiting"), ("vllm:kv_cache_usage_perc", "kv_usage"),
                          ("vllm:num_preemptions_total", "preemptions_total"),
                          ("DCGM_FI_DEV_FB_USED", "gpu_mem_mib")):
            series = metrics[metrics["name"] == name].groupby("ts")["value"].sum()
            if len(series):
                st = series.index.to_numpy(dtype=float) - t0
                idx = np.searchsorted(out["t"].to_numpy() + width_s, st, side="right")
                vals = pd.Series(series.to_numpy(), index=idx).groupby(level=0).max()
                out[col] = out.index.map(lambda i, v=vals: v.get(i, math.nan))
    return out


def spike_behaviour(win: pd.DataFrame, scenario: Scenario) -> dict[str, Any]:
    """Queue, preemptions and errors in the spike, and the seconds until latency and queue recover."""
    shape = scenario.load.shape
    start, end = shape.spike_at_s, shape.spike_at_s + shape.spike_s
    before, during = win[win["t"] < start], win[(win["t"] >= start) & (win["t"] < end)]
    base_ttft = float(before["ttft_p50"].median()) if len(before) else math.nan
    base_queue = float(before["waiting"].max()) if "waiting" in before and len(before) else 0.0
    after = win[win["t"] >= end]
    recovered_at = None
    for _, row in after.iterrows():
        calm = (math.isnan(base_ttft) or row["ttft_p50"] <= 1.5 * base_ttft + 0.02)
        if "waiting" in win and not math.isnan(row.get("waiting", math.nan)):
            calm = calm and row["waiting"] <= max(base_queue, 1.0)
        if calm:
            recovered_at = float(row["t"])
            break
    peak = win[win["t"] >= start]
    out = {"spike_start_s": start, "spike_end_s": end, "baseline_ttft_p50": base_ttft,
           "peak_ttft_p99": float(peak["ttft_p99"].max()) if len(peak) else math.nan,
           "errors_in_spike": float(during["errors"].sum()) if len(during) else 0.0,
           "recovery_s": (recovered_at - end) if recovered_at is not None else None}
    if "waiting" in win:
        out["peak_queue"] = float(peak["waiting"].max())
    if "preemptions_total" in win and win["preemptions_total"].notna().any():
        pre = win["preemptions_total"].dropna()
        out["preemptions"] = float(pre.iloc[-1] - pre.iloc[0])
    return out


def soak_drift(win: pd.DataFrame) -> dict[str, Any]:
    """Change of latency and memory from the first to the last third of a soak, and their slopes."""
    if win.empty or len(win) < 6:
        return {}
    third = len(win) // 3
    first, last = win.iloc[:third], win.iloc[-third:]
    out: dict[str, Any] = {"duration_s": float(win["t"].max())}
    for col in ("ttft_p50", "tpot_p50", "kv_usage", "gpu_mem_mib"):
        if col not in win or win[col].isna().all():
            continue
        a, b = float(first[col].median()), float(last[col].median())
        valid = win[["t", col]].dropna()
        slope = float(np.polyfit(valid["t"], valid[col], 1)[0]) if len(valid) > 2 else math.nan
        out[f"{col}_first"], out[f"{col}_last"] = a, b
        out[f"{col}_drift"] = (b - a) / a if a else math.nan
        out[f"{col}_slope_per_h"] = slope * 3600
    return out
