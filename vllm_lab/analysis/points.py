"""Per-point tables from an experiment's runs: means over repeats, the best point under the SLO,
the Pareto front, and the twin's predictions recorded with the runs."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab import stats
from vllm_lab.run_summary import RunSummary
from vllm_lab.store import DETERMINISTIC_BACKENDS
from vllm_lab.summary import metric, select

CV_WARN = 0.10  # a spread above this is too large to trust a difference of the same size
# Which statistic a point's figure is, said wherever one is shown (console, pages, files).
STATISTIC = "mean over the point's ok runs, ± half its 95% Student-t interval"
# The figure a best is named by unless the experiment ranks by another (a search's objective).
RANKED = "goodput"


def ranked_label(figure: str) -> str:
    """A ranked figure's name as a sentence says it: "goodput", "output tokens per joule"."""
    return "goodput" if figure == RANKED else metric(figure).label


def best_rule(figure: str = RANKED) -> str:
    """The one rule that names the best point of a sweep, a combination and a search, in words
    for its page, on the figure it ranks by (``best_point``)."""
    return (f"the best is the cheapest setting (the lowest values of the flags varied) among those "
            f"meeting the SLO whose {ranked_label(figure)} is within noise of the top: Welch's 95% interval on "
            f"their difference holds zero (a single live run is taken as ±3% run to run; the "
            f"predictor, which gives the same figures every run, as exact)")


BEST_RULE = best_rule()
# Backends whose repeats give the same figures: they have no run-to-run noise to allow for.
DETERMINISTIC = DETERMINISTIC_BACKENDS
# The figures a point's row averages over its ok repeats.
METRICS = select("output_throughput", "request_throughput", "goodput", "slo_attainment",
                 "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
                 "itl_p50", "itl_p90", "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99", "queue_len_mean",
                 "queue_len_max", "kv_usage_mean", "kv_usage_max", "preemptions", "gpu_util_mean",
                 "errors", "requests")
# Whose run-to-run spread (coefficient of variation) each point states: every figure a best can
# be ranked by (a search's objective) among them.
SPREAD = select("output_throughput", "goodput", "ttft_p50", "tpot_p50", "output_tokens_per_joule")
# The client beside the server: what vLLM's own /metrics said of the same runs (vllm_lab.audit),
# and how many Locust processes sent the load. Means over every run of a point, limited ones too.
AUDIT = select("loadgen_processes", "server_ttft_mean", "server_tpot_mean", "server_step_s",
               "server_step_tokens", "server_frontend_lag_mean", "audit_span_diff", "server_api_cpu",
               "ttft_p50_api_limit")
# vLLM's account of where a request's TTFT went (means over every run, as AUDIT): waiting in the engine's
# queue, and from its scheduling to its first token; the rest is the API server's
# (``api_server_hold``).
TTFT_SPLIT = select("server_queue_mean", "server_prefill_mean")
# The API server's share is named where it is this much of vLLM's TTFT and at least this long.
HOLD_SHARE, HOLD_MIN_S = 0.5, 0.1
# The GPUs' energy over each ok run's window (energy.energy_view; the twin's power model on the
# twin and the predictor): means over a point's ok repeats.
ENERGY = select("power_mean_w", "joules_per_output_token", "output_tokens_per_joule")
# A workload of several priorities (workload.priorities): TTFT of its urgent class and of the
# others, means over a point's ok repeats (none where the runs sent one priority).
PRIORITY_CLASSES = select("ttft_p50_urgent", "ttft_p99_urgent", "ttft_p50_others", "ttft_p99_others")
# The figures the twin's recorded prediction is compared on.
TWIN_METRICS = select("output_throughput", "ttft_p50", "tpot_p50")
NO_PREDICTION = "no prediction recorded"


def api_server_hold(row: pd.Series) -> float:
    """Seconds of vLLM's own mean TTFT outside its engine's queue and prefill (NaN where vLLM gave
    no account): the API server's, on a request's way in (HTTP, tokenizing, the hand-off to the
    engine core) and its first token's way out, which one busy event loop stretches."""
    parts = [row.get(k) for k in ("server_ttft_mean", "server_queue_mean", "server_prefill_mean")]
    if any(v is None or pd.isna(v) for v in parts):
        return float("nan")
    ttft, queue, prefill = (float(v) for v in parts)
    return ttft - queue - prefill


def api_server_sets_ttft(hold: float, ttft: float | None) -> bool:
    """Whether the API server's part of vLLM's mean TTFT (``api_server_hold``, seconds) is most of
    it (HOLD_SHARE) and long enough to matter (HOLD_MIN_S); False where either is missing."""
    return hold >= HOLD_MIN_S and ttft is not None and hold >= HOLD_SHARE * float(ttft)


def point_table(runs: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """One row per point: mean of each metric over ok repeats, its CV, and the failures' causes."""
    rows = []
    keyed = runs.assign(_key=runs["point"].map(lambda p: json.dumps([p.get(k) for k in params])))
    for key, group in keyed.groupby("_key", sort=False):
        values = json.loads(key)
        ok = group[group["status"] == "ok"]  # a client-limited run measured the client
        row: dict[str, Any] = dict(zip(params, values))
        row["runs"] = len(group)
        row["ok_runs"] = int((group["status"] == "ok").sum())
        row["status"] = "ok" if len(ok) == len(group) else ",".join(sorted(set(group["status"])))
        row["error"] = "; ".join(e.splitlines()[0][:160] for e in group["error"] if e)[:300]
        row["backend"] = str(group["backend"].iloc[0]) if "backend" in group else ""
        for m in METRICS:
            col = ok[m].astype(float) if m in ok else pd.Series(dtype=float)
            row[m] = col.mean() if col.notna().any() else np.nan
            if m in SPREAD:
                row.update(_spread(m, col))
        row["meets_slo"] = bool(len(ok)) and all(RunSummary.of(s).meets_slo for s in ok["summary"]) \
            if "summary" in ok else False
        for k in (*AUDIT, *TTFT_SPLIT):
            vals = [v for s in group.get("summary", []) if (v := RunSummary.of(s).figure(k)) is not None]
            row[k] = float(np.mean(vals)) if vals else np.nan
        for k in (*ENERGY, *PRIORITY_CLASSES):
            vals = [v for s in ok.get("summary", []) if (v := RunSummary.of(s).figure(k)) is not None]
            row[k] = float(np.mean(vals)) if vals else np.nan
            if k in SPREAD:
                row.update(_spread(k, pd.Series(vals, dtype=float)))
        rows.append(row)
    table = pd.DataFrame(rows)
    if params and len(table):
        try:
            table = table.sort_values(params, kind="stable").reset_index(drop=True)
        except TypeError:
            pass  # mixed types (e.g. strings and numbers): keep the plan's order
    return table


def _spread(m: str, col: pd.Series) -> dict[str, float]:
    """A figure's run-to-run spread over a point's ok runs: its coefficient of variation and half
    its 95% Student-t interval (nan with fewer than two runs)."""
    values = col.dropna()
    cv = values.std() / values.mean() if len(values) > 1 and values.mean() else np.nan
    half = stats.mean_ci(values.tolist()).half_width
    return {f"{m}_cv": cv, f"{m}_ci": half if np.isfinite(half) else np.nan}


def recorded_prediction(summary: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The twin's prediction recorded with a run (None: a run from before they were recorded)."""
    return RunSummary.of(summary).twin_prediction


def with_twin_predictions(table: pd.DataFrame, runs: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """Beside each real point, what the twin's predictor said for the same scenario when the point
    was measured (recorded in the store), and the relative error; never a new prediction."""
    predicted = []
    for _, row in table.iterrows():
        wanted = {k: row[k] for k in params}
        match = runs[runs["point"].map(lambda p, w=wanted: all(p.get(k) == v for k, v in w.items()))]
        rec = recorded_prediction(match.iloc[0]["summary"])
        figures: dict[str, Any] = {f"twin_{k}": np.nan for k in TWIN_METRICS} | {"twin_error": ""}
        if rec is None:
            figures["twin_error"] = NO_PREDICTION
        elif not rec.get("predicted", True):  # the predictor could not take the scenario: said so
            figures["twin_error"] = rec.get("error", "")
        else:
            twin = RunSummary.of(rec["summary"])
            figures.update({f"twin_{k}": _float(twin.figure(k)) for k in TWIN_METRICS})
            figures["twin_error"] = limit_note(twin.figure("server_api_cpu"), twin.ttft_p50,
                                               twin.figure("ttft_p50_api_limit"))
        predicted.append(figures)
    out = pd.concat([table.reset_index(drop=True), pd.DataFrame(predicted)], axis=1)
    for k in TWIN_METRICS:
        out[f"twin_{k}_error"] = (out[f"twin_{k}"] - out[k]) / out[k]
    return out


def limit_note(api_cpu: float | None, ttft: float | None = None,
               ttft_at_limit: float | None = None) -> str:
    """What a prediction whose API server is busy ``api_cpu`` cores a process (the twin's own
    figure) says of itself: past ``twin.frontend.LIMIT_CPU`` its TTFT is least sure, and where
    it was also predicted at the API server's limit, the two TTFT p50s (seconds) bound it."""
    from vllm_lab.twin.frontend import LIMIT_CPU

    if api_cpu is None or not api_cpu >= LIMIT_CPU:
        return ""
    return (f"the twin's API server at {api_cpu:.2f} of a core, near its limit: its TTFT is least "
            f"sure here" + (f"; {ttft_band(ttft, ttft_at_limit)}" if ttft_at_limit else ""))


def ttft_band(ttft: float | None, ttft_at_limit: float) -> str:
    """The TTFT p50 a run near the API server's limit may settle at, in words (seconds in)."""
    low = f"{ttft * 1e3:,.0f} ms at the engine's limit, " if ttft is not None else ""
    return f"TTFT p50 {low}up to {ttft_at_limit * 1e3:,.0f} ms at the API server's"


def _float(v: Any) -> float:
    return np.nan if v is None else float(v)


def best_point(table: pd.DataFrame, figure: str = RANKED) -> pd.Series | None:
    """The cheapest point within noise of the top one among those meeting the SLO, on ``figure``
    (goodput; a search ranks by its objective's, e.g. output tokens per joule).

    The top point has the highest ``figure`` (throughput breaks ties); a point is within noise of
    it when the interval on their difference includes none (``stats.summary_effect``: its
    repeats' spread, or ``stats.SINGLE_RUN_CV`` for a single run). Among those, the cheapest is
    the one with the lowest values of the varied flags (fewer sequences, less memory, ...): a
    larger setting that reads a little higher once has not shown it buys anything. Equal costs
    go to the higher-ranked point.
    """
    ranked, close = _close_to_top(table, figure)
    if not close:
        return None
    cost = _cost(table)
    return ranked.loc[min(close, key=lambda i: (cost[i], ranked.index.get_loc(i)))]


def within_noise(table: pd.DataFrame, best: pd.Series | None, figure: str = RANKED) -> list[int]:
    """The points meeting the SLO that cannot be told apart from the top one (best among them)."""
    return _close_to_top(table, figure)[1] if best is not None else []


def _close_to_top(table: pd.DataFrame, figure: str) -> tuple[pd.DataFrame, list[int]]:
    """The points meeting the SLO with a value of ``figure``, ranked by it (then throughput), and
    the indices of those within noise of the first."""
    ranked = table[table["meets_slo"] & table[figure].notna()] if figure in table else table[:0]
    ranked = ranked.sort_values(list(dict.fromkeys([figure, "output_throughput"])), ascending=False)
    if ranked.empty:
        return ranked, []
    top = ranked.iloc[0]
    return ranked, [i for i, row in ranked.iterrows()
                    if i == top.name or not stats.summary_effect(
                        figure_runs(row, figure), figure_runs(top, figure),
                        single_run_cv=max(single_run_cv(row), single_run_cv(top))).significant]


def figure_runs(row: pd.Series, m: str = "goodput") -> tuple[float, float, int]:
    """A point's figure as (mean, standard deviation, ok runs) from its table row; a
    deterministic backend's single run has no spread (0), a live one's is unknown (nan)."""
    mean, cv = float(row[m]), row.get(f"{m}_cv", np.nan)
    n = int(row.get("ok_runs", 1) or 1)
    if cv is not None and np.isfinite(cv):
        return mean, float(cv) * abs(mean), n
    return mean, (0.0 if row.get("backend") in DETERMINISTIC else np.nan), n


def single_run_cv(row: pd.Series) -> float:
    """The run-to-run spread a single run is given: none on a deterministic backend."""
    return 0.0 if row.get("backend") in DETERMINISTIC else stats.SINGLE_RUN_CV


# The figures each point's effect against the reference (vLLM's defaults) is given for.
EFFECTS = SPREAD


def reference_row(table: pd.DataFrame, reference: Mapping[str, Any] | None) -> pd.Series | None:
    """The row of the reference point (vLLM's defaults, as the experiment recorded them)."""
    if not reference or table.empty or any(p not in table for p in reference):
        return None
    match = table[np.logical_and.reduce([table[p].map(lambda v, w=v: same_value(v, w))
                                         for p, v in reference.items()])]
    return match.iloc[0] if len(match) and match.iloc[0]["ok_runs"] else None


def same_value(a: Any, b: Any) -> bool:
    """One flag value however a point and a plan spell it: 1024 and 1024.0 are the same."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def with_effects(table: pd.DataFrame, reference: Mapping[str, Any] | None) -> pd.DataFrame:
    """Each point's effect against the reference point for every figure of ``EFFECTS``: the
    relative difference of means and its 95% interval (``stats.summary_effect``), as
    ``<figure>_effect``, ``_effect_low``, ``_effect_high``; unchanged without a reference."""
    ref = reference_row(table, reference)
    if ref is None:
        return table
    out = table.copy()
    for m in EFFECTS:
        effects = []
        for _, row in table.iterrows():
            if not row["ok_runs"] or not np.isfinite(row[m]):
                effects.append(stats.Effect(np.nan, np.nan, np.nan))
                continue
            a, b = figure_runs(row, m), figure_runs(ref, m)
            cv = max(single_run_cv(row), single_run_cv(ref))
            effects.append(stats.summary_effect(a, b, single_run_cv=cv))
        out[f"{m}_effect"] = [e.relative for e in effects]
        out[f"{m}_effect_low"] = [e.low for e in effects]
        out[f"{m}_effect_high"] = [e.high for e in effects]
    out["reference"] = [row.name == ref.name for _, row in table.iterrows()]
    return out


def _cost(table: pd.DataFrame) -> dict[int, float]:
    """Each point's cost: the sum over the varied flags of its value's rank (numbers ascending,
    anything else in the plan's order)."""
    params = list(table.columns[:table.columns.get_loc("runs")]) if "runs" in table else []
    cost = {i: 0.0 for i in table.index}
    for p in params:
        values = list(dict.fromkeys(table[p]))
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        order = sorted(values) if numeric else values
        for i, v in table[p].items():
            cost[i] += order.index(v)
    return cost


def pareto_front(points: pd.DataFrame, latency: str, throughput: str = "output_throughput") -> pd.DataFrame:
    """The points no other point beats on both higher ``throughput`` and lower ``latency``,
    in order of latency."""
    p = points.dropna(subset=[latency, throughput]).sort_values(
        [latency, throughput], ascending=[True, False])
    front, best = [], -math.inf
    for idx, row in p.iterrows():
        if row[throughput] > best:
            front.append(idx)
            best = row[throughput]
    return p.loc[front]
