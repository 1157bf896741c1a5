"""The quarterly report's analyses: each a table computed from the period's runs alone.

The baseline now against the previous period, the best configuration per scenario and GPU and its
margin, the sweeps, combinations and stress tests, the regression watch and the troubleshooting
findings. ``reports.quarterly`` draws them and writes the recommended flag changes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from vllm_lab.analysis import findings as findings_mod
from vllm_lab.run_summary import RunSummary

TUNING_STEPS = ("sweep", "combo", "tune")
SIGNIFICANCE = 0.05


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that measured what they meant to (status ok)."""
    return runs[runs["status"] == "ok"]


def baseline_comparison(now: pd.DataFrame, before: pd.DataFrame) -> pd.DataFrame:
    """Per scenario and GPU: the baseline's figures now and in the previous period, and a t-test."""
    rows = []
    now_b, before_b = ok_runs(now[now["step"] == "baseline"]), ok_runs(before[before["step"] == "baseline"])
    for label, group in now_b.groupby("label"):
        prev = before_b[before_b["label"] == label]
        row: dict[str, Any] = {"label": label, "runs_now": len(group), "runs_before": len(prev)}
        for m in ("output_throughput", "goodput", "ttft_p99", "tpot_p99"):
            row[f"{m}_now"] = group[m].mean()
            row[f"{m}_now_std"] = group[m].std()
            row[f"{m}_before"] = prev[m].mean() if len(prev) else np.nan
            row[f"{m}_before_std"] = prev[m].std() if len(prev) > 1 else np.nan
        change = row["output_throughput_now"] / row["output_throughput_before"] - 1 \
            if len(prev) else np.nan
        row["throughput_change"] = change
        if len(prev) > 1 and len(group) > 1:
            p = stats.ttest_ind(group["output_throughput"], prev["output_throughput"],
                                equal_var=False).pvalue
        else:
            p = np.nan
        row["p_value"] = p
        row["verdict"] = ("no previous baseline" if not len(prev) else
                          "too few runs to test" if np.isnan(p) else
                          ("faster" if change > 0 else "slower") if p < SIGNIFICANCE else
                          "no significant change")
        rows.append(row)
    return pd.DataFrame(rows)


def point_means(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (experiment, point): means over its ok repeats and whether all met the SLO."""
    ok = ok_runs(runs).assign(meets=lambda d: d["summary_json"].map(
        lambda text: bool(RunSummary.of(text).meets_slo)))
    agg = ok.groupby(["experiment_id", "point_json"], sort=False).agg(
        label=("label", "first"), scenario_name=("scenario_name", "first"),
        gpu_model=("gpu_model", "first"), step=("step", "first"), params=("params", "first"),
        serve=("scenario", lambda s: s.iloc[0]["serve"]), runs=("run_key", "size"),
        goodput=("goodput", "mean"), goodput_std=("goodput", "std"),
        output_throughput=("output_throughput", "mean"), ttft_p99=("ttft_p99", "mean"),
        tpot_p99=("tpot_p99", "mean"), meets_slo=("meets", "all"), started=("started", "max"))
    agg = agg.reset_index()
    agg["point"] = agg["point_json"].map(json.loads)
    return agg


def best_configurations(runs: pd.DataFrame, points: pd.DataFrame) -> pd.DataFrame:
    """Per scenario and GPU: the tuned point with the highest goodput under the SLO, and margins."""
    base = ok_runs(runs[runs["step"] == "baseline"]).groupby("label").agg(
        base_goodput=("goodput", "mean"), base_throughput=("output_throughput", "mean"),
        base_serve=("scenario", lambda s: s.iloc[-1]["serve"]))
    tuned = points[points["step"].isin(TUNING_STEPS) & points["meets_slo"]]
    rows = []
    for label, group in tuned.groupby("label"):
        ranked = group.sort_values(["goodput", "output_throughput"], ascending=False)
        best = ranked.iloc[0]
        runner = ranked.iloc[1] if len(ranked) > 1 else None
        spread = np.nanmax([best["goodput_std"], runner["goodput_std"] if runner is not None
                            else np.nan, 1e-9])
        b = base.loc[label] if label in base.index else None
        rows.append({
            "label": label, "scenario_name": best["scenario_name"], "gpu_model": best["gpu_model"],
            "experiment_id": best["experiment_id"], "point": best["point"], "serve": best["serve"],
            "goodput": best["goodput"], "output_throughput": best["output_throughput"],
            "ttft_p99": best["ttft_p99"], "tpot_p99": best["tpot_p99"], "runs": best["runs"],
            "base_goodput": b["base_goodput"] if b is not None else np.nan,
            "base_throughput": b["base_throughput"] if b is not None else np.nan,
            "base_serve": b["base_serve"] if b is not None else {},
            "margin_vs_baseline": (best["goodput"] / b["base_goodput"] - 1)
            if b is not None and b["base_goodput"] else np.nan,
            "runner_up": runner["point"] if runner is not None else None,
            # How clearly it wins: the gap to the runner-up in run-to-run standard deviations.
            "margin_vs_runner_up_sd": (best["goodput"] - runner["goodput"]) / spread
            if runner is not None else np.nan,
            "candidates": len(group)})
    return pd.DataFrame(rows)


def sweep_summary(points: pd.DataFrame) -> pd.DataFrame:
    """Per sweep experiment: the parameter, values tried, the best value under the SLO, its gain."""
    rows = []
    sweeps = points[points["step"] == "sweep"]
    for exp_id, group in sweeps.groupby("experiment_id", sort=False):
        param = (group["params"].iloc[0] or [None])[0]
        if param is None:
            continue
        values = group["point"].map(lambda p, param=param: p.get(param))
        under = group[group["meets_slo"]]
        best = under.sort_values("goodput", ascending=False).iloc[0] if len(under) else None
        rows.append({"experiment_id": exp_id, "label": group["label"].iloc[0], "param": param,
                     "values": len(values.unique()), "best_value": best["point"].get(param)
                     if best is not None else None,
                     "best_goodput": best["goodput"] if best is not None else np.nan,
                     "gain_vs_worst": best["goodput"] / group["goodput"].min() - 1
                     if best is not None and group["goodput"].min() > 0 else np.nan,
                     "under_slo": len(under)})
    return pd.DataFrame(rows)


def sweep_rollup(sweeps: pd.DataFrame) -> pd.DataFrame:
    """Sweeps grouped per scenario, GPU and flag: how often each value won, the median gain."""
    rows = []
    if sweeps.empty:
        return pd.DataFrame(rows)
    for (label, param), group in sweeps.groupby(["label", "param"]):
        wins = group["best_value"].dropna().map(str).value_counts()
        rows.append({"label": label, "param": param, "sweeps": len(group),
                     "best_values": ", ".join(f"{v} ({n})" for v, n in wins.items()) or "none met the SLO",
                     "gain_median": group["gain_vs_worst"].median(),
                     "latest": group["experiment_id"].iloc[-1]})
    return pd.DataFrame(rows)


def stress_summary(points: pd.DataFrame) -> pd.DataFrame:
    """Per stress experiment: the highest load meeting the SLO (the knee) and the peak throughput."""
    rows = []
    for exp_id, group in points[points["step"] == "stress"].groupby("experiment_id", sort=False):
        level = group["point"].map(lambda p: p.get("load.shape.level", np.nan)).astype(float)
        under = level[group["meets_slo"].to_numpy()]
        rows.append({"experiment_id": exp_id, "label": group["label"].iloc[0],
                     "levels": len(level), "knee_level": under.max() if len(under) else np.nan,
                     "peak_throughput": group["output_throughput"].max(),
                     "ttft_p99_at_peak_s": group.loc[group["output_throughput"].idxmax(), "ttft_p99"]})
    return pd.DataFrame(rows)


def watch_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per watched deployment (host): probes, throughput first/last/median, regressions flagged."""
    watch = runs[runs["step"].isin(["watch", "monitor"])]
    rows = []
    for host, group in watch.groupby("host"):
        ok = ok_runs(group)
        flagged = group["summary_json"].map(lambda s: bool(json.loads(s).get("regression", False)))
        rows.append({"host": host, "label": group["label"].iloc[-1], "probes": len(group),
                     "failed": int((group["status"] != "ok").sum()),
                     "throughput_median": ok["output_throughput"].median(),
                     "throughput_first": ok["output_throughput"].iloc[0] if len(ok) else np.nan,
                     "throughput_last": ok["output_throughput"].iloc[-1] if len(ok) else np.nan,
                     "ttft_p99_median": ok["ttft_p99"].median(),
                     "gpu_util_mean": ok["gpu_util_mean"].mean(),
                     "kv_usage_max": ok["kv_usage_max"].max(),
                     "regressions": int(flagged.sum())})
    return pd.DataFrame(rows)


def all_findings(runs: pd.DataFrame) -> list[findings_mod.Finding]:
    """Every run's troubleshooting findings."""
    out: list[findings_mod.Finding] = []
    for row in runs.to_dict("records"):
        out.extend(findings_mod.findings(row))
    return out


def findings_table(found: list[findings_mod.Finding], runs: pd.DataFrame) -> pd.DataFrame:
    """Findings grouped by kind, scenario and GPU: how often, one example's numbers, the flags."""
    if not found:
        return pd.DataFrame(columns=["kind", "label", "runs", "title", "evidence", "flags"])
    gpu = dict(zip(runs["run_key"], runs["gpu_model"]))
    df = pd.DataFrame([{**f.__dict__, "label": f"{f.scenario_name} · {gpu.get(f.run_key, '')}"}
                       for f in found])
    rows = []
    for (kind, label), group in df.groupby(["kind", "label"]):
        first = group.iloc[-1]  # the latest run's numbers
        rows.append({"kind": kind, "label": label, "runs": len(group), "title": first["title"],
                     "evidence": first["evidence"], "example": f"{first['experiment_id']}",
                     "flags": " ".join(f"--{k} {v}" for k, v in first["flags"].items())})
    return pd.DataFrame(rows).sort_values("runs", ascending=False).reset_index(drop=True)
