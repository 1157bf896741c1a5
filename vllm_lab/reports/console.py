"""The lines a command ends with: its table of points (levels, claims) and its headline, from
the same functions its page draws (``reports.sweep``, ``reports.combo``, ``reports.stress``,
``reports.claims``), so the console and the page give the same figure under the same name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vllm_lab.analysis.points import STATISTIC, best_point
from vllm_lab.progress import point_label
from vllm_lab.reports import page, sweep
from vllm_lab.store import Store
from vllm_lab.summary import metric


@dataclass(frozen=True)
class Results:
    """What a command prints last: a table (headed with units, values as the page writes them),
    the label of its best row (None: it names none) and the headline of its page."""

    table: pd.DataFrame
    best: str | None
    headline: str
    statistic: str = ""


def results(store_path: Path, experiment_id: str) -> Results | None:
    """The experiment's closing table and headline, read from the store as its page is."""
    with Store(store_path) as store:
        exp = store.experiment(experiment_id)
        runs = store.runs(experiment_id)
        if runs.empty:
            return None
        if exp["step"] == "stress":
            from vllm_lab.reports import stress
            return _levels(*stress.staircase(store, exp, runs)) if exp["meta"].get("shape") in (
                "ramp", "step") else Results(pd.DataFrame(), None, stress.single(store, exp, runs)[0])
        if exp["step"] == "claims":
            from vllm_lab.reports import claims
            table, headline = claims.verdicts(store, exp, runs)
            return Results(table[["claim", "verdict"]], None, headline)
        if exp["step"] == "tune" and not exp["meta"].get("confirms"):
            from vllm_lab.reports import combo
            return _points(exp, runs, combo.tune_headline(store, exp, runs))
    return _points(exp, runs)


def _points(exp: dict, runs: pd.DataFrame, headline: str | None = None) -> Results:
    params = sweep.experiment_params(exp)
    ctx = page.context(runs, swept=params)
    table = sweep.points(runs, exp, ctx)
    figure = sweep.ranked_by(exp)  # the page's best, by the figure its objective ranks
    best = best_point(table, figure) if params else None
    rows = []
    for _, row in table.iterrows():
        out = {"point": point_label({p: row[p] for p in params}),
               "ok runs": f"{row['ok_runs']} of {row['runs']}"}
        if figure not in sweep.ALWAYS_GIVEN:
            out[metric(figure).heading] = sweep.mean_text(row, figure)
        out["output tok/s"] = sweep.mean_text(row, "output_throughput")
        if "output_throughput_effect" in table:
            out["vs defaults"] = sweep.effect_text(row, "output_throughput")
        out.update({"goodput req/s": sweep.mean_text(row, "goodput"),
                    "TTFT p50 ms": sweep.mean_text(row, "ttft_p50", 1000),
                    "TPOT p50 ms": sweep.mean_text(row, "tpot_p50", 1000),
                    "status": "" if row["status"] == "ok" else str(row["status"])})
        rows.append(out)
    label = None if best is None else point_label({p: best[p] for p in params})
    return Results(pd.DataFrame(rows), label,
                   headline or sweep.headline(table, best, params, ctx, figure,
                                              planned=sweep.untaken(exp, table, params)), STATISTIC)


def _levels(table: pd.DataFrame, knee: dict, headline: str) -> Results:
    from vllm_lab.reports.stress import verdict_text
    rows = [{"level req/s": page.fmt(r["level"]), "offered req/s": page.fmt(r.get("offered")),
             "served req/s": page.fmt(r.get("request_throughput")),
             "TTFT p99 ms": page.fmt(r["ttft_p99"] * 1000 if pd.notna(r.get("ttft_p99")) else None),
             "E2E p99 ms": page.fmt(r["e2e_p99"] * 1000 if pd.notna(r.get("e2e_p99")) else None),
             "verdict": verdict_text(r)} for _, r in table.iterrows()]
    return Results(pd.DataFrame(rows), None, headline)
