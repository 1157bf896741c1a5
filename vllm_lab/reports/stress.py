"""Reports of step 4 from the store: a staircase (ramp/step) or one spike/soak run.

A staircase gets latency percentiles, throughput and errors against the offered load with the knee
and the maximum sustainable load marked; a spike or a soak gets the same quantities against time.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from vllm_lab.analysis.stress import (
    GROWTH_SLOPE,
    find_knee,
    levels_table,
    soak_drift,
    spike_behaviour,
    windows,
)
from vllm_lab.reports import page, sweep, traffic
from vllm_lab.reports.figures import save
from vllm_lab.reports.page import Context
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store


def staircase_figure(table: pd.DataFrame, knee: dict, ctx: Context, folder: Path) -> Path:
    """Latency, throughput and errors against offered load, knee and max sustainable load marked."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    # The rate each run really sent (the knee is read on it); the level where a run has no samples.
    x = table["offered"].fillna(table["level"]) if "offered" in table else table["level"]
    for metric, style in (("ttft", "-"), ("e2e", "--")):
        for p in ("p50", "p90", "p99"):
            axes[0].plot(x, table[f"{metric}_{p}"] * 1000, style, marker="o", ms=3, label=f"{metric} {p}")
    for name, target in (ctx.slo or {}).items():
        if target and name in ("ttft", "e2e"):
            axes[0].axhline(target["threshold_ms"], color="red", ls=":", lw=1,
                            label=f"SLO {name} p{target['percentile']:g}")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("latency (ms)")
    axes[1].plot(x, x, ":", color="gray", label="offered")
    axes[1].plot(x, table["request_throughput"], "o-", label="served req/s")
    axes[1].plot(x, table["goodput"], "s--", label="goodput req/s")
    axes[1].set_ylabel("requests/s")
    axes[2].plot(x, table["errors"], "o-", color="tab:red", label="errors")
    ax3 = axes[2].twinx()
    ax3.plot(x, table["latency_growth"], "^--", color="tab:purple", label="E2E growth (s/s)")
    ax3.axhline(GROWTH_SLOPE, color="tab:purple", lw=0.8, ls=":")
    ax3.set_ylabel("E2E growth within the run (s per s)")
    axes[2].set_ylabel("failed requests")
    for ax in axes:
        ax.set_xlabel("offered load (req/s, as sent)")
        ax.grid(alpha=0.3)
        if knee.get("knee") is not None:
            ax.axvline(knee["knee"], color="red", lw=2, label=f"knee {knee['knee']:.3g} req/s")
        if knee.get("max_sustainable") is not None:
            ax.axvline(knee["max_sustainable"], color="green", ls="--",
                       label=f"max sustainable under SLO {knee['max_sustainable']:.3g}")
        ax.legend(fontsize=7)
    fig.suptitle("Stress staircase: latency, throughput and errors vs offered load", fontsize=11)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    return save(fig, folder / "stress.png")


def timeline_figure(win: pd.DataFrame, scenario: Scenario, ctx: Context, folder: Path,
                    title: str) -> Path:
    """Offered and served load, latency, errors and the server's queue against time."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    axes[0].plot(win["t"], win["offered"], label="offered req/s")
    axes[0].plot(win["t"], win["completed"], label="completed req/s")
    axes[1].plot(win["t"], win["ttft_p50"] * 1000, label="TTFT p50")
    axes[1].plot(win["t"], win["ttft_p99"] * 1000, label="TTFT p99")
    axes[1].set_ylabel("ms")
    axes[2].bar(win["t"], win["errors"], width=1.5, color="tab:red", alpha=0.6, label="errors")
    for col in ("waiting", "kv_usage"):
        if col in win:
            ax = axes[2].twinx() if col == "waiting" else axes[0].twinx()
            ax.plot(win["t"], win[col], color="tab:purple" if col == "waiting" else "tab:brown",
                    label=col)
            ax.set_ylabel(col)
            ax.legend(loc="upper right", fontsize=7)
    if scenario.load.shape.kind == "spike":
        for ax in axes:
            ax.axvspan(scenario.load.shape.spike_at_s, scenario.load.shape.spike_at_s
                       + scenario.load.shape.spike_s, color="orange", alpha=0.15, label="spike")
    for ax in axes:
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    return save(fig, folder / "timeline.png")


def build_stress(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """The stress report: a staircase with its knee, or a spike/soak timeline with its figures."""
    ctx = page.context(runs)
    shape = exp["meta"]["shape"]
    if shape in ("ramp", "step"):
        table = levels_table(store, exp["id"], runs)
        knee = find_knee(table)
        figures = [staircase_figure(table, knee, ctx, folder)]
        headline = _staircase_headline(knee)
        shown = table[["level", *(["offered"] if "offered" in table else []), "status", "request_throughput", "goodput", "ttft_p50", "ttft_p99",
                       "e2e_p99", "errors", "latency_growth", "unbounded", "meets_slo"]]
        notes = [(f"knee bracket: levels {knee['bracket'][0]:.3g}–{knee['bracket'][1]:.3g} req/s; loads "
                  "are the rates the runs really sent (a level is the arrival process's mean)")] \
            if knee["bracket"] else []
    else:
        run = runs.iloc[-1]
        scenario = Scenario.model_validate_json(run["scenario_json"])
        win = windows(store.samples(exp["id"], run["run_key"]),
                             store.server_metrics(exp["id"], run["run_key"]))
        figures = [timeline_figure(win, scenario, ctx, folder, f"{shape}: the run against time")]
        found = spike_behaviour(win, scenario) if shape == "spike" else soak_drift(win)
        headline = _single_headline(shape, found)
        shown = win
        notes = [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in found.items()]
    shown.to_csv(folder / "summary.csv", index=False)
    figures = [f for f in [*figures, traffic.trace_figure(runs, folder, ctx.caption)] if f]
    return page.write_page(sweep.experiment_page(exp, ctx, headline, shown, notes, figures), folder)


def _staircase_headline(knee: dict) -> str:
    parts = []
    if knee["knee"] is not None:
        parts.append(f"Knee at {knee['knee']:.3g} req/s")
    if knee["knee_unbounded"] is not None:
        parts.append(f"latency grows without bound past {knee['knee_unbounded']:.3g} req/s")
    if knee["knee_slo"] is not None:
        parts.append(f"the SLO breaks past {knee['knee_slo']:.3g} req/s")
    parts.append(f"max sustainable load under the SLO: {knee['max_sustainable']:.3g} req/s"
                 if knee["max_sustainable"] is not None else "no level held under the SLO")
    return "; ".join(parts) + "."


def _single_headline(shape: str, found: dict) -> str:
    if shape == "spike":
        rec = found.get("recovery_s")
        return (f"Spike: peak TTFT p99 {found.get('peak_ttft_p99', math.nan) * 1000:.0f} ms, "
                f"{found.get('errors_in_spike', 0):.0f} errors, peak queue {found.get('peak_queue', math.nan):.0f}, "
                f"preemptions {found.get('preemptions', math.nan):.0f}; "
                + (f"recovered {rec:.1f} s after the spike." if rec is not None else "did not recover in the run."))
    drift = found.get("ttft_p50_drift")
    mem = found.get("kv_usage_drift", found.get("gpu_mem_mib_drift"))
    return (f"Soak over {found.get('duration_s', 0):.0f} s: TTFT p50 drift "
            f"{(drift or 0) * 100:+.1f}% (first to last third)"
            + (f", memory drift {mem * 100:+.1f}%" if mem is not None and not math.isnan(mem) else "") + ".")
