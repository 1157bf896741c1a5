"""The quarterly report: every experiment of a period (runs started within it), read from the store.

It compares the baseline now with the previous period, names per scenario and GPU the best
configuration found and its margin, summarises the sweeps, combinations and stress tests, the
monitoring probes (regression watch), the troubleshooting findings, and writes the recommended
flag changes as ready scenario files. Output: ``index.html`` (figures embedded), ``report.md``,
``report.pdf`` (headless Chromium prints the HTML) and ``recommended/*.yaml`` beside them.

It stays small on a large store: runs come from one SQL query over the period, and raw samples are
read per run, only the columns it needs, and reduced to a few figures per run before the next one
(two quarters with a million requests build in seconds, in a few hundred MB).
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on lab machines
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import yaml
from scipy import stats

from vllm_lab import findings as findings_mod
from vllm_lab.store import Store, StoreError

# Columns of the runs table the report uses (scenario_json is parsed once per run).
RUN_COLUMNS = ("experiment_id", "run_key", "step", "scenario_name", "scenario_json", "point_json",
               "repeat", "host", "gpu_model", "vllm_version", "backend", "status", "error",
               "started", "ended", "requests", "errors", "output_throughput", "goodput",
               "slo_attainment", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p99",
               "queue_len_mean", "queue_len_max", "kv_usage_mean", "kv_usage_max", "preemptions",
               "gpu_util_mean", "gpu_mem_used_max_gib", "summary_json", "samples_file")
# The only sample columns read: prompt lengths (long requests) and the request status.
SAMPLE_COLUMNS = ["prompt_tokens", "status"]
TUNING_STEPS = ("sweep", "combo", "tune")
SIGNIFICANCE = 0.05
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class ReportError(StoreError):
    """The report cannot be built as asked; the message is one sentence for the user."""


# -- the period ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Period:
    """A calendar quarter in UTC: its name, [start, end) in Unix seconds, and the one before."""

    name: str
    start: float
    end: float
    previous: str
    previous_start: float


_PERIOD = re.compile(r"^(\d{4})-?Q([1-4])$", re.IGNORECASE)


def parse_period(text: str) -> Period:
    """PERIOD=2026Q4 as a Period (UTC quarters), or ReportError naming the expected form."""
    match = _PERIOD.match(text.strip())
    if not match:
        raise ReportError(f"PERIOD {text!r} is not a quarter; write it as YYYYQn, e.g. 2026Q4")
    year, quarter = int(match.group(1)), int(match.group(2))

    def first_day(y: int, q: int) -> float:
        y, q = y + (q - 1) // 4, (q - 1) % 4 + 1
        return datetime(y, 3 * q - 2, 1, tzinfo=UTC).timestamp()

    prev_year, prev_q = (year, quarter - 1) if quarter > 1 else (year - 1, 4)
    return Period(f"{year}Q{quarter}", first_day(year, quarter), first_day(year, quarter + 1),
                  f"{prev_year}Q{prev_q}", first_day(prev_year, prev_q))


# -- reading the store --------------------------------------------------------------------------

def load_runs(store_path: Path, start: float, end: float) -> pd.DataFrame:
    """Runs started in [start, end), with their scenario decoded and the sweep parameter named."""
    Store(store_path).close()  # refuses a newer schema, creates nothing else
    conn = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)
    try:
        runs = pd.read_sql_query(
            f"SELECT {', '.join(RUN_COLUMNS)} FROM runs WHERE started >= ? AND started < ? "
            "ORDER BY started", conn, params=(start, end))
        exps = pd.read_sql_query("SELECT id, meta_json FROM experiments", conn)
    finally:
        conn.close()
    runs["scenario"] = runs["scenario_json"].map(json.loads)
    runs["label"] = runs["scenario_name"] + " · " + runs["gpu_model"]
    params = {r.id: _params(json.loads(r.meta_json)) for r in exps.itertuples()}
    runs["params"] = runs["experiment_id"].map(lambda e: params.get(e, []))
    return runs.drop(columns=["scenario_json"])


def _params(meta: dict[str, Any]) -> list[str]:
    return list(meta.get("params") or ([meta["param"]] if meta.get("param") else []))


def _run_sample_figures(path: Path) -> tuple[float, float, float]:
    """One run's prompt p50, p99 and error count, from two columns of its Parquet file."""
    try:
        table = pq.read_table(path, columns=SAMPLE_COLUMNS)
    except (OSError, ValueError, KeyError):
        return (np.nan, np.nan, np.nan)
    prompts = table.column("prompt_tokens").to_numpy(zero_copy_only=False)
    prompts = prompts[~pd.isna(prompts)].astype(float)
    errors = float(np.sum(table.column("status").to_numpy(zero_copy_only=False) != "ok"))
    if not len(prompts):
        return (np.nan, np.nan, errors)
    p50, p99 = np.percentile(prompts, [50, 99])
    return (float(p50), float(p99), errors)


def sample_figures(store_path: Path, runs: pd.DataFrame, threads: int = 4) -> pd.DataFrame:
    """Per run (same index as ``runs``): prompt_p50, prompt_p99, sample_errors from its samples.

    Files are read one at a time per thread (pyarrow releases the GIL), so at most ``threads``
    runs' samples are in memory at once.
    """
    folder = Path(store_path).with_name(Path(store_path).stem + ".samples")
    paths = [folder / f if f else None for f in runs["samples_file"]]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        rows = list(pool.map(lambda p: _run_sample_figures(p) if p else (np.nan,) * 3, paths))
    return pd.DataFrame(rows, columns=["prompt_p50", "prompt_p99", "sample_errors"],
                        index=runs.index)


# -- the analyses -------------------------------------------------------------------------------

def _ok(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "ok"]


def _meets_slo(summary_json: str) -> bool:
    try:
        return bool(json.loads(summary_json).get("meets_slo", False))
    except (json.JSONDecodeError, AttributeError):
        return False


def baseline_comparison(now: pd.DataFrame, before: pd.DataFrame) -> pd.DataFrame:
    """Per scenario and GPU: the baseline's figures now and in the previous period, and a t-test."""
    rows = []
    now_b, before_b = _ok(now[now["step"] == "baseline"]), _ok(before[before["step"] == "baseline"])
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
    ok = _ok(runs).assign(meets=lambda d: d["summary_json"].map(_meets_slo))
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
    base = _ok(runs[runs["step"] == "baseline"]).groupby("label").agg(
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
        ok = _ok(group)
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


def recommendations(best: pd.DataFrame, runs: pd.DataFrame, folder: Path) -> pd.DataFrame:
    """Write one ready scenario file per scenario and GPU whose best flags differ from its baseline."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for _, b in best.iterrows():
        changes = {k: v for k, v in b["serve"].items() if b["base_serve"].get(k) != v}
        if not changes or not (b["margin_vs_baseline"] > 0):
            continue
        source = runs[(runs["label"] == b["label"]) & (runs["experiment_id"] == b["experiment_id"])]
        scenario = {**source["scenario"].iloc[-1], "serve": b["serve"]}  # the best point's flags
        preset = _preset_for(scenario)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{b['scenario_name']}-{preset or 'gpu'}")
        path = folder / f"{name}.yaml"
        body = {"description": f"Recommended by the quarterly report: {b['scenario_name']} on "
                               f"{b['gpu_model']}, goodput {b['margin_vs_baseline']:+.0%} vs baseline",
                **({"hardware_preset": preset} if preset else {}),
                "serve": scenario["serve"], "workload": scenario["workload"],
                "load": scenario["load"], "slo": scenario.get("slo") or {},
                "run": {"repeats": 3}}
        header = (f"# {b['label']}: the best configuration of the period (experiment "
                  f"{b['experiment_id']}).\n# Changed from the baseline: "
                  + ", ".join(f"{k}: {b['base_serve'].get(k, 'default')} -> {v}"
                              for k, v in changes.items())
                  + f"\n# Check it before adopting it:  make baseline SCENARIO={path}\n")
        path.write_text(header + yaml.safe_dump(_plain(body), sort_keys=False))
        rows.append({"label": b["label"], "file": path, "changes": changes,
                     "margin": b["margin_vs_baseline"]})
    return pd.DataFrame(rows)


def _preset_for(scenario: dict[str, Any]) -> str | None:
    """The hardware preset file whose GPU matches the run's, so the scenario file names it."""
    from vllm_lab.scenarios import SCENARIO_DIR
    gpu = (scenario.get("hardware") or {}).get("gpu")
    for path in sorted((SCENARIO_DIR / "hardware").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if (data.get("hardware") or {}).get("gpu") == gpu:
            return path.stem
    return None


def _plain(value: Any) -> Any:
    """Numpy scalars and containers as plain YAML types."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# -- figures ------------------------------------------------------------------------------------

def _caption(runs: pd.DataFrame, period: Period) -> str:
    models = sorted({str(s["serve"].get("model")) for s in runs["scenario"].iloc[:: max(1, len(runs) // 200)]})
    return (f"{period.name} · GPUs: {', '.join(sorted(runs['gpu_model'].unique()))} · "
            f"models: {', '.join(models)}\nvLLM {', '.join(sorted(runs['vllm_version'].unique()))} · "
            f"backends: {', '.join(sorted(runs['backend'].unique()))} · workloads: each scenario's own")


def _save(fig, path: Path, caption: str) -> Path:
    fig.text(0.01, 0.005, caption, fontsize=7, va="bottom", color="#555")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _barh_axes(rows: int):
    """A horizontal-bar figure sized for ``rows`` labelled rows, with room for a legend at right."""
    height = 0.5 * rows + 1.8
    fig, ax = plt.subplots(figsize=(10, height))
    fig.subplots_adjust(left=0.3, bottom=0.75 / height + 0.08, right=0.82, top=0.9)
    return fig, ax, np.arange(rows)


def figure_baseline(cmp: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Baseline output throughput now vs the previous period, per scenario and GPU."""
    if cmp.empty:
        return None
    cmp = cmp.sort_values("label")
    fig, ax, y = _barh_axes(len(cmp))
    ax.barh(y + 0.2, cmp["output_throughput_before"], 0.4, xerr=cmp["output_throughput_before_std"],
            color="#bbb", label="previous period")
    ax.barh(y - 0.2, cmp["output_throughput_now"], 0.4, xerr=cmp["output_throughput_now_std"],
            color="tab:blue", label="this period")
    for yi, (_, r) in zip(y, cmp.iterrows()):
        if not np.isnan(r["throughput_change"]):
            mark = "*" if r["p_value"] < SIGNIFICANCE else ""
            ax.annotate(f"{r['throughput_change']:+.1%}{mark}", (r["output_throughput_now"], yi - 0.2),
                        xytext=(6, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, cmp["label"], fontsize=8)
    ax.set_xlabel("baseline output tokens/s (mean ± sd over repeats)")
    ax.set_title("Baseline now vs the previous period (* significant, Welch t-test p < 0.05)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, folder / "baseline.png", caption)


def figure_best(best: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Goodput of the baseline and of the best configuration, per scenario and GPU."""
    if best.empty:
        return None
    best = best.sort_values("label")
    fig, ax, y = _barh_axes(len(best))
    ax.barh(y + 0.2, best["base_goodput"], 0.4, color="#bbb", label="baseline")
    ax.barh(y - 0.2, best["goodput"], 0.4, color="tab:green", label="best under the SLO")
    for yi, (_, r) in zip(y, best.iterrows()):
        if not np.isnan(r["margin_vs_baseline"]):
            ax.annotate(f"{r['margin_vs_baseline']:+.0%}", (r["goodput"], yi - 0.2), xytext=(6, 0),
                        textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, best["label"], fontsize=8)
    ax.set_xlabel("goodput (requests/s meeting every SLO)")
    ax.set_title("Best configuration found this period vs the baseline", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, folder / "best.png", caption)


def figure_sweeps(points: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Per swept flag: goodput relative to each sweep's best, median over the period's sweeps."""
    sweeps = points[points["step"] == "sweep"].copy()
    sweeps["param"] = sweeps["params"].map(lambda p: p[0] if p else None)
    sweeps = sweeps.dropna(subset=["param"])
    params = sorted(sweeps["param"].unique())[:6]
    if not params:
        return None
    cols = min(3, len(params))
    rows = int(np.ceil(len(params) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.3 * rows + 0.9), squeeze=False)
    fig.subplots_adjust(hspace=0.55, wspace=0.3, bottom=0.55 / (3.3 * rows + 0.9) + 0.12, top=0.9)
    for ax, param in zip(axes.flat, params):
        group = sweeps[sweeps["param"] == param].copy()
        group["value"] = group["point"].map(lambda p, param=param: p.get(param))
        group["rel"] = group["goodput"] / group.groupby("experiment_id")["goodput"].transform("max")
        for label, by_label in group.groupby("label"):
            curve = by_label.groupby("value")["rel"].median().sort_index()
            ax.plot(np.arange(len(curve)), curve.to_numpy(), "o-", ms=3, label=label)
            ax.set_xticks(np.arange(len(curve)), [f"{v:g}" if isinstance(v, float) else str(v)
                                                  for v in curve.index], fontsize=7)
        ax.set_title(param, fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.set_ylabel("goodput / sweep's best", fontsize=7)
    for ax in list(axes.flat)[len(params):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7,
               bbox_to_anchor=(0.5, 0.035), frameon=False)
    fig.suptitle("Single-flag sweeps of the period (median over repeated sweeps)", fontsize=11)
    return _save(fig, folder / "sweeps.png", caption)


def _pareto(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the points no other beats on both throughput (higher) and latency (lower)."""
    order = np.argsort(-x)
    front, best_y = [], np.inf
    for i in order:
        if y[i] < best_y:
            front.append(i)
            best_y = y[i]
    return np.array(front, dtype=int)


def figure_combos(points: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Combinations: throughput vs TTFT p99 per scenario and GPU, the Pareto front drawn."""
    combos = points[points["step"].isin(("combo", "tune"))]
    labels = sorted(combos["label"].unique())[:8]
    if not labels:
        return None
    cols = min(4, len(labels))
    rows = int(np.ceil(len(labels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows + 0.8), squeeze=False)
    fig.subplots_adjust(hspace=0.6, wspace=0.35, bottom=0.5 / (3.2 * rows + 0.8) + 0.1, top=0.88)
    for ax, label in zip(axes.flat, labels):
        group = combos[combos["label"] == label]
        x, y = group["output_throughput"].to_numpy(), group["ttft_p99"].to_numpy() * 1000
        ok = group["meets_slo"].to_numpy()
        ax.scatter(x[~ok], y[~ok], s=10, color="#ccc", label="misses SLO")
        ax.scatter(x[ok], y[ok], s=10, color="tab:blue", label="meets SLO")
        front = _pareto(x, y)
        ax.plot(x[front], y[front], "-", color="tab:red", lw=1, label="Pareto front")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("output tokens/s", fontsize=7)
        ax.set_ylabel("TTFT p99 (ms)", fontsize=7)
        ax.set_yscale("log")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(labels):]:
        ax.axis("off")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", fontsize=7, ncol=3, frameon=False)
    fig.suptitle("Combinations: throughput against TTFT p99", fontsize=11, x=0.3)
    return _save(fig, folder / "combos.png", caption)


def figure_stress(points: pd.DataFrame, stress: pd.DataFrame, folder: Path,
                  caption: str) -> Path | None:
    """Stress: TTFT p99 against offered load, the latest test per scenario and GPU, knee marked."""
    if stress.empty:
        return None
    latest = stress.groupby("label").tail(1)
    fig, ax = plt.subplots(figsize=(10, 4.6))
    fig.subplots_adjust(bottom=0.33, right=0.72, top=0.9)
    for _, s in latest.iterrows():
        group = points[points["experiment_id"] == s["experiment_id"]].copy()
        group["level"] = group["point"].map(lambda p: p.get("load.shape.level", np.nan))
        group = group.sort_values("level")
        line, = ax.plot(group["level"], group["ttft_p99"] * 1000, "o-", ms=3, label=s["label"])
        if not np.isnan(s["knee_level"]):
            knee = group[group["level"] == s["knee_level"]]
            ax.plot(knee["level"], knee["ttft_p99"] * 1000, "D", ms=8, color=line.get_color(),
                    markerfacecolor="none")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (users or requests/s)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_title("Stress tests: latency against load (◇ = knee: the highest load meeting the SLO)",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, folder / "stress.png", caption)


def figure_watch(runs: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Regression watch: each deployment's probe throughput over the period, regressions marked."""
    watch = _ok(runs[runs["step"].isin(["watch", "monitor"])])
    if watch.empty:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.2))
    fig.subplots_adjust(bottom=0.3, right=0.72, top=0.9)
    flagged = watch["summary_json"].map(lambda s: bool(json.loads(s).get("regression", False)))
    for host, group in watch.groupby("host"):
        t = pd.to_datetime(group["started"], unit="s")
        ax.plot(t, group["output_throughput"], "-", lw=1, label=host)
        bad = flagged.loc[group.index]
        ax.plot(t[bad.to_numpy()], group["output_throughput"][bad], "x", color="red", ms=7)
    ax.plot([], [], "x", color="red", label="regression flagged")
    ax.set_ylabel("probe output tokens/s")
    ax.set_title("Regression watch: the probe load on each deployment", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.autofmt_xdate()
    return _save(fig, folder / "watch.png", caption)


# -- writing ------------------------------------------------------------------------------------

def _fmt(v: Any, kind: str = "") -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "–"
    if kind == "pct":
        return f"{v:+.1%}"
    if kind == "ms":
        return f"{v * 1000:.0f}"
    if kind == "p":
        return f"{v:.3f}" if v >= 0.001 else "<0.001"
    if isinstance(v, (float, np.floating)):
        if float(v).is_integer():
            return f"{v:,.0f}"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items()) or "defaults"
    return str(v)


@dataclass
class Section:
    """One section of the report: a title, a lead sentence, tables and figures."""

    title: str
    lead: str
    tables: list[tuple[list[str], list[list[str]]]]
    figures: list[Path]
    notes: list[str]


def _table(df: pd.DataFrame, columns: list[tuple[str, str, str]], limit: int = 40):
    """(header, rows) for ``columns`` = [(column, heading, format)], at most ``limit`` rows."""
    header = [h for _, h, _ in columns]
    rows = [[_fmt(r.get(c), k) for c, _, k in columns] for r in df.head(limit).to_dict("records")]
    return header, rows


def _sections(period: Period, runs: pd.DataFrame, cmp: pd.DataFrame, best: pd.DataFrame,
              sweeps: pd.DataFrame, stress: pd.DataFrame, watch: pd.DataFrame,
              found: pd.DataFrame, recs: pd.DataFrame, figures: dict[str, Path | None],
              points: pd.DataFrame) -> list[Section]:
    by_step = runs.groupby("step").size().to_dict()
    by_status = runs.groupby("status").size().to_dict()
    overview = Section(
        "The period at a glance",
        f"{len(runs):,} runs in {runs['experiment_id'].nunique():,} experiments, "
        f"{pd.to_datetime(runs['started'].min(), unit='s'):%Y-%m-%d} to "
        f"{pd.to_datetime(runs['started'].max(), unit='s'):%Y-%m-%d} (UTC).",
        [(["step", "runs"], [[k, f"{v:,}"] for k, v in sorted(by_step.items())]),
         (["status", "runs"], [[k, f"{v:,}"] for k, v in sorted(by_status.items())])],
        [], [f"GPUs: {', '.join(sorted(runs['gpu_model'].unique()))}",
             (f"hosts: {runs['host'].nunique()}, vLLM versions: "
             f"{', '.join(sorted(runs['vllm_version'].unique()))}")])
    slower = cmp[cmp["verdict"] == "slower"] if len(cmp) else cmp
    baseline = Section(
        f"Baseline: {period.name} against {period.previous}",
        (f"{len(slower)} of {len(cmp)} baselines are significantly slower than last period."
         if len(cmp) else "No baseline runs this period."),
        [_table(cmp, [("label", "scenario · GPU", ""), ("runs_now", "runs", ""),
                      ("output_throughput_now", "tok/s now", ""),
                      ("output_throughput_before", "tok/s before", ""),
                      ("throughput_change", "change", "pct"), ("p_value", "p", "p"),
                      ("ttft_p99_now", "TTFT p99 now (ms)", "ms"),
                      ("ttft_p99_before", "before (ms)", "ms"),
                      ("tpot_p99_now", "TPOT p99 now (ms)", "ms"), ("verdict", "verdict", "")])],
        [f for f in [figures.get("baseline")] if f], [])
    best_sec = Section(
        "Best configuration per scenario",
        "The tuned point (sweep, combination or tuning run) with the highest goodput among those "
        "meeting every SLO; its margin over the baseline, and over the runner-up in run-to-run "
        "standard deviations (below 2 the win is not clear).",
        [_table(best, [("label", "scenario · GPU", ""), ("point", "flags varied", ""),
                       ("goodput", "goodput", ""), ("base_goodput", "baseline", ""),
                       ("margin_vs_baseline", "margin", "pct"),
                       ("margin_vs_runner_up_sd", "vs runner-up (sd)", ""),
                       ("ttft_p99", "TTFT p99 (ms)", "ms"), ("tpot_p99", "TPOT p99 (ms)", "ms"),
                       ("experiment_id", "experiment", "")])],
        [f for f in [figures.get("best")] if f], [])
    sweep_sec = Section(
        "Sweeps, combinations and stress tests",
        f"{len(sweeps)} sweeps, {points[points['step'].isin(('combo', 'tune'))]['experiment_id'].nunique()} "
        f"combination searches, {len(stress)} stress tests.",
        [_table(sweep_rollup(sweeps),
                [("label", "scenario · GPU", ""), ("param", "flag", ""), ("sweeps", "sweeps", ""),
                 ("best_values", "best under SLO (how often)", ""),
                 ("gain_median", "median gain vs worst", "pct"), ("latest", "latest sweep", "")],
                limit=60),
         _table(stress, [("label", "scenario · GPU", ""), ("levels", "levels", ""),
                         ("knee_level", "knee (highest load under SLO)", ""),
                         ("peak_throughput", "peak tok/s", ""),
                         ("ttft_p99_at_peak_s", "TTFT p99 at peak (ms)", "ms"),
                         ("experiment_id", "experiment", "")], limit=30)],
        [f for f in (figures.get("sweeps"), figures.get("combos"), figures.get("stress")) if f],
        [])
    total_reg = int(watch["regressions"].sum()) if len(watch) else 0
    watch_sec = Section(
        "Monitoring: the regression watch",
        f"{int(watch['probes'].sum()) if len(watch) else 0} probes on {len(watch)} deployments; "
        f"{total_reg} flagged as a regression against their recorded baseline.",
        [_table(watch, [("host", "deployment", ""), ("label", "scenario · GPU", ""),
                        ("probes", "probes", ""), ("failed", "failed", ""),
                        ("throughput_first", "tok/s first", ""),
                        ("throughput_last", "tok/s last", ""),
                        ("ttft_p99_median", "TTFT p99 median (ms)", "ms"),
                        ("gpu_util_mean", "GPU util %", ""), ("kv_usage_max", "KV max", ""),
                        ("regressions", "regressions", "")])],
        [f for f in [figures.get("watch")] if f], [])
    find_sec = Section(
        "Findings",
        f"{int(found['runs'].sum()) if len(found) else 0} runs show a pattern of the tuning guide's "
        "troubleshooting list; per pattern, scenario and GPU, the latest run's numbers and the flag "
        "to try.",
        [_table(found, [("title", "finding", ""), ("label", "scenario · GPU", ""),
                        ("runs", "runs", ""), ("evidence", "numbers (latest run)", ""),
                        ("flags", "try", "")], limit=30)], [], [])
    rec_rows = [[r["label"], _fmt(r["changes"]), f"{r['margin']:+.0%}", str(r["file"].name)]
                for r in recs.to_dict("records")]
    rec_sec = Section(
        "Recommended flag changes",
        "Ready scenario files, written next to this report: run `make baseline "
        "SCENARIO=<file>` to confirm a change on your own traffic before adopting it.",
        [(["scenario · GPU", "change", "goodput vs baseline", "file"], rec_rows)], [], [])
    return [overview, baseline, best_sec, sweep_sec, watch_sec, find_sec, rec_sec]


def _markdown(period: Period, sections: list[Section], caption: str) -> str:
    lines = [f"# Quarterly report {period.name}", "", "```", caption, "```", ""]
    for s in sections:
        lines += [f"## {s.title}", "", s.lead, ""]
        for header, rows in s.tables:
            if not rows:
                continue
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows] + [""]
        lines += [f"- {n}" for n in s.notes] + ([""] if s.notes else [])
        lines += [f"![{f.stem}]({f.name})" for f in s.figures] + [""]
    return "\n".join(lines)


CSS = """
body{font-family:"DejaVu Sans",system-ui,sans-serif;max-width:1180px;margin:1.5em auto;color:#222;
     font-size:14px;line-height:1.4}
h1{margin-bottom:.2em} h2{border-bottom:2px solid #dde;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:12px;margin:.6em 0;width:100%}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f0f2f6} tr:nth-child(even) td{background:#fafafa}
td.num{text-align:right;white-space:nowrap}
figure{margin:.8em 0} img{max-width:100%} .lead{font-size:1.05em;background:#eef4fb;padding:.5em .7em}
.ctx{color:#555;white-space:pre-line;font-size:12px} code{font-size:12px}
@page{size:A4;margin:12mm}
@media print{body{max-width:none;margin:0;font-size:11px} table{font-size:9px}
  h2{break-before:page} h2.first{break-before:auto} figure,tr,.lead{break-inside:avoid}
  thead{display:table-header-group}}
"""


def _html(period: Period, sections: list[Section], caption: str) -> str:
    def img(path: Path) -> str:
        data = base64.b64encode(path.read_bytes()).decode()
        return f'<figure><img alt="{path.stem}" src="data:image/png;base64,{data}"></figure>'

    def cell(text: str) -> str:
        numeric = bool(re.fullmatch(r"[-+<–]?[\d,.]+%?|–", text))
        return f'<td class="num">{html.escape(text)}</td>' if numeric else f"<td>{html.escape(text)}</td>"

    body = []
    for i, s in enumerate(sections):
        first = ' class="first"' if i == 0 else ""
        body.append(f"<h2{first}>{html.escape(s.title)}</h2>")
        body.append(f'<p class="lead">{html.escape(s.lead)}</p>')
        for header, rows in s.tables:
            if not rows:
                continue
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            trs = "".join("<tr>" + "".join(cell(c) for c in r) + "</tr>" for r in rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
        if s.notes:
            body.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in s.notes) + "</ul>")
        body.extend(img(f) for f in s.figures)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>Quarterly report '
            f"{period.name}</title><style>{CSS}</style></head><body>"
            f"<h1>Quarterly report {period.name}</h1><p class=\"ctx\">{html.escape(caption)}</p>"
            + "".join(body)
            + f'<p style="color:#888;font-size:11px">Built from the store alone: make report '
              f"PERIOD={period.name}</p></body></html>")


def chromium() -> str | None:
    """The headless browser that prints the PDF, if one is installed."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def print_pdf(index: Path, pdf: Path, timeout_s: float = 120) -> Path:
    """Print the HTML to PDF with headless Chromium (its own process group, killed on timeout)."""
    exe = chromium()
    if exe is None:
        raise ReportError("the PDF needs Chromium (scripts/install-system-deps.sh installs it); "
                          "rerun with --no-pdf to skip it")
    with tempfile.TemporaryDirectory(prefix="vllm-lab-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run",
               "--no-pdf-header-footer", f"--user-data-dir={profile}",
               f"--print-to-pdf={pdf.resolve()}", index.resolve().as_uri()]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ReportError(f"Chromium did not print {pdf} within {timeout_s:.0f} s") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if not pdf.exists() or pdf.stat().st_size == 0:
        raise ReportError(f"Chromium did not write {pdf}: {err.decode(errors='replace')[-300:]}")
    return pdf


def build(store_path: Path, period_text: str, out_root: Path, pdf: bool = True) -> Path:
    """Write the period's report folder (HTML, Markdown, PDF, figures, scenario files); return index.html."""
    period = parse_period(period_text)
    store_path = Path(store_path)
    if not store_path.exists():
        raise ReportError(f"{store_path}: no store; run an experiment first or pass OUT=<folder>")
    runs = load_runs(store_path, period.previous_start, period.end)
    before = runs[runs["started"] < period.start]
    now = runs[runs["started"] >= period.start].copy()
    if now.empty:
        raise ReportError(f"{store_path}: no runs started in {period.name} "
                          f"({datetime.fromtimestamp(period.start, UTC):%Y-%m-%d} to "
                          f"{datetime.fromtimestamp(period.end, UTC):%Y-%m-%d}, UTC)")
    now = now.join(sample_figures(store_path, now))
    folder = out_root / "quarterly" / period.name
    folder.mkdir(parents=True, exist_ok=True)
    caption = _caption(now, period)
    points = point_means(now)
    cmp = baseline_comparison(now, before)
    best = best_configurations(now, points)
    sweeps, stress, watch = sweep_summary(points), stress_summary(points), watch_summary(now)
    found = findings_table(all_findings(now), now)
    recs = recommendations(best, now, folder / "recommended")
    figures = {"baseline": figure_baseline(cmp, folder, caption),
               "best": figure_best(best, folder, caption),
               "sweeps": figure_sweeps(points, folder, caption),
               "combos": figure_combos(points, folder, caption),
               "stress": figure_stress(points, stress, folder, caption),
               "watch": figure_watch(now, folder, caption)}
    sections = _sections(period, now, cmp, best, sweeps, stress, watch, found, recs, figures, points)
    (folder / "report.md").write_text(_markdown(period, sections, caption))
    index = folder / "index.html"
    index.write_text(_html(period, sections, caption))
    best.drop(columns=["serve", "base_serve"], errors="ignore").to_csv(folder / "best.csv", index=False)
    if pdf:
        print_pdf(index, folder / "report.pdf")
    return index
