"""Reports from the store alone: index.html (self-contained), report.md, summary.csv and PNGs.

Each step of the method gets its picture: the baseline a table; a sweep throughput, goodput and
latency percentiles against the swept value, with the SLO lines drawn and the best value under the
SLO named. Every figure states the hardware, the model, the vLLM version and the workload.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on lab machines
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from vllm_lab.flags import redact
from vllm_lab.store import LEFT_OUT, Store

CV_WARN = 0.10  # a spread above this is too large to trust a difference of the same size
METRICS = ["output_throughput", "request_throughput", "goodput", "slo_attainment",
           "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
           "itl_p50", "itl_p90", "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99", "queue_len_mean", "queue_len_max",
           "kv_usage_mean", "kv_usage_max", "preemptions", "gpu_util_mean", "errors", "requests"]
# The client beside the server: what vLLM's own /metrics said of the same runs (vllm_lab.audit),
# and how many Locust processes sent the load. Means over every run of a point, limited ones too.
AUDIT = ["loadgen_processes", "server_ttft_mean", "server_tpot_mean", "server_frontend_lag_mean",
         "audit_span_diff"]
LABELS = {"output_throughput": "output tokens/s", "request_throughput": "requests/s",
          "goodput": "goodput (req/s meeting every SLO)", "ttft": "TTFT", "tpot": "TPOT",
          "e2e": "E2E latency", "itl": "ITL"}


@dataclass
class Context:
    """What every figure states: hardware, model, vLLM version, backend, workload."""

    hardware: str
    model: str
    vllm_version: str
    backend: str
    workload: str
    load: str
    slo: dict[str, Any]
    serve: dict[str, Any]

    @property
    def caption(self) -> str:
        backend = {"twin": "twin (simulated)", "predict": "twin predictor (simulated)"}.get(
            self.backend, self.backend)
        return (f"{self.hardware} · {self.model} · vLLM {self.vllm_version} · {backend}\n"
                f"workload: {self.workload} · load: {self.load}")


def _context(runs: pd.DataFrame, swept: list[str] = ()) -> Context:
    # Redacted again: a store written before secrets were redacted on the way in still holds them.
    first = redact(json.loads(runs.iloc[0]["scenario_json"]))
    # The swept flags vary by point: the header names them instead of the first point's value.
    first["serve"] = {k: ("swept" if k in swept else v) for k, v in first["serve"].items()}
    w, ld = first["workload"], first["load"]
    shape = ld["shape"]
    unit = "users" if ld["mode"] == "closed" else "req/s"
    load = (f"{ld['mode']} loop, {shape['kind']} {shape['level']:g} {unit}, "
            f"{ld['stop']['duration_s']:g} s per run")
    return Context(hardware=runs.iloc[0]["gpu_model"], model=str(first["serve"].get("model")),
                   vllm_version=runs.iloc[0]["vllm_version"], backend=runs.iloc[0]["backend"],
                   workload=f"{w['source']} via /v1/{w['api']}", load=load, slo=first.get("slo") or {},
                   serve=first["serve"])


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
        for m in METRICS:
            col = ok[m].astype(float) if m in ok else pd.Series(dtype=float)
            row[m] = col.mean() if col.notna().any() else np.nan
            if m in ("output_throughput", "goodput", "ttft_p50", "tpot_p50"):
                row[f"{m}_cv"] = col.std() / col.mean() if len(col.dropna()) > 1 and col.mean() else np.nan
        row["meets_slo"] = bool(len(ok)) and all(s.get("meets_slo", False) for s in ok["summary"]) \
            if "summary" in ok else False
        for k in AUDIT:
            vals = [s[k] for s in group.get("summary", []) if isinstance(s.get(k), (int, float))]
            row[k] = float(np.mean(vals)) if vals else np.nan
        rows.append(row)
    table = pd.DataFrame(rows)
    if params and len(table):
        try:
            table = table.sort_values(params, kind="stable").reset_index(drop=True)
        except TypeError:
            pass  # mixed types (e.g. strings and numbers): keep the plan's order
    return table


TWIN_METRICS = ("output_throughput", "ttft_p50", "tpot_p50")


def with_twin_predictions(table: pd.DataFrame, runs: pd.DataFrame, params: list[str]) -> pd.DataFrame:
    """Beside each real point, what the twin's predictor says for the same scenario, and the error."""
    from vllm_lab.backends import PredictBackend
    from vllm_lab.scenarios import Scenario

    predicted = []
    for _, row in table.iterrows():
        wanted = {k: row[k] for k in params}
        match = runs[runs["point"].map(lambda p, w=wanted: all(p.get(k) == v for k, v in w.items()))]
        scenario = Scenario.model_validate_json(match.iloc[0]["scenario_json"])
        try:
            m = PredictBackend().measure(scenario, None, Path("."))
            predicted.append({f"twin_{k}": m.summary.get(k, np.nan) for k in TWIN_METRICS})
        except (ValueError, OSError) as e:  # an unknown model shape: no prediction, said so
            predicted.append({f"twin_{k}": np.nan for k in TWIN_METRICS} | {"twin_error": str(e)})
    out = pd.concat([table.reset_index(drop=True), pd.DataFrame(predicted)], axis=1)
    for k in TWIN_METRICS:
        out[f"twin_{k}_error"] = (out[f"twin_{k}"] - out[k]) / out[k]
    return out


def best_point(table: pd.DataFrame) -> pd.Series | None:
    """The point with the highest goodput among those meeting the SLO (throughput breaks ties)."""
    ok = table[table["meets_slo"]]
    if ok.empty:
        return None
    return ok.sort_values(["goodput", "output_throughput"], ascending=False).iloc[0]


def _png(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


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
    out.append(_png(fig, folder / "throughput.png"))

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"wspace": 0.35})
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e")):
        for p, style in (("p50", "o-"), ("p90", "^--"), ("p99", "s:")):
            ax.plot(x, table[f"{metric}_{p}"] * 1000, style, label=p)
        target = (ctx.slo or {}).get(metric)
        if target:
            ax.axhline(target["threshold_ms"], color="red", ls="--",
                       label=f"SLO p{target['percentile']:g} ≤ {target['threshold_ms']:g} ms")
        axis(ax, f"{LABELS[metric]} (ms)")
        ax.set_title(LABELS[metric], fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency percentiles vs {param}", fontsize=11)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    out.append(_png(fig, folder / "latency.png"))

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
    out.append(_png(fig, folder / "server.png"))
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return "–"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _display_table(table: pd.DataFrame, params: list[str]) -> pd.DataFrame:
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


def _warnings(table: pd.DataFrame) -> list[str]:
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


def build(store_path: Path, experiment_id: str, out_root: Path) -> Path:
    """Write the experiment's report folder and return the path of its index.html."""
    store = Store(store_path)
    exp = store.experiment(experiment_id)
    runs = store.runs(experiment_id)
    store.close()
    if exp["step"] in STEP_REPORTS and not runs.empty:
        return _step_report(exp["step"])(store_path, exp, out_root)
    folder = out_root / experiment_id
    folder.mkdir(parents=True, exist_ok=True)
    if runs.empty:
        raise ValueError(f"experiment {experiment_id} has no runs yet")
    params = list(exp["meta"].get("params") or ([exp["meta"]["param"]] if exp["meta"].get("param") else []))
    ctx = _context(runs, swept=params)
    table = point_table(runs, params)
    if ctx.backend == "vllm":
        table = with_twin_predictions(table, runs, params)
    table.to_csv(folder / "summary.csv", index=False)
    figures = sweep_figures(table, params[0], ctx, folder) if len(params) == 1 and len(table) > 1 else []
    best = best_point(table) if params else None
    shown = _display_table(table, params)
    headline = _headline(exp, table, best, params)
    notes = _warnings(table) if params else _baseline_notes(table)
    (folder / "report.md").write_text(_markdown(exp, ctx, headline, shown, notes, figures))
    index = folder / "index.html"
    index.write_text(_html(exp, ctx, headline, shown, notes, figures))
    return index


# Steps 3 and 4 have their own pictures; their modules reuse this one's helpers.
STEP_REPORTS = {"combo": ("report_search", "build_combo"), "tune": ("report_search", "build_tune"),
                "stress": ("report_stress", "build_stress"), "claims": ("report_claims", "build_claims")}


def _step_report(step: str):
    """The report builder of a step with its own module (imported late: it imports this one)."""
    import importlib
    module, func = STEP_REPORTS[step]
    return getattr(importlib.import_module(f"vllm_lab.{module}"), func)


def _baseline_notes(table: pd.DataFrame) -> list[str]:
    row = table.iloc[0]
    cv = row.get("output_throughput_cv")
    if isinstance(cv, float) and not np.isnan(cv):
        return [f"run-to-run spread (coefficient of variation) of output throughput over "
                f"{row['runs']} runs: {cv:.1%}" + (" — too large to trust small differences"
                                                    if cv > CV_WARN else "")]
    return []


def _headline(exp: dict, table: pd.DataFrame, best, params: list[str]) -> str:
    if not params:
        row = table.iloc[0]
        return (f"Baseline: {row['output_throughput']:.0f} output tokens/s, goodput "
                f"{row['goodput']:.2f} req/s, TTFT p50 {row['ttft_p50'] * 1000:.0f} ms, "
                f"TPOT p50 {row['tpot_p50'] * 1000:.1f} ms ({row['runs']} runs).")
    if best is None:
        return f"No value of {', '.join(params)} met every SLO."
    value = ", ".join(f"{p}={best[p]}" for p in params)
    return (f"Best under the SLO: {value} — goodput {best['goodput']:.2f} req/s, "
            f"{best['output_throughput']:.0f} output tokens/s, TTFT p99 "
            f"{best['ttft_p99'] * 1000:.0f} ms, TPOT p99 {best['tpot_p99'] * 1000:.1f} ms.")


def _markdown(exp, ctx, headline, shown, notes, figures) -> str:
    lines = [f"# {exp['id']}", "", f"**{headline}**", "", "```", ctx.caption, "```", "",
             f"Step: {exp['step']} · scenario: {exp['scenario_name']}", "",
             "SLO: " + (", ".join(f"{k} p{v['percentile']:g} ≤ {v['threshold_ms']:g} ms"
                                  for k, v in ctx.slo.items() if v) or "none"), "",
             "Serve flags: " + ", ".join(f"`{k}={v}`" for k, v in ctx.serve.items()), "", ]
    header = "| " + " | ".join(shown.columns) + " |"
    lines += [header, "|" + "---|" * len(shown.columns)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in shown.itertuples(index=False)]
    lines += [""] + [f"- {n}" for n in notes] + [""]
    lines += [f"![{f.stem}]({f.name})" for f in figures]
    return "\n".join(lines) + "\n"


def _html(exp, ctx, headline, shown, notes, figures) -> str:
    def img(path: Path) -> str:
        data = base64.b64encode(path.read_bytes()).decode()
        return f'<figure><img alt="{path.stem}" src="data:image/png;base64,{data}"></figure>'

    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>"
                   for r in shown.itertuples(index=False))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in shown.columns)
    slo = ", ".join(f"{k} p{v['percentile']:g} ≤ {v['threshold_ms']:g} ms" for k, v in ctx.slo.items() if v)
    flags = ", ".join(f"<code>{html.escape(f'{k}={v}')}</code>" for k, v in ctx.serve.items())
    note_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(exp['id'])}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}
th{{background:#f3f3f3}}img{{max-width:100%}}.headline{{font-size:1.2em;background:#eef7ee;padding:.6em}}
.ctx{{color:#555;white-space:pre-line}}</style></head><body>
<h1>{html.escape(exp['id'])}</h1>
<p class="headline">{html.escape(headline)}</p>
<p class="ctx">{html.escape(ctx.caption)}</p>
<p>Step: {html.escape(exp['step'])} · scenario: {html.escape(exp['scenario_name'])} · SLO: {html.escape(slo or 'none')}</p>
<p>Serve flags: {flags}</p>
<table><tr>{head}</tr>{rows}</table>
<ul>{note_html}</ul>
{''.join(img(f) for f in figures)}
<p style="color:#888;font-size:12px">Rebuilt from the store alone: make report EXPERIMENT={html.escape(exp['id'])}</p>
</body></html>"""
