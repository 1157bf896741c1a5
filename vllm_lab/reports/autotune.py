"""The autotune report from the store: vLLM's defaults against the best, the predicted capacity
beside every measured one, the minutes spent, and the winner as a ready scenario file.

Under ``OUT/<experiment>/``: ``report.md`` and ``index.html``, ``best.yaml`` and ``summary.json``
(what ``make autotune`` ends with). Each candidate's staircase is a stress experiment of its own,
``<experiment>-<candidate>``, with its own report.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from vllm_lab import search
from vllm_lab.analysis.autotune import Outcome, Row, outcome
from vllm_lab.analysis.stress import levels_table, offered_axis
from vllm_lab.autotune.space import MEASURE_ONLY
from vllm_lab.reports import host_time, page
from vllm_lab.reports.figures import save
from vllm_lab.reports.page import Block
from vllm_lab.store import Store, StoreError, experiment_dir


def build(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """The builder of ``reports.BUILDERS``: the report's folder, returning its index.html."""
    build_report(store.path, exp["id"], folder.parent, search.storage_url(None, store.path))
    return folder / "index.html"


def build_report(store_path: Path, experiment_id: str, out: Path, storage: str) -> dict[str, Any]:
    """report.md, index.html (with its figure), best.yaml and summary.json under
    OUT/<experiment>/; the summary."""
    found = outcome(store_path, experiment_id, storage)
    summary = summary_of(found)
    folder = experiment_dir(out, experiment_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    plan, best = found.record.plan, found.best
    if best:
        note = (f"autotune {experiment_id}: {_flags_text(best.candidate.flags)}; SLO capacity "
                f"{best.measured:.2f} req/s on {plan.backend} (defaults {_num(found.defaults.measured)})")
        (folder / "best.yaml").write_text(search.scenario_file(plan.defaults, best.candidate.flags, note))
    with Store(store_path) as store:
        staircases = {r.candidate.name: staircase(store, f"{experiment_id}-{r.candidate.name}")
                      for r in found.rows}
        spent = _host_time(store, experiment_id)
    figure = capacity_figure(found, staircases, _caption(plan), folder)
    page.write_page(autotune_page(summary, found, figure, spent), folder)
    return summary


def _host_time(store: Store, experiment_id: str) -> list[Block]:
    """Where the hosts' time went over the candidates' staircases (``reports.host_time``); none
    for an autotune from before its experiment was recorded."""
    try:
        meta = store.experiment(experiment_id)["meta"]
    except StoreError:
        return []
    return host_time.section({"meta": meta}, store.runs(experiment_id, family=True))


def staircase(store: Store, experiment_id: str) -> pd.DataFrame:
    """A candidate's levels (``analysis.stress.levels_table``; empty when it was not measured)."""
    runs = store.runs(experiment_id)
    return levels_table(store, experiment_id, runs) if len(runs) else pd.DataFrame()


def _caption(plan) -> str:
    sc = plan.scenario
    return (f"{sc['hardware']['name']} · {sc['serve'].get('model')} · vLLM {sc.get('vllm_version')} · "
            f"measured on {plan.backend}, predicted by the twin's predictor\n"
            f"workload: {sc['workload'].get('source')} · load: open-loop Poisson levels of "
            f"{plan.step_s:g} s")


def capacity_figure(found: Outcome, staircases: dict[str, pd.DataFrame], caption: str,
                    folder: Path) -> Path:
    """Each candidate's SLO capacity, measured beside predicted (the best marked), and each
    measured staircase: the SLO's latency against the load offered."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"wspace": 0.3})
    names = [r.candidate.name for r in found.rows]
    y = np.arange(len(names))
    measured = [r.measured or 0.0 for r in found.rows]
    predicted = [r.candidate.predicted or 0.0 for r in found.rows]
    best = found.best.candidate.name if found.best else None
    left.barh(y - 0.2, measured, 0.4, color=["tab:green" if n == best else "tab:blue" for n in names],
              label="measured")
    left.barh(y + 0.2, predicted, 0.4, color="#bbb", label="predicted")
    left.set_yticks(y, [f"{n} (best)" if n == best else n for n in names], fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("SLO capacity (req/s)")
    left.set_title("SLO capacity per candidate", fontsize=10)
    left.legend(fontsize=8, loc="lower right")
    left.grid(alpha=0.3, axis="x")
    target = _slo_column(found.record.plan.scenario)
    for name, table in staircases.items():
        ok = table[table["ok"]] if len(table) else table
        if len(ok) and target and target[0] in ok:
            right.plot(offered_axis(ok), ok[target[0]] * 1000, "o-", ms=3, label=name)
    if target:
        right.axhline(target[1] * 1000, color="red", ls="--", lw=1, label="SLO")
        right.set_ylabel(f"{target[2]} (ms)")
    right.set_xlabel("offered load (req/s)")
    right.set_title("Each candidate's staircase", fontsize=10)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.text(0.01, -0.04, caption, fontsize=7, va="top")
    return save(fig, folder / "capacities.png")


def _slo_column(scenario: dict[str, Any]) -> tuple[str, float, str] | None:
    """The summary column, threshold (s) and label of the scenario's first SLO latency."""
    for name, target in (scenario.get("slo") or {}).items():
        if isinstance(target, dict) and round(target["percentile"]) in (50, 90, 99):
            pct = round(target["percentile"])
            return f"{name}_p{pct}", target["threshold_ms"] / 1000, f"{name.upper()} p{pct}"
    return None


def summary_of(found: Outcome) -> dict[str, Any]:
    """summary.json: the headline figures, every candidate, the verdict."""
    plan, best, dflt, gain = found.record.plan, found.best, found.defaults, found.gain
    start_min, measure_min = found.minutes()
    pred_best = max((r for r in found.rows if r.candidate.predicted is not None),
                    key=lambda r: r.candidate.predicted)
    return {
        "experiment": found.experiment, "backend": plan.backend, "scenario": plan.scenario["name"],
        "defaults_capacity": dflt.measured,
        "best_capacity": best.measured if best else (0.0 if found.any_measured else None),
        "gain": round(gain, 4) if gain is not None else None,
        # Each capacity lies between its last level held and its first broken, so the gain does.
        "gain_interval": _rounded(found.gain_interval),
        "best": best.candidate.name if best else None,
        "best_flags": best.candidate.flags if best else None,
        "predicted_defaults_capacity": dflt.candidate.predicted,
        "predicted_best_capacity": (best or pred_best).candidate.predicted,
        "prediction_error": (round(best.candidate.predicted / best.measured - 1, 4)
                             if best and best.candidate.predicted is not None else None),
        "gpu_minutes": round(start_min + measure_min, 3),
        "gpu_minutes_starts": round(start_min, 3), "gpu_minutes_measuring": round(measure_min, 3),
        "gpu_minutes_budget": found.record.budget,
        "candidates": [_candidate_summary(r) for r in found.rows],
        "verdict": found.verdict(),
        "measure_only_flags": sorted(MEASURE_ONLY),
    } | _host_summary(found, start_min + measure_min) | (
        {"host_scale": plan.host_scale} if plan.host_scale is not None else {}) | (
        _energy_summary(found) if found.objective == "energy" else {})


def _host_summary(found: Outcome, gpu_minutes: float) -> dict[str, Any]:
    """The host's minutes, from the command's start to its last level over every phase, and the
    lab's own share of them (the rest of what the measuring backend counted: provisioning, the
    search, the steps between levels). Empty for a record from before they were kept."""
    host = found.record.host
    if host is None:
        return {}
    wall = host.wall_s / 60
    return {"host_minutes": round(wall, 3), "host_minutes_setup": round(host.setup_s / 60, 3),
            "lab_share": round(max(wall - gpu_minutes, 0.0) / wall, 4) if wall else None}


def _rounded(pair: tuple[float | None, float | None] | None) -> list[float | None] | None:
    return None if pair is None else [None if v is None else round(v, 4) for v in pair]


def _energy_summary(found: Outcome) -> dict[str, Any]:
    """An energy autotune's own figures: output tokens per joule at each SLO capacity."""
    best = found.best
    return {"objective": "energy", "defaults_tokens_per_joule": found.defaults.score,
            "best_tokens_per_joule": best.score if best else None,
            "tokens_per_joule": {r.candidate.name: r.found.tokens_per_joule for r in found.rows}}


def _candidate_summary(row: Row) -> dict[str, Any]:
    c = row.candidate
    out = {"name": c.name, "flags": c.flags, "predicted": c.predicted, "measured": row.measured,
           "interval": list(row.found.interval) if row.measured is not None else None,
           "centre": c.centre, "bound": row.found.bound, "status": row.found.status}
    return out | ({"measure": c.measure, "base": c.base} if c.measure else {}) | (
        {"host_predicted": c.host_predicted} if c.host_predicted is not None else {})


def _flags_text(flags: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in flags.items()) or "(vLLM defaults)"


def _candidate_flags(row: Row) -> str:
    c = row.candidate
    if c.measure is None:
        return _flags_text(c.flags)
    if c.base is None:
        return f"{_flags_text(c.measure)} on the best measured before it (not reached)"
    if c.flags == c.measure:
        return f"{_flags_text(c.measure)} on {c.base}"
    return f"{_flags_text(c.measure)} on {c.base}: {_flags_text(c.flags)}"


def _predicted_text(row: Row) -> str:
    return f"{row.candidate.predicted:.2f}" if row.candidate.predicted is not None else "not modelled"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} req/s"


def autotune_page(summary: dict[str, Any], found: Outcome, figure: Path,
                  spent: list[Block] = ()) -> page.Page:
    """The autotune's page: the verdict, what was measured how, the candidates, the figure, the
    minutes spent and the winner's file, then where the hosts' time went (``spent``)."""
    plan = found.record.plan
    sc = plan.scenario
    slo = ", ".join(f"{m} p{v['percentile']:g} ≤ {v['threshold_ms']:g} ms"
                    for m, v in (sc.get("slo") or {}).items() if isinstance(v, dict))
    facts = [
        (f"scenario: {sc['name']} ({sc['hardware']['name']}, model {sc['serve'].get('model')}, "
         f"vLLM {sc.get('vllm_version')})"),
        f"traffic: {sc['workload'].get('source')} workload, open-loop Poisson arrivals; SLO: {slo}",
        (f"SLO capacity: the highest request rate offered at which every SLO holds, the server "
         f"serves what it is sent (its work in flight stays bounded), on a staircase of "
         f"{plan.step_s:g} s levels (as a stress report reads it)"),
        (f"measured on: {plan.backend}; predicted by the twin's predictor ({found.trials} "
         f"configurations searched in {plan.search_s:g} s, {found.pruned} would not start)"),
        f"Best: {found.rule}.",
    ]
    if found.objective == "energy":
        facts.insert(3, "ranked by: output tokens per joule at each candidate's SLO capacity (the "
                        "GPUs' energy counter on real vLLM, the twin's power model on the twin and "
                        "the predictor), the SLO a constraint")
    e = html.escape
    title = f"autotune {summary['experiment']}"
    blocks = [Block(f"<h1>{e(title)}</h1>\n", [f"# {title}", ""]),
              Block(f'<p class="headline">{e(summary["verdict"])}.</p>\n', [f"**{summary['verdict']}.**", ""]),
              page.notes(facts), Block(md=[""]),
              page.table(candidates_frame(summary, found), "text"), Block(md=[""]),
              Block(page.img(figure) + "\n", page.md_img(figure)),
              page.notes(_host_lines(found) + _minutes_lines(summary, summary["gpu_minutes_budget"], found)
                         + _winner_lines(summary)), Block(md=[""]), *spent,
              page.footer(f"make report EXPERIMENT={summary['experiment']}", md=True)]
    return page.Page(title, blocks)


def candidates_frame(summary: dict[str, Any], found: Outcome) -> pd.DataFrame:
    """One row per candidate: its flags over vLLM's defaults, predicted and measured capacity,
    the minutes it took."""
    rows = []
    on_host = any(r.candidate.host_predicted is not None for r in found.rows)
    for r in found.rows:
        rows.append({"candidate": r.candidate.name + (" (best)" if r.candidate.name == summary["best"] else ""),
                     "flags over vLLM's defaults": _candidate_flags(r),
                     "predicted req/s": _predicted_text(r),
                     **({"predicted on this host": _host_text(r)} if on_host else {}),
                     "measured req/s": r.found.describe(),
                     **({"tok/J at capacity": _per_joule(r.found.tokens_per_joule)}
                        if found.objective == "energy" else {}),
                     "start min": f"{r.spend.start_s / 60:.2f}",
                     "measuring min": f"{r.spend.measure_s / 60:.2f}"})
    return pd.DataFrame(rows)


def _host_text(row: Row) -> str:
    c = row.candidate
    if c.name == "defaults":
        return "(fitted to it)"
    return f"{c.host_predicted:.2f}" if c.host_predicted is not None else "–"


def _host_lines(found: Outcome) -> list[str]:
    """What the defaults said of the host, where it is not the profile's."""
    scale, dflt = found.record.plan.host_scale, found.defaults
    if scale is None or scale == 1.0 or dflt.measured is None or dflt.candidate.predicted is None:
        return []
    return [(f"The host: vLLM's defaults measured {dflt.measured:.2f} req/s where the twin's profile "
            f"predicted {dflt.candidate.predicted:.2f}. The predictor puts them there on a host whose "
            f"CPU takes {scale:g} times the profile's host's time for the engine core's scheduling and "
            f"launches and the API server's work ({'faster' if scale < 1 else 'slower'} than the "
            f"profile's), and each candidate's staircase was centred on its capacity predicted on "
            f"that host (make calibrate FIT=host fits such a host from its own runs).")]


def _per_joule(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _minutes_lines(summary: dict[str, Any], budget: float | None, found: Outcome) -> list[str]:
    """The minutes spent, and the flags searched and left to live measurement."""
    return [
        f"Minutes of the measuring backend: {summary['gpu_minutes']:.2f} "
        f"({summary['gpu_minutes_starts']:.2f} starting and stopping servers, "
        f"{summary['gpu_minutes_measuring']:.2f} measuring)"
        + (f" of a budget of {budget:g}" if budget is not None else "") + "."
        + (" Candidates marked 'not measured' did not fit the budget: raise GPU_MINUTES and run "
           "again with RESUME=1." if any(r.found.status == "not measured" for r in found.rows) else ""),
        *([(f"Minutes of the host, from the command's start to its last level: "
           f"{summary['host_minutes']:.2f}, of which the lab's own {summary['lab_share']:.0%} "
           f"({summary['host_minutes_setup']:.2f} before the first server start: provisioning "
           f"and the search).")] if summary.get("lab_share") is not None else []),
        f"Searched flags (the twin models them): {', '.join(found.record.plan.space)}.",
        "Measure-only flags (the twin does not model them: tried live on real vLLM from the "
        "space's measure: section, or swept with make sweep): "
        + "; ".join(f"{k} ({v})" for k, v in MEASURE_ONLY.items()) + ".",
    ]


def _winner_lines(summary: dict[str, Any]) -> list[str]:
    """Where the winner's scenario file is, and a word on an fp8 KV cache."""
    lines = []
    if summary["best"] and summary["best"] != "defaults":
        lines.append("The winner as a scenario: best.yaml beside this report (make baseline "
                     "SCENARIO=<this folder>/best.yaml; its serve: section is also a vLLM --config file).")
        if summary["best_flags"].get("kv-cache-dtype", "auto") != "auto":
            lines.append("It stores the KV cache in fp8: check the answers' quality before serving it.")
    lines.append(f"Each candidate's staircase is its own stress experiment: make report "
                 f"EXPERIMENT={summary['experiment']}-<candidate>.")
    return lines
