"""The report of a baseline or a sweep (and of any step without its own): a table of points and,
for a sweep, throughput, goodput and latency percentiles against the swept value, with the SLO
lines drawn and the best value under the SLO named."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from vllm_lab import stats
from vllm_lab.analysis.points import (
    AUDIT,
    CV_WARN,
    TWIN_METRICS,
    best_point,
    point_table,
    with_twin_predictions,
    within_noise,
)
from vllm_lab.reports import page, traffic
from vllm_lab.reports.figures import save
from vllm_lab.reports.page import Block, Context
from vllm_lab.store import LEFT_OUT, Store
from vllm_lab.summary import LATENCY_LABELS, metric

# Latency figures by prefix: the panel titles and axis labels.
LABELS = {k: ("E2E latency" if k == "e2e" else v) for k, v in LATENCY_LABELS.items()}
def _x(table: pd.DataFrame, param: str) -> tuple[np.ndarray, list[str], bool]:
    """Positions and tick labels for a parameter: numeric on a log scale when it spans decades."""
    values = table[param].tolist()
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric:
        arr = np.array(values, dtype=float)
        log = arr.min() > 0 and arr.max() / arr.min() >= 16
        return arr, [f"{v:g}" for v in arr], log
    return np.arange(len(values)), [str(v) for v in values], False


def _mark_failures(ax, x, table):
    for xi, (_, row) in zip(x, table.iterrows()):
        if row["ok_runs"] == 0:
            ax.axvline(xi, color="red", alpha=0.25, lw=6)
            ax.annotate(row["status"], (xi, 0.02), xycoords=("data", "axes fraction"),
                        rotation=90, color="red", fontsize=8, ha="center")


def _half_interval(table: pd.DataFrame, m: str) -> np.ndarray:
    """Half the 95% Student-t interval of each point's mean of ``m`` (nan for a single run)."""
    out = []
    for _, row in table.iterrows():
        n, cv = int(row.get("ok_runs", 0) or 0), row.get(f"{m}_cv", np.nan)
        if n < 2 or not np.isfinite(cv):
            out.append(np.nan)
            continue
        out.append(stats.t_quantile(n - 1) * cv * row[m] / np.sqrt(n))
    return np.asarray(out, dtype=float)


def sweep_figures(table: pd.DataFrame, param: str, ctx: Context, folder: Path) -> list[Path]:
    """The sweep's three pictures: throughput/goodput, latency percentiles, server view."""
    x, ticks, log = _x(table, param)
    best = best_point(table)
    out = []

    def axis(ax, ylabel):
        if log:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x, ticks)
        ax.set_xlabel(param)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _mark_failures(ax, x, table)
        if best is not None:
            bx = x[list(table.index).index(best.name)]
            ax.axvline(bx, color="green", ls=":", lw=1.5)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, table["output_throughput"], "o-", label="output tokens/s")
    half = _half_interval(table, "output_throughput")
    if np.isfinite(half).any():  # 95% intervals where a point has repeats
        ax.errorbar(x, table["output_throughput"], yerr=half, fmt="none", ecolor="tab:blue",
                    capsize=3, lw=1)
    axis(ax, "output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(x, table["goodput"], "s--", color="tab:orange", label="goodput (req/s meeting SLO)")
    ax2.plot(x, table["request_throughput"], "^:", color="tab:gray", label="requests/s")
    ax2.set_ylabel("requests/s")
    lines = ax.get_lines()[:1] + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    title = f"Throughput and goodput vs {param}"
    if best is not None:
        title += f" — best under SLO: {param}={best[param]}"
    ax.set_title(title, fontsize=10)
    fig.text(0.01, -0.06, ctx.caption, fontsize=7, va="top")
    out.append(save(fig, folder / "throughput.png"))

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"wspace": 0.35})
    for ax, name in zip(axes, ("ttft", "tpot", "e2e")):
        for p, style in (("p50", "o-"), ("p90", "^--"), ("p99", "s:")):
            ax.plot(x, table[f"{name}_{p}"] * metric(f"{name}_{p}").scale, style, label=p)
        target = (ctx.slo or {}).get(name)
        if target:
            ax.axhline(target["threshold_ms"], color="red", ls="--",
                       label=f"SLO p{target['percentile']:g} ≤ {target['threshold_ms']:g} ms")
        axis(ax, f"{LABELS[name]} (ms)")
        ax.set_title(LABELS[name], fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency percentiles vs {param}", fontsize=11)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    out.append(save(fig, folder / "latency.png"))

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"wspace": 0.35})
    for ax, cols, label in ((axes[0], ("queue_len_mean", "queue_len_max"), "requests waiting"),
                            (axes[1], ("kv_usage_mean", "kv_usage_max"), "KV cache usage (0-1)"),
                            (axes[2], ("preemptions",), "preemptions per run")):
        for col in cols:
            ax.plot(x, table[col], "o-", label=col.replace("_", " "))
        axis(ax, label)
        ax.legend(fontsize=7)
    fig.suptitle(f"The server's view vs {param} (scraped from /metrics)", fontsize=11)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    out.append(save(fig, folder / "server.png"))
    return out


def display_table(table: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """The columns a reader wants, latencies in ms."""
    cols = params + ["status", "runs", "output_throughput", "goodput", "slo_attainment",
                     "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99",
                     "queue_len_mean", "kv_usage_max", "preemptions", "output_throughput_cv", "meets_slo",
                     *AUDIT, *[f"twin_{k}{e}" for k in TWIN_METRICS for e in ("", "_error")]]
    shown = table[[c for c in cols if c in table]].copy()

    def is_latency(c: str) -> bool:
        base = c.removeprefix("twin_").removeprefix("server_")
        return base.split("_")[0] in ("ttft", "tpot", "e2e", "itl", "frontend") \
            and not c.endswith(("cv", "error"))

    for c in shown.columns:
        if is_latency(c):
            shown[c] = shown[c] * 1000
    return shown.rename(columns={c: c + " (ms)" for c in shown.columns if is_latency(c)})


def column_groups(shown: pd.DataFrame, params: list[str]) -> list[str]:
    """The group each shown column belongs to, named above the columns on the page."""
    def group(c: str) -> str:
        if c in params or c in ("status", "runs"):
            return "point"
        if c.startswith("twin_"):
            return "twin prediction (recorded)"
        if c.split(" ")[0] in AUDIT:
            return "client against server"
        if c.startswith(("ttft", "tpot", "e2e", "itl")):
            return "latency (ms)"
        if c in ("queue_len_mean", "kv_usage_max", "preemptions"):
            return "server (/metrics)"
        if c in ("output_throughput_cv", "meets_slo"):
            return "verdict"
        return "throughput"
    return [group(str(c)) for c in shown.columns]


def warnings(table: pd.DataFrame) -> list[str]:
    """A sweep's notes: a spread too large to trust, points that failed or were left out."""
    notes = []
    for _, row in table.iterrows():
        cv = row.get("output_throughput_cv")
        if isinstance(cv, float) and cv > CV_WARN:
            notes.append(f"run-to-run spread of output throughput is {cv:.0%} at "
                         f"{', '.join(f'{k}={row[k]}' for k in table.columns[:1])}: a difference "
                         f"smaller than that is not to be trusted")
        if row["ok_runs"] == 0:
            notes.append(f"{table.columns[0]}={row[table.columns[0]]}: {row['status']} — {row['error']}")
        elif left_out := [s for s in LEFT_OUT if s in str(row["status"])]:
            notes.append(f"{table.columns[0]}={row[table.columns[0]]}: {row['runs'] - row['ok_runs']} "
                         f"{' or '.join(left_out)} run(s) left out of the figures — {row['error']}")
    return notes


def prediction_notes(table: pd.DataFrame) -> list[str]:
    """Points whose runs carry no recorded prediction of the twin: said, never made up now."""
    if "twin_error" not in table:
        return []
    missing = int((table["twin_error"] == "no prediction recorded").sum())
    if not missing:
        return []
    return [(f"twin prediction: no prediction recorded for {missing} of {len(table)} point(s) (runs "
             f"measured before the lab recorded the twin's prediction with each run on real vLLM)")]


def baseline_notes(table: pd.DataFrame) -> list[str]:
    """A baseline's note: the run-to-run spread of its throughput."""
    row = table.iloc[0]
    cv = row.get("output_throughput_cv")
    if isinstance(cv, float) and not np.isnan(cv):
        return [f"run-to-run spread (coefficient of variation) of output throughput over "
                f"{row['runs']} runs: {cv:.1%}" + (" — too large to trust small differences"
                                                    if cv > CV_WARN else "")]
    return []


def headline(table: pd.DataFrame, best, params: list[str]) -> str:
    """The page's one-sentence result."""
    if not params:
        row = table.iloc[0]
        return (f"Baseline: {row['output_throughput']:.0f} output tokens/s, goodput "
                f"{row['goodput']:.2f} req/s, TTFT p50 {row['ttft_p50'] * 1000:.0f} ms, "
                f"TPOT p50 {row['tpot_p50'] * 1000:.1f} ms ({row['runs']} runs).")
    if best is None:
        return f"No value of {', '.join(params)} met every SLO."
    value = ", ".join(f"{p}={best[p]}" for p in params)
    text = (f"Best under the SLO: {value} — goodput {best['goodput']:.2f} req/s, "
            f"{best['output_throughput']:.0f} output tokens/s, TTFT p99 "
            f"{best['ttft_p99'] * 1000:.0f} ms, TPOT p99 {best['tpot_p99'] * 1000:.1f} ms.")
    others = [i for i in within_noise(table, best) if i != best.name]
    if others:
        names = "; ".join(", ".join(f"{p}={table.loc[i, p]}" for p in params) for i in others)
        single = " (one run each: a single run's spread taken as "\
            f"{stats.SINGLE_RUN_CV:.0%})" if table["ok_runs"].max() <= 1 else ""
        text += (f" Within noise of it on goodput{single}: {names}; the best is the cheapest "
                 f"of them.")
    return text


def experiment_page(exp: dict, ctx: Context, head: str, shown: pd.DataFrame, notes: list[str],
                    figures: list[Path], extra: list[Block] = (),
                    groups: list[str] | None = None) -> page.Page:
    """An experiment's page: headline, context, table, notes, figures, then ``extra`` sections."""
    e = html.escape
    step = f"Step: {exp['step']} · scenario: {exp['scenario_name']}"
    slo = ctx.slo_text
    flags = ", ".join(f"<code>{e(f'{k}={v}')}</code>" for k, v in ctx.serve.items())
    blocks = [
        Block(f"<h1>{e(exp['id'])}</h1>\n", [f"# {exp['id']}", ""]),
        Block(f'<p class="headline">{e(head)}</p>\n', [f"**{head}**", ""]),
        Block(f'<p class="ctx">{e(ctx.caption)}</p>\n', ["```", ctx.caption, "```", ""]),
        Block(f"<p>{e(step)} · SLO: {e(slo or 'none')}</p>\n",
              [step, "", "SLO: " + (slo or "none"), ""]),
        Block(f"<p>Serve flags: {flags}</p>\n",
              ["Serve flags: " + ", ".join(f"`{k}={v}`" for k, v in ctx.serve.items()), ""]),
        page.table(shown, groups=groups),
        Block(md=[""]),
        page.notes(notes),
        Block(md=[""]),
        Block("".join(page.img(f) for f in figures) + "\n", [line for f in figures for line in page.md_img(f)]),
        page.footer(f"make report EXPERIMENT={exp['id']}"),
        *extra,
    ]
    return page.Page(exp["id"], blocks)


def build(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """Write a baseline's or a sweep's report folder and return the path of its index.html."""
    params = list(exp["meta"].get("params") or ([exp["meta"]["param"]] if exp["meta"].get("param") else []))
    ctx = page.context(runs, swept=params)
    table = point_table(runs, params)
    if ctx.backend == "vllm":
        table = with_twin_predictions(table, runs, params)
    table.to_csv(folder / "summary.csv", index=False)
    figures = sweep_figures(table, params[0], ctx, folder) if len(params) == 1 and len(table) > 1 else []
    if len(params) == 1 and len(table) > 1:
        figures.append(traffic.energy_figure(table, params[0], folder, ctx.caption))
    figures = [f for f in [*figures, traffic.trace_figure(runs, folder, ctx.caption)] if f]
    best = best_point(table) if params else None
    notes = warnings(table) if params else baseline_notes(table)
    notes += prediction_notes(table)
    shown = display_table(table, params)
    return page.write_page(experiment_page(exp, ctx, headline(table, best, params), shown, notes,
                                           figures, groups=column_groups(shown, params)), folder)
