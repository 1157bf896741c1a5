"""The quarterly report's analyses: each a table computed from the period's runs alone.

The baseline now against the previous period, the best configuration per scenario and GPU and its
margin, the sweeps, combinations and stress tests, each autotune's pick, the regression watch and the
troubleshooting findings. ``reports.quarterly`` draws them and writes the recommended flag changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab import search, stats
from vllm_lab.analysis import findings as findings_mod
from vllm_lab.analysis import host_time
from vllm_lab.analysis.autotune import STEP as AUTOTUNE
from vllm_lab.analysis.autotune import load_record, outcome
from vllm_lab.analysis.points import (
    RANKED,
    best_point,
    figure_runs,
    point_table,
    single_run_cv,
    with_effects,
)
from vllm_lab.analysis.stress import find_knee, levels_table
from vllm_lab.run_summary import RunSummary
from vllm_lab.store import Store

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
            from scipy import stats as _scipy  # here: ~0.9 s to import, for the quarterly alone
            p = _scipy.ttest_ind(group["output_throughput"], prev["output_throughput"],
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


def experiment_points(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per tuning experiment (sweep, combination, search): its table of points, as its own page
    computes it (``analysis.points.point_table``: means over ok runs, their spread)."""
    out = {}
    tuned = runs[runs["step"].isin(TUNING_STEPS)]
    for exp_id, group in tuned.groupby("experiment_id", sort=False):
        params = group["params"].iloc[0]
        if not params:
            continue
        decoded = group.assign(point=group["point_json"].map(json.loads),
                               summary=group["summary_json"].map(json.loads))
        out[exp_id] = point_table(decoded, params).assign(
            experiment_id=exp_id, label=group["label"].iloc[0],
            scenario_name=group["scenario_name"].iloc[0], gpu_model=group["gpu_model"].iloc[0],
            ranked_by=group["ranked_by"].iloc[0] if "ranked_by" in group else RANKED)
    return out


def _effect(a: pd.Series | dict, b: pd.Series | dict) -> stats.Effect:
    """Goodput of ``a`` against ``b`` with its 95% interval (``analysis.points``' rule)."""
    cv = max(single_run_cv(a), single_run_cv(b))
    return stats.summary_effect(figure_runs(a), figure_runs(b), single_run_cv=cv)


def best_configurations(runs: pd.DataFrame, points: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per scenario and GPU: the best configuration of the period's tuning experiments, each
    experiment's best named by the rule its own page states (``analysis.points.best_point``),
    the highest goodput of those winning; its effect against the baseline and the runner-up,
    each with its 95% interval, so a spread of the repeats is never read as a gain."""
    base_runs = ok_runs(runs[runs["step"] == "baseline"])
    bests = []
    for exp_id, table in experiment_points(runs).items():
        best = best_point(table, table["ranked_by"].iloc[0])
        if best is not None:
            serve = runs[runs["experiment_id"] == exp_id]["scenario"].iloc[0]["serve"]
            params = [c for c in table.columns[:table.columns.get_loc("runs")]]
            bests.append({**best.to_dict(), "point": {p: best[p] for p in params},
                          "serve": {**serve, **{p: best[p] for p in params if "." not in p}}})
    rows = []
    for label, group in pd.DataFrame(bests).groupby("label") if bests else []:
        ranked = group.sort_values(["goodput", "output_throughput"], ascending=False)
        best = ranked.iloc[0]
        runner = ranked.iloc[1] if len(ranked) > 1 else None
        base = base_runs[base_runs["label"] == label]
        ref = _baseline_row(base)
        vs_base = _effect(best, ref) if ref is not None else None
        vs_runner = _effect(best, runner) if runner is not None else None
        rows.append({
            "label": label, "scenario_name": best["scenario_name"], "gpu_model": best["gpu_model"],
            "experiment_id": best["experiment_id"], "point": best["point"], "serve": best["serve"],
            "goodput": best["goodput"], "output_throughput": best["output_throughput"],
            "ttft_p99": best["ttft_p99"], "tpot_p99": best["tpot_p99"], "runs": best["ok_runs"],
            "base_goodput": ref["goodput"] if ref is not None else np.nan,
            "base_throughput": ref["output_throughput"] if ref is not None else np.nan,
            "base_serve": base["scenario"].iloc[-1]["serve"] if len(base) else {},
            "margin_vs_baseline": vs_base.relative if vs_base else np.nan,
            "margin_low": vs_base.low if vs_base else np.nan,
            "margin_high": vs_base.high if vs_base else np.nan,
            "gain_is_real": bool(vs_base and vs_base.low > 0),
            "runner_up": runner["point"] if runner is not None else None,
            "vs_runner_up": vs_runner.relative if vs_runner else np.nan,
            "vs_runner_up_low": vs_runner.low if vs_runner else np.nan,
            "vs_runner_up_high": vs_runner.high if vs_runner else np.nan,
            "candidates": len(group)})
    return pd.DataFrame(rows)


def _baseline_row(base: pd.DataFrame) -> dict | None:
    """A label's baseline runs as a point: means, spread and runs (as ``figure_runs`` reads one)."""
    if base.empty:
        return None
    g = base["goodput"].astype(float)
    return {"goodput": g.mean(), "goodput_cv": g.std() / g.mean() if len(g) > 1 and g.mean() else np.nan,
            "ok_runs": len(g), "output_throughput": base["output_throughput"].mean(),
            "backend": base["backend"].iloc[0]}


def sweep_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per sweep experiment: the parameter, values tried, its best by the rule its report states
    and that best's goodput against vLLM's defaults (the sweep's reference) with its interval."""
    rows = []
    tables = experiment_points(runs)
    for exp_id, group in runs[runs["step"] == "sweep"].groupby("experiment_id", sort=False):
        param = (group["params"].iloc[0] or [None])[0]
        if param is None or exp_id not in tables:
            continue
        table = with_effects(tables[exp_id], group["reference"].iloc[0])
        best = best_point(table)
        gain = best.get("goodput_effect", np.nan) if best is not None else np.nan
        rows.append({"experiment_id": exp_id, "label": group["label"].iloc[0], "param": param,
                     "values": len(table), "best_value": best[param] if best is not None else None,
                     "best_goodput": best["goodput"] if best is not None else np.nan,
                     "gain_vs_defaults": gain,
                     "gain_is_real": bool(best is not None and best.get("goodput_effect_low", 0) > 0),
                     "under_slo": int(table["meets_slo"].sum())})
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
                     "gain_median": group["gain_vs_defaults"].median(),
                     "real_gains": int(group["gain_is_real"].sum()),
                     "latest": group["experiment_id"].iloc[-1]})
    return pd.DataFrame(rows)


def stress_summary(store_path: Path, runs: pd.DataFrame) -> pd.DataFrame:
    """Per stress experiment (an autotune candidate's staircase too): the knee and the maximum
    sustainable load, by the function its own report reads them with (``analysis.stress``)."""
    rows = []
    stress_runs = runs[runs["step"] == "stress"]
    with Store(store_path) as store:
        for exp_id, group in stress_runs.groupby("experiment_id", sort=False):
            exp_runs = store.runs(exp_id)
            if not all(isinstance(p, dict) and "load.shape.level" in p for p in exp_runs["point"]):
                continue  # a spike or a soak: one run read as a time series, no knee
            levels = levels_table(store, exp_id, exp_runs)
            knee = find_knee(levels)
            ok = levels[levels["ok"]]
            peak = ok.loc[ok["output_throughput"].idxmax()] if len(ok) else None
            rows.append({"experiment_id": exp_id, "label": group["label"].iloc[0],
                         "levels": len(levels), "knee": knee["knee"],
                         "max_sustainable": knee["max_sustainable"],
                         "peak_throughput": peak["output_throughput"] if peak is not None else np.nan,
                         "ttft_p99_at_peak_s": peak["ttft_p99"] if peak is not None else np.nan})
    return pd.DataFrame(rows)


def autotune_summary(store_path: Path, runs: pd.DataFrame) -> pd.DataFrame:
    """Per autotune whose staircases ran in the period: its pick, by the function its own report
    reads it with (``analysis.autotune.outcome``): the best candidate and its flags, its SLO
    capacity against vLLM's defaults', the gain, the rule and the verdict, as its page says them."""
    storage = search.storage_url(None, store_path)
    staircases = runs[runs["step"] == "stress"]
    with Store(store_path) as store:
        exps = store.experiments()
    steps = dict(zip(exps["id"], exps["step"], strict=True))
    records: dict[str, Any] = {}

    def record(name: str):
        # An autotune of a store written before its experiment was recorded is known by its study.
        if name not in records:
            known = steps.get(name)
            records[name] = (load_record(store_path, name, storage)
                             if known == AUTOTUNE or known is None else None)
        return records[name]

    found: dict[str, str] = {}  # autotune -> the label of its staircases' runs
    for staircase, group in staircases.groupby("experiment_id", sort=False):
        parts = str(staircase).split("-")
        for i in range(len(parts) - 1, 0, -1):
            name = "-".join(parts[:i])
            rec = record(name)
            if rec is not None and any(staircase == f"{name}-{c.name}" for c in rec.plan.candidates):
                found.setdefault(name, group["label"].iloc[0])
                break
    rows = []
    for name, label in found.items():
        out = outcome(store_path, name, storage)
        best = out.best
        rows.append({"experiment_id": name, "label": label, "objective": out.objective,
                     "backend": out.record.plan.backend,
                     "best": best.candidate.name if best else None,
                     "best_flags": dict(best.candidate.flags or {}) if best else None,
                     "best_capacity": best.measured if best else np.nan,
                     "defaults_capacity": out.defaults.measured if out.defaults.measured is not None
                     else np.nan,
                     "gain": out.gain if out.gain is not None else np.nan,
                     "rule": out.rule, "verdict": out.verdict()})
    return pd.DataFrame(rows, columns=["experiment_id", "label", "objective", "backend", "best",
                                       "best_flags", "best_capacity", "defaults_capacity", "gain",
                                       "rule", "verdict"])


def host_time_summary(store_path: Path, start: float, end: float) -> pd.DataFrame:
    """Per experiment that kept its commands' spans on real hosts in [start, end): its host
    minutes and where they went (``analysis.host_time``; an autotune's over its candidates'
    staircases), most minutes first."""
    rows = []
    with Store(store_path) as store:
        exps = store.experiments()
        for e in exps.itertuples():
            meta = json.loads(e.meta_json)
            spans = [s for s in meta.get("host_time") or [] if start <= s["began"] < end]
            if not spans:
                continue
            runs = store.runs(e.id, family=e.step == AUTOTUNE)  # an autotune's are its candidates'
            spent = host_time.account({"host_time": spans}, runs)
            rows.append({"experiment_id": e.id, "step": e.step, "host_minutes": spent.total_s / 60,
                         "measuring": spent.share("measuring"), "starts": spent.share("starts"),
                         "warmup": spent.share("warmup"), "drain": spent.share("drain"),
                         "lab": spent.overhead_share, **{f"{k}_s": v for k, v in spent.parts.items()}})
    columns = ["experiment_id", "step", "host_minutes", "measuring", "starts", "warmup", "drain",
               "lab", *(f"{k}_s" for k in host_time.PARTS)]
    return pd.DataFrame(rows, columns=columns).sort_values("host_minutes", ascending=False,
                                                           ignore_index=True)


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
