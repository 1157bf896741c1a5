"""The quarterly report's figures: one per section, each captioned with what it came from."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from vllm_lab.analysis.points import pareto_front
from vllm_lab.analysis.quarterly import SIGNIFICANCE, ok_runs
from vllm_lab.reports.figures import save_captioned
from vllm_lab.reports.quarterly.period import Period
from vllm_lab.reports.quarterly.recommended import interval_text

# Inches: a figure of one small panel is still as wide as its title and its caption line.
MIN_WIDTH = 9.0


def caption(runs: pd.DataFrame, period: Period) -> str:
    """What the period's figures came from: GPUs, models, vLLM versions, backends."""
    models = sorted({str(s["serve"].get("model")) for s in runs["scenario"].iloc[:: max(1, len(runs) // 200)]})
    return (f"{period.name} · GPUs: {', '.join(sorted(runs['gpu_model'].unique()))} · "
            f"models: {', '.join(models)}\nvLLM {', '.join(sorted(runs['vllm_version'].unique()))} · "
            f"backends: {', '.join(sorted(runs['backend'].unique()))} · workloads: each scenario's own")


def _axes(height: float, bottom: float, right: float = 0.72, left: float | None = None):
    """A one-chart figure 10 inches wide, its title at the top and room for a legend at right."""
    fig, ax = plt.subplots(figsize=(10, height))
    fig.subplots_adjust(left=left, bottom=bottom, right=right, top=0.9)
    return fig, ax


def _grid_and_legend(ax, fontsize: float, **grid) -> None:
    """The light grid every chart has and its legend outside the axes, at right."""
    ax.grid(alpha=0.3, **grid)
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1))


def _barh_axes(rows: int):
    """A horizontal-bar figure sized for ``rows`` labelled rows, with room for a legend at right."""
    height = 0.5 * rows + 1.8
    fig, ax = _axes(height, bottom=0.75 / height + 0.08, right=0.82, left=0.3)
    return fig, ax, np.arange(rows)


def _panels(count: int, max_cols: int, panel: tuple[float, float], extra_h: float,
            legend_h: float, bottom: float, **spacing):
    """A figure of ``count`` gridded panels, up to ``max_cols`` a row, each ``panel`` inches, with
    ``extra_h`` inches for the title and ``legend_h`` for the legend at the foot; the unused panels
    of the last row are switched off. Returns the figure and the panels in use."""
    cols = min(max_cols, count)
    rows = int(np.ceil(count / cols))
    height = panel[1] * rows + extra_h
    # At least MIN_WIDTH wide: one narrow panel would clip its title and the caption.
    fig, axes = plt.subplots(rows, cols, figsize=(max(panel[0] * cols, MIN_WIDTH), height), squeeze=False)
    fig.subplots_adjust(bottom=legend_h / height + bottom, **spacing)
    for ax in list(axes.flat)[count:]:
        ax.axis("off")
    for ax in list(axes.flat)[:count]:
        ax.grid(alpha=0.3)
    return fig, list(axes.flat)[:count]


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
    _grid_and_legend(ax, 8, axis="x")
    return save_captioned(fig, folder / "baseline.png", caption)


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
            text = interval_text(r["margin_vs_baseline"], r["margin_low"], r["margin_high"])
            ax.annotate(text if r["gain_is_real"] else f"{text}: noise", (r["goodput"], yi - 0.2),
                        xytext=(6, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, best["label"], fontsize=8)
    ax.set_xlabel("goodput (requests/s meeting every SLO)")
    ax.set_title("Best configuration found this period vs the baseline", fontsize=10)
    _grid_and_legend(ax, 8, axis="x")
    return save_captioned(fig, folder / "best.png", caption)


def figure_sweeps(points: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Per swept flag: goodput relative to each sweep's best, median over the period's sweeps."""
    sweeps = points[points["step"] == "sweep"].copy()
    sweeps["param"] = sweeps["params"].map(lambda p: p[0] if p else None)
    sweeps = sweeps.dropna(subset=["param"])
    params = sorted(sweeps["param"].unique())[:6]
    if not params:
        return None
    fig, axes = _panels(len(params), 3, (4.4, 3.3), 0.9, 0.55, 0.12, hspace=0.55, wspace=0.3, top=0.9)
    for ax, param in zip(axes, params):
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
        ax.set_ylabel("goodput / sweep's best", fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7,
               bbox_to_anchor=(0.5, 0.3 / fig.get_figheight()), frameon=False)
    fig.suptitle("Single-flag sweeps of the period (median over repeated sweeps)", fontsize=11)
    return save_captioned(fig, folder / "sweeps.png", caption)


def figure_combos(points: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Combinations: throughput vs TTFT p99 per scenario and GPU, the Pareto front drawn."""
    combos = points[points["step"].isin(("combo", "tune"))]
    labels = sorted(combos["label"].unique())[:8]
    if not labels:
        return None
    fig, axes = _panels(len(labels), 4, (3.6, 3.2), 0.8, 0.5, 0.1, hspace=0.6, wspace=0.35, top=0.88)
    for ax, label in zip(axes, labels):
        group = combos[combos["label"] == label]
        x, y = group["output_throughput"].to_numpy(), group["ttft_p99"].to_numpy() * 1000
        ok = group["meets_slo"].to_numpy()
        ax.scatter(x[~ok], y[~ok], s=10, color="#ccc", label="misses SLO")
        ax.scatter(x[ok], y[ok], s=10, color="tab:blue", label="meets SLO")
        front = pareto_front(group, "ttft_p99")
        ax.plot(front["output_throughput"], front["ttft_p99"] * 1000, "-", color="tab:red", lw=1,
                label="Pareto front")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("output tokens/s", fontsize=7)
        ax.set_ylabel("TTFT p99 (ms)", fontsize=7)
        ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", fontsize=7, ncol=3, frameon=False)
    fig.suptitle("Combinations: throughput against TTFT p99", fontsize=11, x=0.3)
    return save_captioned(fig, folder / "combos.png", caption)


def figure_stress(points: pd.DataFrame, stress: pd.DataFrame, folder: Path,
                  caption: str) -> Path | None:
    """Stress: TTFT p99 against offered load, the latest test per scenario and GPU, knee marked."""
    if stress.empty:
        return None
    latest = stress.groupby("label").tail(1)
    fig, ax = _axes(4.6, bottom=0.33)
    for _, s in latest.iterrows():
        group = points[points["experiment_id"] == s["experiment_id"]].copy()
        group["level"] = group["point"].map(lambda p: p.get("load.shape.level", np.nan))
        group = group.sort_values("level")
        line, = ax.plot(group["level"], group["ttft_p99"] * 1000, "o-", ms=3, label=s["label"])
        if s["max_sustainable"] is not None and np.isfinite(s["max_sustainable"]):
            ax.axvline(s["max_sustainable"], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("TTFT p99 (ms)")
    ax.set_title("Stress tests: latency against load (dotted: the maximum sustainable load, as "
                 "each stress report reads it)", fontsize=10)
    _grid_and_legend(ax, 7, which="both")
    return save_captioned(fig, folder / "stress.png", caption)


def figure_watch(runs: pd.DataFrame, folder: Path, caption: str) -> Path | None:
    """Regression watch: each deployment's probe throughput over the period, regressions marked."""
    watch = ok_runs(runs[runs["step"].isin(["watch", "monitor"])])
    if watch.empty:
        return None
    fig, ax = _axes(4.2, bottom=0.3)
    flagged = watch["summary_json"].map(lambda s: bool(json.loads(s).get("regression", False)))
    for host, group in watch.groupby("host"):
        t = pd.to_datetime(group["started"], unit="s")
        ax.plot(t, group["output_throughput"], "-", lw=1, label=host)
        bad = flagged.loc[group.index]
        ax.plot(t[bad.to_numpy()], group["output_throughput"][bad], "x", color="red", ms=7)
    ax.plot([], [], "x", color="red", label="regression flagged")
    ax.set_ylabel("probe output tokens/s")
    ax.set_title("Regression watch: the probe load on each deployment", fontsize=10)
    _grid_and_legend(ax, 7)
    fig.autofmt_xdate()
    return save_captioned(fig, folder / "watch.png", caption)
