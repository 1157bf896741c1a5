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
    SERVED_TOLERANCE,
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
            axes[0].plot(x, table[f"{metric}_{p}"] * 1000, style, marker="o", ms=3, label=f"{metric.upper()} {p}")
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
        # Under the axes, never over the data.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.suptitle("Stress staircase: latency, throughput and errors vs offered load", fontsize=11)
    fig.text(0.01, -0.30, ctx.caption, fontsize=7, va="top")
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
    for col, label in (("waiting", "requests waiting"), ("kv_usage", "KV cache usage (fraction)")):
        if col in win:
            ax = axes[2].twinx() if col == "waiting" else axes[0].twinx()
            ax.plot(win["t"], win[col], color="tab:purple" if col == "waiting" else "tab:brown",
                    label=label)
            ax.set_ylabel(label)
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


def staircase(store: Store, exp: dict, runs: pd.DataFrame) -> tuple[pd.DataFrame, dict, str]:
    """A staircase's levels (``analysis.stress``), its knee and its headline."""
    table = levels_table(store, exp["id"], runs)
    knee = find_knee(table)
    return table, knee, _staircase_headline(knee)


def single(store: Store, exp: dict, runs: pd.DataFrame) -> tuple[str, pd.DataFrame, dict, Scenario]:
    """A spike's or a soak's headline, its run in windows, what it found, and its scenario."""
    run = runs.iloc[-1]
    scenario = Scenario.model_validate_json(run["scenario_json"])
    win = windows(store.samples(exp["id"], run["run_key"]),
                  store.server_metrics(exp["id"], run["run_key"]))
    shape = exp["meta"]["shape"]
    found = spike_behaviour(win, scenario) if shape == "spike" else soak_drift(win)
    return _single_headline(shape, found), win, found, scenario


def verdict_text(row: pd.Series) -> str:
    """A level's verdict in words: sustainable, or what broke (the served rate, the SLO), or the
    status that left it out."""
    if not row["ok"]:
        return f"left out: {row['status']}"
    if row.get("sustainable", row["meets_slo"] and not row["unbounded"]):
        return "sustainable"
    why = []
    if row["unbounded"]:  # overload is judged by the served rate alone (``level_verdict``)
        why.append("served below offered")
    if not row["meets_slo"]:
        why.append("SLO broken")
    return ", ".join(why)


def levels_shown(table: pd.DataFrame) -> pd.DataFrame:
    """The levels as the page shows them: every load and latency with its unit."""
    out = pd.DataFrame({"level req/s": table["level"]})
    if "offered" in table:
        out["offered req/s"] = table["offered"]
    out["served req/s"] = table["request_throughput"]
    out["goodput req/s"] = table["goodput"]
    for col, heading in (("ttft_p50", "TTFT p50 ms"), ("ttft_p99", "TTFT p99 ms"),
                         ("e2e_p99", "E2E p99 ms")):
        out[heading] = table[col] * 1000
    out["errors"] = table["errors"]
    out["E2E growth s/s"] = table["latency_growth"]
    out["verdict"] = [verdict_text(r) for _, r in table.iterrows()]
    return out


def build_stress(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """The stress report: a staircase with its knee, or a spike/soak timeline with its figures."""
    ctx = page.context(runs)
    shape = exp["meta"]["shape"]
    if shape in ("ramp", "step"):
        table, knee, headline = staircase(store, exp, runs)
        figures = [staircase_figure(table, knee, ctx, folder)]
        shown = levels_shown(table)
        notes = [(f"knee bracket: levels {knee['bracket'][0]:.3g}–{knee['bracket'][1]:.3g} req/s; loads "
                  "are the rates the runs really sent (a level is the arrival process's mean)")] \
            if knee["bracket"] else []
        notes.append(f"sustainable: served within {SERVED_TOLERANCE:.0%} of the rate sent inside the "
                     f"run's steady window (less twice the square root of the requests in flight "
                     f"at its edges; served counts each request by the tokens it got in the window, "
                     f"so this is the work in flight staying bounded) and the SLO met; the E2E "
                     f"growth is shown, not judged (a large batch still filling grows as fast in "
                     f"a short level)")
        table.to_csv(folder / "summary.csv", index=False)
    else:
        headline, win, found, scenario = single(store, exp, runs)
        figures = [timeline_figure(win, scenario, ctx, folder, f"{shape}: the run against time")]
        shown = win
        notes = [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in found.items()]
        shown.to_csv(folder / "summary.csv", index=False)
    figures = [f for f in [*figures, traffic.trace_figure(runs, folder, ctx.caption)] if f]
    return page.write_page(sweep.experiment_page(exp, ctx, headline, shown, notes, figures,
                                                 rule=None, runs=runs), folder)


def _staircase_headline(knee: dict) -> str:
    # A knee of 0 is one below the lowest level asked: the staircase never saw it.
    parts = []
    if knee["knee"] == 0:
        parts.append("Knee below the lowest level asked")
    elif knee["knee"] is not None:
        parts.append(f"Knee at {knee['knee']:.3g} req/s offered")
    if knee["knee_unbounded"] is not None:
        parts.append(f"past {knee['knee_unbounded']:.3g} req/s the server serves less than it is "
                     f"sent: its work in flight grows")
    if knee["knee_slo"] == 0:
        parts.append("the SLO is broken from the lowest level on")
    elif knee["knee_slo"] is not None:
        parts.append(f"the SLO breaks past {knee['knee_slo']:.3g} req/s")
    parts.append(f"max sustainable load (served as sent, SLO met): "
                 f"{knee['max_sustainable']:.3g} req/s" if knee["max_sustainable"] is not None
                 else "no level was sustainable under the SLO")
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
