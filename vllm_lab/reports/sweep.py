"""The report of a baseline or a sweep (and of any step without its own): a table of points and,
for a sweep, throughput, goodput and latency percentiles against the swept value, with the SLO
lines drawn and the best value under the SLO named."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from vllm_lab import search, stats
from vllm_lab.analysis.points import (
    AUDIT,
    BEST_RULE,
    CV_WARN,
    DETERMINISTIC,
    PRIORITY_CLASSES,
    RANKED,
    SPREAD,
    STATISTIC,
    TWIN_METRICS,
    api_server_hold,
    api_server_sets_ttft,
    best_point,
    point_table,
    ranked_label,
    same_value,
    ttft_band,
    with_effects,
    with_twin_predictions,
    within_noise,
)
from vllm_lab.reports import host_time, page, traffic
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


# The server's view: the catalog's figures per panel and the panel's axis, with its unit.
SERVER_PANELS = ((("queue_len_mean", "queue_len_max"), "requests waiting (count)"),
                 (("kv_usage_mean", "kv_usage_max"), "KV cache usage (% of the cache)"),
                 (("preemptions",), "preemptions per run (count)"))


def sweep_figures(table: pd.DataFrame, param: str, ctx: Context, folder: Path) -> list[Path]:
    """The sweep's three pictures: throughput/goodput, latency percentiles, server view (that one
    with a panel for each figure some run scraped, and none at all where no run scraped any)."""
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
    half = table["output_throughput_ci"].to_numpy(dtype=float)
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

    # A panel only for figures some run scraped: an empty chart says nothing was measured louder
    # than no chart, and reads as zero.
    panels = [(cols, label) for cols, label in SERVER_PANELS
              if any(c in table and table[c].notna().any() for c in cols)]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(max(5.0, 14 * len(panels) / 3), 4.2),
                                 squeeze=False, gridspec_kw={"wspace": 0.35})
        for ax, (cols, label) in zip(axes[0], panels):
            for col in (c for c in cols if c in table and table[c].notna().any()):
                ax.plot(x, table[col] * (100 if metric(col).unit == "share" else 1), "o-",
                        label=metric(col).label)
            axis(ax, label)
            ax.legend(fontsize=7)
        fig.suptitle(f"The server's view vs {param} (scraped from /metrics)", fontsize=11)
        fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
        out.append(save(fig, folder / "server.png"))
    return out


def mean_text(row: pd.Series, m: str, scale: float = 1.0) -> str:
    """A point's mean of ``m`` with half its 95% interval ("1,005 ± 64"; the mean alone for a
    single run), in the figure's shown unit."""
    mean, half = row.get(m), row.get(f"{m}_ci")
    if mean is None or not np.isfinite(mean):
        return "–"
    text = page.fmt(float(mean) * scale)
    return f"{text} ± {page.fmt(float(half) * scale)}" if half is not None and np.isfinite(half) else text


def effect_text(row: pd.Series, m: str) -> str:
    """A point's effect against the reference on ``m``: "+12% (+8% to +16%)", "reference"."""
    if row.get("reference"):
        return "reference"
    rel, low, high = (row.get(f"{m}_effect{s}") for s in ("", "_low", "_high"))
    if rel is None or not np.isfinite(rel):
        return "–"
    if low == high:  # a deterministic backend: the difference is exact
        return f"{rel:+.1%}"
    return f"{rel:+.0%} ({low:+.0%} to {high:+.0%})"


# The main table: what a point gave, against vLLM's defaults, and its verdict.
MAIN = (("output_throughput", "output tok/s", 1.0), ("goodput", "goodput req/s", 1.0),
        ("ttft_p99", "TTFT p99 ms", 1000.0), ("tpot_p99", "TPOT p99 ms", 1000.0),
        ("e2e_p99", "E2E p99 ms", 1000.0))
# The second table: percentiles and the server's own view of each point.
DETAIL = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "e2e_p50", "e2e_p90", "queue_len_mean",
          "kv_usage_max", "preemptions", "gpu_util_mean")


def display_table(table: pd.DataFrame, params: list[str], figure: str = RANKED) -> pd.DataFrame:
    """The main table a reader wants: per point its runs, throughput and goodput (mean ± 95%)
    with their effect against vLLM's defaults, and the figure its best is ranked by where that
    is another (tokens per joule), the SLO's latencies, the verdict."""
    rows = []
    effects = "output_throughput_effect" in table
    ranked = [] if figure in (m for m, _, _ in MAIN) else [(figure, metric(figure).heading, 1.0)]
    for _, row in table.iterrows():
        out = {p: row[p] for p in params}
        out["status"] = row["status"]
        out["ok runs"] = f"{row['ok_runs']} of {row['runs']}"
        for m, heading, scale in [*ranked, *MAIN]:
            out[heading] = mean_text(row, m, scale) if m in SPREAD else \
                page.fmt(row[m] * scale if np.isfinite(row[m]) else np.nan)
            if effects and m in ("output_throughput", "goodput", figure):
                out[f"{heading.split(' ')[0]} vs defaults"] = effect_text(row, m)
        out["meets SLO"] = "yes" if row["meets_slo"] else "no"
        rows.append(out)
    return pd.DataFrame(rows)


def column_groups(shown: pd.DataFrame, params: list[str]) -> list[str]:
    """The group each shown column belongs to, named above the columns on the page."""
    def group(c: str) -> str:
        if c in params or c in ("status", "ok runs"):
            return "point"
        if c.endswith("vs defaults"):
            return "effect against vLLM's defaults (95% interval)"
        if c.endswith(" ms"):
            return "latency (mean of runs)"
        if c == "meets SLO":
            return "verdict"
        return "mean ± 95% interval"
    return [group(str(c)) for c in shown.columns]


def detail_table(table: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """Percentiles, the server's view (/metrics) and, where measured live, the client against the
    server, each headed with its unit (means over a point's ok runs)."""
    out = pd.DataFrame({p: table[p] for p in params})
    for m in DETAIL:
        entry = metric(m)
        scale = 100.0 if entry.unit == "share" else entry.scale
        unit = {"share": "%", "%": "%", "s": "ms"}.get(entry.unit, "")
        out[f"{entry.label} {unit}".strip()] = table[m] * scale
    for m in (*PRIORITY_CLASSES, *AUDIT):
        if m in table and table[m].notna().any():
            entry = metric(m)
            label = f"{entry.label} ms" if entry.unit == "s" else entry.label
            out[label] = table[m] * (1000.0 if entry.unit == "s" else 1.0)
    return out


def twin_table(table: pd.DataFrame, params: list[str]) -> pd.DataFrame | None:
    """The twin's recorded predictions beside the measured figures (real vLLM only)."""
    if "twin_error" not in table:
        return None
    out = pd.DataFrame({p: table[p] for p in params})
    for m in TWIN_METRICS:
        entry = metric(m)
        unit = " ms" if entry.unit == "s" else ""
        out[f"measured {entry.heading}" if entry.heading.endswith(("ms", "tok/s")) else
            f"measured {entry.label}{unit}"] = table[m] * entry.scale
        out[f"twin {entry.label}{unit}"] = table[f"twin_{m}"] * entry.scale
        out[f"twin error {entry.label}"] = [page.fmt(v, "pct") for v in table[f"twin_{m}_error"]]
    out["twin note"] = table["twin_error"]
    return out


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


def point_name(row: pd.Series, params: list[str]) -> str:
    """A point as the pages name it: its values of the flags varied ("max-num-seqs=64")."""
    return ", ".join(f"{p}={row[p]}" for p in params)


def api_server_notes(table: pd.DataFrame, params: list[str]) -> list[str]:
    """Points whose TTFT vLLM's own account puts mostly in its API server, not its engine: there a
    flag of the engine cannot help, and ``--api-server-count`` (more API-server processes) may."""
    notes = []
    for _, row in table.iterrows():
        hold, ttft = api_server_hold(row), row.get("server_ttft_mean")
        if not api_server_sets_ttft(hold, ttft):
            continue
        where = point_name(row, params) or "this configuration"
        cpu = row.get("server_api_cpu")
        busy = f"; its process used {float(cpu):.2f} of a core" if pd.notna(cpu) else ""
        notes.append(
            f"at {where} vLLM's API server held each request {hold * 1e3:,.0f} ms of its "
            f"{float(ttft) * 1e3:,.0f} ms TTFT (vLLM's /metrics: {row['server_queue_mean'] * 1e3:,.0f} ms "
            f"queued, {row['server_prefill_mean'] * 1e3:,.0f} ms from scheduling to first token"
            f"{busy}): the API server, not the engine, sets TTFT there; --api-server-count (more "
            f"API-server processes) is the flag for it")
    return notes


def twin_limit_notes(table: pd.DataFrame, params: list[str], backend: str) -> list[str]:
    """On the twin or its predictor, the points whose API server the twin has busy past
    ``twin.frontend.LIMIT_CPU`` a process: near that limit real vLLM settles at it or at its
    engine's by chance, and the twin's TTFT is least sure of what vLLM would read."""
    from vllm_lab.twin.frontend import LIMIT_CPU

    if backend not in SIMULATED or "server_api_cpu" not in table:
        return []
    near = table[table["server_api_cpu"] >= LIMIT_CPU]
    if near.empty:
        return []

    def said(row: pd.Series) -> str:
        band = row.get("ttft_p50_api_limit")
        return (f"{point_name(row, params) or 'this configuration'} ({row['server_api_cpu']:.2f}"
                + (f"; {ttft_band(row['ttft_p50'], band)}" if pd.notna(band) else "") + ")")

    return [(f"the twin has vLLM's API server busy {LIMIT_CPU:g} of a core or more at "
             f"{'; '.join(said(row) for _, row in near.iterrows())}: near that limit real vLLM "
             f"settles at it or at its engine's by chance, so the TTFT simulated there is the least "
             f"sure (make bench NAME=twin ARGS=fidelity reads the twin's error by that load)")]


def point_notes(table: pd.DataFrame, params: list[str], ctx: Context) -> list[str]:
    """What a page of points (a sweep, a combination, a search) says of single points: where
    vLLM's API server set TTFT, where the twin's is least sure, where no prediction was kept."""
    return (api_server_notes(table, params) + twin_limit_notes(table, params, ctx.backend)
            + prediction_notes(table))


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
                f"{row['ok_runs']} runs: {cv:.1%}" + (" — too large to trust small differences"
                                                       if cv > CV_WARN else "")]
    return []


def _runs_said(row: pd.Series) -> str:
    n = int(row["ok_runs"])
    return "one run" if n == 1 else f"means of {n} runs"


def untaken(exp: dict, table: pd.DataFrame, params: list[str]) -> list[str]:
    """The values a one-flag sweep planned (its meta's ``values``) that have no run yet: an
    experiment a deadline or Ctrl-C stopped, as a headline must say ("max-num-seqs=1024")."""
    values = exp["meta"].get("values") if len(params) == 1 else None
    if not values or params[0] not in table:
        return []
    taken = list(table[params[0]])
    reference = (exp["meta"].get("reference") or {}).get(params[0])
    return [f"{params[0]}={v}" + (" (vLLM's default)" if reference is not None
                                  and same_value(v, reference) else "")
            for v in values if not any(same_value(v, t) for t in taken)]


def headline(table: pd.DataFrame, best, params: list[str], ctx: Context | None = None,
             figure: str = RANKED, planned: list[str] | None = None) -> str:
    """The page's result in a few sentences: the best by the one rule (``best_rule``) on
    ``figure``, its effect against vLLM's defaults, what else is within noise of it, and what was
    measured (where, under which load) and what was not (``planned``: values not taken yet)."""
    if not params:
        row = table.iloc[0]
        if not row["ok_runs"]:
            return f"Baseline: no run held ({row['status']})."
        return (f"Baseline: {mean_text(row, 'output_throughput')} output tokens/s, goodput "
                f"{mean_text(row, 'goodput')} req/s, TTFT p50 {mean_text(row, 'ttft_p50', 1000)} "
                f"ms, TPOT p50 {mean_text(row, 'tpot_p50', 1000)} ms ({_runs_said(row)} ± half "
                f"the 95% interval).")
    if best is None:
        return (f"No value of {', '.join(params)} met every SLO." + _measured(table, params, ctx)
                + _unmeasured(table, params, ctx, planned))
    value = point_name(best, params)
    ranked = "" if figure == RANKED else f" by {ranked_label(figure)}"
    text = (f"Best under the SLO{ranked}: {value} — {ranked_lead(best, figure)}goodput "
            f"{best['goodput']:.2f} req/s, {best['output_throughput']:.0f} output tokens/s, "
            f"TTFT p99 {best['ttft_p99'] * 1000:.0f} ms, TPOT p99 {best['tpot_p99'] * 1000:.1f} ms "
            f"({_runs_said(best)}).")
    if "reference" in table and not best.get("reference"):
        ref = table[table["reference"]].iloc[0]
        against = ("" if figure in ALWAYS_GIVEN
                   else f"{ranked_label(figure)} {effect_text(best, figure)}, ")
        text += (f" Against vLLM's defaults ({point_name(ref, params)}): "
                 f"{against}goodput {effect_text(best, 'goodput')}, output "
                 f"{effect_text(best, 'output_throughput')}.")
    elif "reference" in table:
        text += " It is vLLM's default."
    others = [i for i in within_noise(table, best, figure) if i != best.name]
    if others:
        names = "; ".join(point_name(table.loc[i], params) for i in others)
        exact = table["backend"].iloc[0] in DETERMINISTIC
        single = " (one run each: a single run's spread taken as "\
            f"{stats.SINGLE_RUN_CV:.0%})" if table["ok_runs"].max() <= 1 and not exact else ""
        on = ranked_label(figure)
        close = f"Equal to it on {on}" if exact else f"Within noise of it on {on}{single}"
        text += f" {close}: {names}; the best is the cheapest of them."
    return text + _measured(table, params, ctx) + _unmeasured(table, params, ctx, planned)


# The figures a best's sentence, table row and console line give whatever it was ranked by.
ALWAYS_GIVEN = ("goodput", "output_throughput")


def ranked_lead(row: pd.Series, figure: str) -> str:
    """The ranked figure's value, for a sentence to lead with where it does not give it anyway
    (``ALWAYS_GIVEN``): "8.84 output tokens per joule, "."""
    if figure in ALWAYS_GIVEN:
        return ""
    return f"{page.fmt(row[figure])} {ranked_label(figure)}, "


# Backends that simulate the scenario's GPU rather than measure one, as a sentence names them.
SIMULATED = {"twin": "the twin", "predict": "the twin's predictor"}


def _measured(table: pd.DataFrame, params: list[str], ctx: Context | None) -> str:
    """What the experiment measured, in a sentence: its points and runs, where, under which load."""
    if ctx is None:
        return ""
    what = (f"{len(table)} values of {params[0]}" if len(params) == 1 else
            f"{len(table)} combinations of {', '.join(params)}")
    where = (f"{SIMULATED[ctx.backend]}, a simulated {ctx.hardware}" if ctx.backend in SIMULATED
             else f"{ctx.hardware} with vLLM {ctx.vllm_version}")
    ok, runs = int(table["ok_runs"].sum()), int(table["runs"].sum())
    return f" Measured: {what} ({ok} of {runs} runs ok) on {where}; {ctx.load}."


def _left_out(row: pd.Series, params: list[str]) -> str:
    """A point with runs left out of its figures: the whole point where none was ok, else how many
    of its runs (a point of 4 ok runs in 5 is measured, not left out)."""
    name = point_name(row, params)
    if not row["ok_runs"]:
        return f"{name} ({row['status']})"
    why = ",".join(s for s in str(row["status"]).split(",") if s != "ok")
    return f"{int(row['runs'] - row['ok_runs'])} of {int(row['runs'])} runs at {name} ({why})"


def _unmeasured(table: pd.DataFrame, params: list[str], ctx: Context | None,
                planned: list[str] | None = None) -> str:
    """What the sweep did not measure: values planned and not taken yet, values the load could
    not tell apart, points left out, and a GPU where a simulation stood in for it."""
    parts = []
    if planned:
        parts.append(f"{', '.join(planned)}, planned and not taken yet (RESUME=1 takes "
                     f"{'it' if len(planned) == 1 else 'them'})")
    load = ctx.load if ctx else ""
    if params == ["max-num-seqs"] and load.startswith("closed"):
        users = float(load.split()[3])
        above = [v for v in table["max-num-seqs"] if isinstance(v, (int, float)) and v > users]
        if above:
            parts.append(f"batches of more than {users:g} sequences, which this load ({users:g} "
                         f"closed-loop users) never makes: above {users:g}, max-num-seqs "
                         f"({', '.join(str(v) for v in above)}) changed only what else it sizes "
                         f"here (vLLM captures CUDA graphs of up to twice it, at most 512 tokens)")
    left = table[table["ok_runs"] < table["runs"]]
    if len(left):
        parts.append("left out: " + "; ".join(_left_out(r, params) for _, r in left.iterrows()))
    if ctx is not None and ctx.backend in SIMULATED:
        parts.append("a GPU (BACKEND=vllm measures one)")
    return (" Not measured: " + "; ".join(parts) + ".") if parts else ""


def experiment_page(exp: dict, ctx: Context, head: str, shown: pd.DataFrame, notes: list[str],
                    figures: list[Path], extra: list[Block] = (),
                    groups: list[str] | None = None, rule: str | None = BEST_RULE,
                    tables: list[tuple[str, pd.DataFrame]] = (), *,
                    runs: pd.DataFrame) -> page.Page:
    """An experiment's page: headline, context, table, notes (the statistic its figures are and,
    where it names a best, the ``rule`` that named it), figures, further ``tables``, where the
    hosts' time went (from its ``runs``), then ``extra`` sections."""
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
        page.notes([f"Figures: {STATISTIC}.", *([f"Best: {rule}."] if rule else []),
                    *notes]),
        Block(md=[""]),
        Block("".join(page.img(f) for f in figures) + "\n", [line for f in figures for line in page.md_img(f)]),
        *[b for title, frame in tables for b in (page.heading(title), page.table(frame), Block(md=[""]))],
        *host_time.section(exp, runs),
        page.footer(f"make report EXPERIMENT={exp['id']}"),
        *extra,
    ]
    return page.Page(exp["id"], blocks)


def ranked_by(exp: dict) -> str:
    """The figure the experiment's best is named by: its search objective's
    (``search.RANKED_BY``; a search's confirmation records its study's), else goodput."""
    return search.RANKED_BY.get(exp["meta"].get("objective"), RANKED)


def experiment_params(exp: dict) -> list[str]:
    """The parameters an experiment varies, as its meta names them."""
    meta = exp["meta"]
    return list(meta.get("params") or ([meta["param"]] if meta.get("param") else []))


def points(runs: pd.DataFrame, exp: dict, ctx: Context) -> pd.DataFrame:
    """The experiment's table of points (``analysis.points``), with each point's effect against
    the reference its meta recorded, and the twin's recorded predictions on real vLLM."""
    params = experiment_params(exp)
    table = with_effects(point_table(runs, params), exp["meta"].get("reference"))
    if ctx.backend == "vllm":
        table = with_twin_predictions(table, runs, params)
    return table


def tables(table: pd.DataFrame, params: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """The page's further tables: percentiles and the server's view, the twin's predictions."""
    out = [("Percentiles and the server's view (means over ok runs)", detail_table(table, params))]
    twin = twin_table(table, params)
    return out + ([("The twin's prediction, recorded with each run", twin)] if twin is not None else [])


def build(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """Write a baseline's or a sweep's report folder and return the path of its index.html."""
    params = experiment_params(exp)
    ctx = page.context(runs, swept=params)
    table = points(runs, exp, ctx)
    table.to_csv(folder / "summary.csv", index=False)
    figures = sweep_figures(table, params[0], ctx, folder) if len(params) == 1 and len(table) > 1 else []
    if len(params) == 1 and len(table) > 1:
        figures.append(traffic.energy_figure(table, params[0], folder, ctx.caption))
    figures = [f for f in [*figures, traffic.trace_figure(runs, folder, ctx.caption)] if f]
    best = best_point(table) if params else None
    notes = warnings(table) if params else baseline_notes(table)
    notes += point_notes(table, params, ctx)
    shown = display_table(table, params)
    said = headline(table, best, params, ctx, planned=untaken(exp, table, params))
    return page.write_page(experiment_page(exp, ctx, said, shown,
                                           notes, figures, groups=column_groups(shown, params),
                                           rule=BEST_RULE if params else None,
                                           tables=tables(table, params), runs=runs), folder)
