"""Step 4, stress: how a configuration holds up under more load than it was tuned for.

Shapes and how they are measured:

- ``ramp`` and ``step``: a staircase of runs, one constant open-loop run per offered load (req/s).
  Why runs and not one long Locust ramp: each level then starts from an empty queue, so a queue
  (and TTFT) that grows *within* a run is the level's own doing, not the backlog of the levels
  before it, which would put the knee too low; the levels are also resumable, spreadable over
  hosts and run on the predictor in seconds. ``ramp`` refines the bracket around the knee with
  extra levels; ``step`` keeps the given levels.
- ``spike`` and ``soak``: one run with Locust's spike or constant shape, read as a time series
  (each request's start time and latencies, the server's /metrics): queue, preemptions, errors and
  recovery time after the spike; drift of latency and memory over the soak.

Only an open loop has an offered load: a closed loop's users wait for their answers, so its queue
can never grow without bound. Stress runs are therefore open-loop (Poisson unless the scenario says
gamma).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab import plans
from vllm_lab.scenarios import Scenario, ScenarioError
from vllm_lab.store import Store

SHAPES = ("ramp", "step", "spike", "soak")
# Time in the system (E2E) rising by more than this many seconds per second of the run means the
# requests in the server outgrow it: for arrivals at rate L and a capacity C, N(t) grows at L - C
# and by Little's law a request arriving at t stays about N(t)/C, so E2E climbs at L/C - 1 s/s.
# E2E rather than TTFT: with a large max-num-seqs the backlog sits in the running batch (TPOT
# grows), not in the waiting queue (TTFT).
GROWTH_SLOPE = 0.03
LEVEL_COLUMNS = ("request_throughput", "output_throughput", "goodput", "errors", "ttft_p50",
                 "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p90", "e2e_p99", "tpot_p99", "queue_len_max",
                 "preemptions")
FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.35, 1.7)  # of the predicted capacity
# A level just under the capacity fills its queue for longer than a short run lasts (the time to
# steady state grows as 1 / (1 - load)^2), and the fill looks like growth. So the first level
# called unbounded with a trend under CONFIRM_BELOW x GROWTH_SLOPE runs again CONFIRM_FACTOR times
# as long; at a level measured more than once the longest run decides.
CONFIRM_BELOW = 2.0
CONFIRM_FACTOR = 3.0


def stress_scenario(scenario: Scenario, shape: str) -> Scenario:
    """The scenario as a stress run: open loop, and the shape (constant for staircase levels)."""
    if shape not in SHAPES:
        raise ScenarioError(f"SHAPE={shape!r}: allowed values are {', '.join(SHAPES)}")
    kind = "constant" if shape in ("ramp", "step") else shape
    s = plans.apply_value(scenario, "load.mode", "open")
    return plans.apply_value(s, "load.shape.kind", kind)


def predicted_capacity(scenario: Scenario, backend: Any = None, workdir: Any = None) -> float:
    """Requests/s a backend (the predictor by default) serves with a queue that never empties
    (closed loop, many users)."""
    from vllm_lab.backends import PredictBackend

    seqs = int(scenario.serve.get("max-num-seqs") or 256)
    users = min(2 * seqs, 2048)
    if backend is None:
        # The predictor sends 8 requests a user: with 2 x 8 users the middle half is 64 completions,
        # whose mean length (hence req/s) is off by up to 10% for a long-tailed workload. Users
        # past max-num-seqs only wait, so more of them change nothing but the sample: >= 2048.
        users = max(users, 256)
    s = plans.apply_value(plans.apply_value(scenario, "load.mode", "closed"), "load.shape.level", users)
    s = plans.apply_value(s, "load.shape.kind", "constant")
    m = (backend or PredictBackend()).measure(s, None, workdir)
    if m.status != "ok":
        raise ScenarioError(f"the configuration does not start on the predictor ({m.error.splitlines()[0]}); "
                            f"stress a configuration that starts, or give LEVELS=a,b,c")
    # In a closed loop with more users than slots every freed slot is refilled at once: the
    # completions per second in the middle half of the run (no start-up, no drain) are the capacity.
    ends = (m.samples["start_ts"] + m.samples["e2e_s"]).dropna().sort_values().to_numpy()
    lo, hi = ends[len(ends) // 4], ends[3 * len(ends) // 4]
    return float((3 * len(ends) // 4 - len(ends) // 4) / (hi - lo)) if hi > lo else \
        float(m.summary["request_throughput"])


def staircase_levels(scenario: Scenario, levels: list[float] | None) -> list[float]:
    """LEVELS if given; else fractions of the predicted capacity (the predictor pre-screens)."""
    if levels:
        return sorted(float(v) for v in levels)
    try:
        capacity = predicted_capacity(scenario)
    except (ValueError, KeyError):
        capacity = scenario.load.shape.level  # no length distribution: centre on the scenario
    return [round(capacity * f, 3) for f in FRACTIONS]


def staircase_points(scenario: Scenario, levels: list[float], repeats: int = 1) -> list[plans.Point]:
    """One constant open-loop run per offered load: the serve flags are the same, one server.

    The client's in-flight cap is raised to the run's whole schedule (at most 4096): with a lower
    cap an overloaded level would queue in the client, where the server's queue and TTFT never
    see it.
    """
    points = []
    for p in plans.sweep_points(scenario, "load.shape.level", levels, repeats):
        load = p.scenario.load
        cap = max(load.max_in_flight, min(int(load.shape.level * load.stop.duration_s) + 1, 4096))
        points.append(plans.Point(plans.apply_value(p.scenario, "load.max_in_flight", cap),
                                  p.values, p.repeat))
    return points


def single_points(scenario: Scenario) -> list[plans.Point]:
    """Spike or soak: one run of the scenario's shape."""
    return [plans.Point(scenario, {"load.shape.kind": scenario.load.shape.kind}, 0)]


# -- reading one run as a time series -----------------------------------------------------------

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


def level_verdict(level: float, summary: dict[str, Any], samples: pd.DataFrame,
                  metrics: pd.DataFrame | None) -> dict[str, Any]:
    """One staircase level: bounded or not, the SLO verdict, and the capacity it implies."""
    slope = latency_growth(samples)
    last_send = float(samples["start_ts"].max()) if samples is not None and len(samples) else None
    qslope = queue_growth(metrics, until=last_send)
    offered = offered_rate(samples, level)
    # The queue series, where there is one, confirms: a TTFT trend alone can be noise.
    unbounded = slope > GROWTH_SLOPE and (qslope is None or qslope > 0)
    capacity = offered / (1 + slope)
    # The server's own waiting queue growing by more than GROWTH_SLOPE of what it serves is
    # overload by itself (the same L/C - 1 bound): in a short live run the E2E trend drowns in
    # the arrivals' own bursts, the queue does not. Requests then leave the queue at the rate
    # the full batch frees slots: the capacity is the offered rate less the queue's growth.
    if qslope is not None and qslope > GROWTH_SLOPE * max(offered - qslope, 0.0):
        unbounded, capacity = True, offered - qslope
    return {"level": level, "offered": offered, "latency_growth": slope, "queue_growth": qslope,
            "unbounded": unbounded, "meets_slo": bool(summary.get("meets_slo")),
            "capacity_estimate": capacity if unbounded else math.nan}


def find_knee(levels: pd.DataFrame) -> dict[str, Any]:
    """The knee, the highest load that holds, and the highest that holds under the SLO.

    ``levels`` has one row per offered load (level, unbounded, meets_slo, capacity_estimate, ok;
    ``offered``, the rate a run really sent, where known). The loads returned are on the offered
    axis; ``bracket`` (the last bounded and the first unbounded level) is in levels, for the
    ramp's next round. The unbounded-growth knee is the capacity the lowest overloaded level
    implies (offered / (1 + E2E slope)), kept inside the bracket.
    """
    t = levels[levels["ok"]].sort_values("level")
    out: dict[str, Any] = {"knee": None, "knee_unbounded": None, "knee_slo": None,
                           "max_sustainable": None, "bracket": None}
    if t.empty:
        return out
    x = t["offered"].fillna(t["level"]) if "offered" in t else t["level"]
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
    holds = t[t["meets_slo"] & ~t["unbounded"]]
    if len(holds):
        # The highest level below which every level holds: a level that holds past a broken
        # one is luck, not capacity.
        fails = t[~(t["meets_slo"] & ~t["unbounded"])]
        limit = float(fails["level"].iloc[0]) if len(fails) else math.inf
        ok_below = holds[holds["level"] < limit]
        out["max_sustainable"] = float(x[ok_below.index[-1]]) if len(ok_below) else None
    return out


def confirm_level(levels: pd.DataFrame) -> float | None:
    """The first unbounded level, where its verdict is marginal and no longer run has checked it."""
    t = levels[levels["ok"]].sort_values("level")
    bad = t[t["unbounded"]]
    if bad.empty:
        return None
    first = bad.iloc[0]
    marginal = first["latency_growth"] < CONFIRM_BELOW * GROWTH_SLOPE
    return float(first["level"]) if marginal and not first.get("confirmed", False) else None


def confirm_points(scenario: Scenario, levels: list[float]) -> list[plans.Point]:
    """The confirmation runs of ``levels``: each level again, CONFIRM_FACTOR times as long."""
    longer = plans.apply_value(scenario, "load.stop.duration_s",
                               scenario.load.stop.duration_s * CONFIRM_FACTOR)
    return staircase_points(longer, levels)


def next_levels(levels: pd.DataFrame) -> tuple[list[float], list[float]]:
    """A ramp's next round: (levels to add, levels to confirm); a marginal verdict is checked first."""
    confirm = confirm_level(levels)
    return ([], [confirm]) if confirm is not None else (refine_levels(levels), [])


def run_staircase(scenario: Scenario, levels: list[float], rounds: int,
                  take: Callable[[list[plans.Point]], int], read_levels: Callable[[], pd.DataFrame],
                  repeats: int = 1, say: Callable[[str], Any] = print) -> int:
    """The staircase, then up to ``rounds`` rounds that confirm a marginal overload or refine the
    knee's bracket. ``take(points)`` runs the points not yet recorded and returns 0 when it could;
    ``read_levels()`` is the levels table of what is recorded. Returns the last ``take``'s code."""
    confirmed: list[float] = []
    rc = take(staircase_points(scenario, levels, repeats))
    for _ in range(rounds if rc == 0 else 0):
        extra, confirm = next_levels(read_levels())
        if not extra and not confirm:
            break
        levels, confirmed = sorted(set(levels) | set(extra)), confirmed + confirm
        say(f"ramp: refining the knee with levels {extra}" if extra else
            f"ramp: level {confirm[0]} looks overloaded by a small margin; running it "
            f"{CONFIRM_FACTOR:g}x as long")
        rc = take(staircase_points(scenario, levels, repeats) + confirm_points(scenario, confirmed))
    return rc


def refine_levels(levels: pd.DataFrame, tolerance: float = 0.05, count: int = 3) -> list[float]:
    """New levels inside the knee's bracket while it is wider than ``tolerance`` (a ramp's zoom)."""
    knee = find_knee(levels)
    if knee["bracket"] is None:
        top = levels[levels["ok"]]["level"].max() if levels["ok"].any() else None
        return [round(top * 1.5, 3), round(top * 2, 3)] if top else []  # never overloaded: go higher
    low, high = knee["bracket"]
    if low <= 0 or high / low - 1 <= tolerance:
        return []
    return [round(low + (high - low) * (i + 1) / (count + 1), 3) for i in range(count)]


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
            verdict = level_verdict(level, {"meets_slo": run["summary"].get("meets_slo")},
                                           store.samples(exp_id, run["run_key"]),
                                           store.server_metrics(exp_id, run["run_key"]))
            row.update(verdict)
        else:
            row.update(unbounded=False, meets_slo=False, latency_growth=math.nan,
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


# -- spike and soak ------------------------------------------------------------------------------

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
