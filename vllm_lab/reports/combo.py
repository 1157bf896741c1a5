"""Reports of step 3 from the store (and, for a search, its Optuna study): combo and tune.

A combination gets heat maps of throughput and goodput over two flags (one panel per value of a
third) and the Pareto front of throughput against the SLO's latency, the best point under the SLO
marked. A search gets its history, the parameters' importances and its best configuration as a
ready scenario file.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from vllm_lab import search
from vllm_lab.analysis.points import (
    RANKED,
    STATISTIC,
    best_point,
    best_rule,
    pareto_front,
    ranked_label,
    within_noise,
)
from vllm_lab.analysis.search import importances, trials_frame, tune_study
from vllm_lab.inputs import read_text
from vllm_lab.reports import page, sweep, traffic
from vllm_lab.reports.figures import save
from vllm_lab.reports.page import Block, Context
from vllm_lab.reports.scenario_files import plain, write_scenario_file
from vllm_lab.store import Store


def _slo_columns(ctx: Context) -> list[tuple[str, float, str]]:
    """(summary column, threshold in s, label) for each SLO latency at its percentile."""
    out = []
    for metric, target in (ctx.slo or {}).items():
        if target and round(target["percentile"]) in (50, 90, 99):
            pct = round(target["percentile"])
            out.append((f"{metric}_p{pct}", target["threshold_ms"] / 1000,
                        f"{metric.upper()} p{pct} (SLO ≤ {target['threshold_ms']:g} ms)"))
    return out or [("e2e_p99", math.inf, "E2E p99")]


def heatmaps(table: pd.DataFrame, params: list[str], ctx: Context, folder: Path,
             figure: str = RANKED) -> Path:
    """Throughput and goodput over the first two params; one row of panels per third-param value;
    the best by the one rule on ``figure`` framed."""
    x, y = params[0], params[1]
    thirds = sorted(table[params[2]].unique(), key=str) if len(params) > 2 else [None]
    best = best_point(table, figure)
    fig, axes = plt.subplots(len(thirds), 2, figsize=(12, 4.6 * len(thirds)), squeeze=False)
    for r, third in enumerate(thirds):
        sub = table if third is None else table[table[params[2]] == third]
        xs, ys = sorted(sub[x].unique(), key=str), sorted(sub[y].unique(), key=str)
        for c, (metric, label) in enumerate((("output_throughput", "output tokens/s"),
                                             ("goodput", "goodput (req/s meeting SLO)"))):
            ax = axes[r][c]
            grid = np.full((len(ys), len(xs)), np.nan)
            for _, row in sub.iterrows():
                grid[ys.index(row[y]), xs.index(row[x])] = row[metric]
            im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
            fig.colorbar(im, ax=ax, label=label)
            for _, row in sub.iterrows():
                i, j = ys.index(row[y]), xs.index(row[x])
                text = f"{row[metric]:.3g}" if row["ok_runs"] else row["status"][:10]
                color = "red" if not row["ok_runs"] else ("white" if not row["meets_slo"] else "black")
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color=color,
                        fontweight="bold" if row["meets_slo"] else "normal")
                if best is not None and row.name == best.name:
                    ax.add_patch(plt.Rectangle((j - .5, i - .5), 1, 1, fill=False, ec="red", lw=2.5))
            ax.set_xticks(range(len(xs)), [str(v) for v in xs])
            ax.set_yticks(range(len(ys)), [str(v) for v in ys])
            ax.set_xlabel(x)
            ax.set_ylabel(y)
            where = "" if third is None else f" at {params[2]}={third}"
            ax.set_title(f"{label}{where}", fontsize=10)
    fig.suptitle("Heat maps (bold: meets the SLO; red frame: best under the SLO)", fontsize=11)
    fig.text(0.01, -0.02, ctx.caption, fontsize=7, va="top")
    return save(fig, folder / "heatmaps.png")


def pareto_figure(table: pd.DataFrame, params: list[str], ctx: Context, folder: Path,
                  name: str = "pareto.png", figure: str = RANKED) -> Path:
    """Throughput against each SLO latency; the front drawn, the best point under the SLO (by the
    one rule on ``figure``) starred."""
    cols = _slo_columns(ctx)
    best = best_point(table, figure)
    by = "" if figure == RANKED else f" by {ranked_label(figure)}"
    fig, axes = plt.subplots(1, len(cols), figsize=(6.5 * len(cols), 4.8), squeeze=False)
    for ax, (col, threshold, label) in zip(axes[0], cols):
        ok = table[table["ok_runs"] > 0]
        colors = np.where(ok["meets_slo"], "tab:green", "tab:gray")
        ax.scatter(ok[col] * 1000, ok["output_throughput"], c=colors, s=30, alpha=0.8)
        front = pareto_front(ok, col)
        ax.plot(front[col] * 1000, front["output_throughput"], "-", color="tab:blue", lw=1.5,
                label="Pareto front")
        for _, row in front.iterrows():
            ax.annotate(", ".join(f"{row[p]}" for p in params), (row[col] * 1000, row["output_throughput"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
        if math.isfinite(threshold):
            ax.axvline(threshold * 1000, color="red", ls="--", label="SLO threshold")
        if best is not None:
            ax.scatter([best[col] * 1000], [best["output_throughput"]], marker="*", s=300,
                       color="gold", edgecolor="black", zorder=5,
                       label=f"best under SLO{by}: " + ", ".join(f"{p}={best[p]}" for p in params))
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Throughput vs the SLO's latency (green: meets the SLO)", fontsize=11)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    return save(fig, folder / name)


def _best_file(runs: pd.DataFrame, params: list[str], best: pd.Series | None, folder: Path,
               note: str) -> Path | None:
    """Write best.yaml: the scenario as it ran with the best values, ready to run again."""
    if best is None:
        return None
    return write_scenario_file(folder / "best.yaml", json.loads(runs.iloc[0]["scenario_json"]),
                               {p: best[p] for p in params}, note)


def _best_note(source: str, best: pd.Series | None, params: list[str], figure: str = RANKED) -> str:
    """best.yaml's description: which point, by which rule, with its figures."""
    if best is None:
        return ""
    value = ", ".join(f"{p}={best[p]}" for p in params)
    return (f"best of {source} by the lab's rule (the cheapest within noise of the top "
            f"{ranked_label(figure)} among the points meeting the SLO): {value}; "
            f"{sweep.ranked_lead(best, figure)}goodput "
            f"{best['goodput']:.2f} req/s, {best['output_throughput']:.0f} output tok/s (mean of "
            f"{best['ok_runs']} run(s))")


# The figures summary.json gives of the best point (means over its ok runs).
BEST_FIGURES = ("goodput", "output_throughput", "output_tokens_per_joule", "ttft_p99", "tpot_p99")


def _best_summary(exp: dict, table: pd.DataFrame, best: pd.Series | None, params: list[str],
                  figure: str, headline: str, folder: Path) -> Path:
    """summary.json: the best as the page, best.yaml and the console name it, the figure and
    the rule that named it, and the other points within noise of it."""
    def point(row: pd.Series) -> dict:
        return {p: plain(row[p]) for p in params}

    def number(v) -> float | None:
        return None if v is None or not np.isfinite(v) else round(float(v), 6)

    summary = {
        "experiment": exp["id"], "step": exp["step"], "objective": exp["meta"].get("objective"),
        "ranked_by": figure, "rule": best_rule(figure), "statistic": STATISTIC,
        "best": None if best is None else point(best),
        "best_figures": None if best is None else
        {m: number(best.get(m)) for m in BEST_FIGURES} | {"ok_runs": int(best["ok_runs"])},
        "within_noise": [point(table.loc[i]) for i in within_noise(table, best, figure)
                         if best is None or i != best.name],
        "headline": headline,
    }
    path = folder / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path


def _yaml_section(path: Path | None) -> list[Block]:
    """best.yaml shown on the page, ready to copy."""
    if path is None:
        return []
    text = read_text(path, what="best configuration")
    return [Block(f"<h2>Best configuration: {path.name}</h2><pre>{html.escape(text)}</pre>",
                  ["", f"## Best configuration: {path.name}", "", f"```yaml\n{text}```"])]


def build_combo(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """The combination's report: table, heat maps, Pareto front, best point and best.yaml."""
    params = list(exp["meta"]["params"])
    ctx = page.context(runs, swept=params)
    table = sweep.points(runs, exp, ctx)
    table.to_csv(folder / "summary.csv", index=False)
    figure = sweep.ranked_by(exp)
    grid = table[~table["reference"]] if _outside_grid(table, exp) else table
    figures = [heatmaps(grid, params, ctx, folder, figure),
               pareto_figure(table, params, ctx, folder, figure=figure)]
    best = best_point(table, figure)
    headline = sweep.headline(table, best, params, ctx, figure)
    best_path = _best_file(runs, params, best, folder, _best_note(exp["id"], best, params, figure))
    _best_summary(exp, table, best, params, figure, headline, folder)
    shown = sweep.display_table(table, params, figure)
    notes = sweep.warnings(table) + sweep.point_notes(table, params, ctx)
    return page.write_page(sweep.experiment_page(exp, ctx, headline, shown, notes, figures,
                                                 _yaml_section(best_path),
                                                 sweep.column_groups(shown, params),
                                                 rule=best_rule(figure),
                                                 tables=sweep.tables(table, params), runs=runs), folder)


def _outside_grid(table: pd.DataFrame, exp: dict) -> bool:
    """Whether the reference point (vLLM's defaults) was measured beside the grid, not in it."""
    grid = exp["meta"].get("grid") or {}
    if "reference" not in table or not table["reference"].any() or not grid:
        return False
    ref = table[table["reference"]].iloc[0]
    return any(ref[p] not in values for p, values in grid.items())


# -- the search -----------------------------------------------------------------------------------


def history_figure(trials: pd.DataFrame, objective: str, ctx: Context, folder: Path) -> Path:
    """Objective per trial, the best so far, and pruned/failed trials marked with their cause."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    done = trials[trials["state"] == "COMPLETE"]
    feasible = done["slo_violation"].fillna(1) <= 0
    ax.scatter(done["trial"], done["value"], c=np.where(feasible, "tab:green", "tab:gray"), s=25,
               label="trial (green: meets the SLO)")
    if objective != "pareto" and len(done):
        valid = done["value"].where(feasible | (objective == "goodput"))
        ax.step(done["trial"], valid.cummax().ffill(), where="post", color="tab:blue", label="best so far")
    for _, row in trials[trials["state"].isin(["PRUNED", "FAIL"])].iterrows():
        ax.axvline(row["trial"], color="red", alpha=0.3)
        ax.annotate(row["cause"] or row["state"].lower(), (row["trial"], 0.02),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize=7, color="red")
    ax.set_xlabel("trial")
    ax.set_ylabel(search.objective_label(objective if objective != "pareto" else "throughput"))
    ax.set_title(f"Search history ({len(trials)} trials)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, -0.04, ctx.caption, fontsize=7, va="top")
    return save(fig, folder / "history.png")


def importance_figure(imp: dict[str, float], ctx: Context, folder: Path) -> Path | None:
    """The parameters' importances (``analysis.search.importances``) as bars; None without any."""
    if not imp:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(imp)))
    names = list(imp)[::-1]
    ax.barh(names, [imp[n] for n in names], color="tab:blue")
    ax.set_xlabel("importance: how far the flag's values in the best 10% of trials lie from all "
                  "(PED-ANOVA, sums to 1 over every flag;\na flag with no measurable effect has no bar)",
                  fontsize=8)
    ax.set_title("Parameter importances", fontsize=10)
    # Half an inch under the axes, below the x label, however few bars make the figure short.
    fig.text(0.01, -0.5 / fig.get_figheight(), ctx.caption, fontsize=7, va="top")
    return save(fig, folder / "importances.png")


def build_tune(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """The search's report: trials, history, importances, Pareto, best configuration as best.yaml."""
    meta = exp["meta"]
    if meta.get("confirms"):
        return build_combo(store, exp, runs, folder)  # a confirmation is a small combination
    params = list(meta["params"])
    ctx = page.context(runs, swept=params)
    study = tune_study(exp, store.path)
    trials = trials_frame(study)
    trials.to_csv(folder / "trials.csv", index=False)
    table = sweep.points(runs, exp, ctx)
    table.to_csv(folder / "summary.csv", index=False)
    figures = [history_figure(trials, meta["objective"], ctx, folder)]
    imp = importances(study)
    imp_path = importance_figure(imp.values, ctx, folder)
    figures += [imp_path] if imp_path else []
    # The one rule (analysis.points.best_point) names the best, as on every step's page, on the
    # figure the objective maximizes: the star, the headline, best.yaml, summary.json and the
    # console are the same point.
    figure = sweep.ranked_by(exp)
    figures.append(pareto_figure(table, params, ctx, folder, figure=figure))
    figures += [f for f in [traffic.trace_figure(runs, folder, ctx.caption)] if f]
    best = best_point(table, figure)
    headline = _tune_headline(trials, table, best, params, meta["objective"], ctx)
    best_path = _best_file(runs, params, best, folder,
                           _best_note(f"study {meta['study']}", best, params, figure))
    _best_summary(exp, table, best, params, figure, headline, folder)
    notes = imp.lines()
    notes += [f"trial {r.trial}: {r.state.lower()} ({r.cause}): {r.error}" for r in
              trials[trials["state"].isin(["PRUNED", "FAIL"])].itertuples()]
    notes += sweep.point_notes(table, params, ctx)
    notes.append(f"study {meta['study']} in {meta['storage'] or 'the lab database'}; more workers join "
                 f"with make tune EXPERIMENT={exp['id']}")
    extra = _yaml_section(best_path) + _confirm_section(store, exp["id"])
    shown = sweep.display_table(table, params, figure)
    return page.write_page(sweep.experiment_page(exp, ctx, headline, shown, notes, figures, extra,
                                                 sweep.column_groups(shown, params),
                                                 rule=best_rule(figure),
                                                 tables=sweep.tables(table, params), runs=runs), folder)


def _tune_headline(trials: pd.DataFrame, table: pd.DataFrame, best: pd.Series | None,
                   params: list[str], objective: str, ctx: Context) -> str:
    states = trials["state"].value_counts().to_dict()
    head = (f"{len(trials)} trials ({', '.join(f'{v} {k.lower()}' for k, v in states.items())}), "
            f"objective {search.objective_label(objective)}. ")
    figure = search.RANKED_BY[objective]
    return head + (sweep.headline(table, best, params, ctx, figure) if best is not None else
                   "No trial met the SLO.")


def tune_headline(store: Store, exp: dict, runs: pd.DataFrame) -> str:
    """A search's headline, as its page has it."""
    params = list(exp["meta"]["params"])
    ctx = page.context(runs, swept=params)
    table = sweep.points(runs, exp, ctx)
    trials = trials_frame(tune_study(exp, store.path))
    return _tune_headline(trials, table, best_point(table, sweep.ranked_by(exp)), params,
                          exp["meta"]["objective"], ctx)


def _confirm_section(store: Store, exp_id: str) -> list[Block]:
    """A pointer to the live confirmation of a pre-screen, when there is one (on the HTML page)."""
    exps = store.experiments()
    confirm = exps[exps["id"] == f"{exp_id}-confirm"]
    if confirm.empty:
        return []
    return [Block(f"<h2>Confirmed on a live backend</h2><p>See <a href=\"../{html.escape(exp_id)}-confirm/"
                  f"index.html\">{html.escape(exp_id)}-confirm</a>.</p>")]
