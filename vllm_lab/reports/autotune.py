"""The autotune report from the store: vLLM's defaults against the best, the predicted capacity
beside every measured one, the minutes spent, and the winner as a ready scenario file.

Under ``OUT/<experiment>/``: ``report.md`` and ``index.html``, ``best.yaml`` and ``summary.json``
(what ``make autotune`` ends with). Each candidate's staircase is a stress experiment of its own,
``<experiment>-<candidate>``, with its own report.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd

from vllm_lab import search
from vllm_lab.analysis.autotune import Outcome, Row, outcome
from vllm_lab.autotune.space import MEASURE_ONLY
from vllm_lab.store import Store, experiment_dir


def build(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """The builder of ``reports.BUILDERS``: the report's folder, returning its index.html."""
    build_report(store.path, exp["id"], folder.parent, search.storage_url(None, store.path))
    return folder / "index.html"


def build_report(store_path: Path, experiment_id: str, out: Path, storage: str) -> dict[str, Any]:
    """report.md, index.html, best.yaml and summary.json under OUT/<experiment>/; the summary."""
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
    md = report_markdown(summary, found)
    (folder / "report.md").write_text(md)
    (folder / "index.html").write_text(markdown_page(md, f"autotune {experiment_id}"))
    return summary


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
    }


def _candidate_summary(row: Row) -> dict[str, Any]:
    c = row.candidate
    out = {"name": c.name, "flags": c.flags, "predicted": c.predicted, "measured": row.measured,
           "centre": c.centre, "bound": row.found.bound, "status": row.found.status}
    return out | ({"measure": c.measure, "base": c.base} if c.measure else {})


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


def report_markdown(summary: dict[str, Any], found: Outcome) -> str:
    """The report as Markdown."""
    plan = found.record.plan
    sc = plan.scenario
    slo = ", ".join(f"{m} p{v['percentile']:g} < {v['threshold_ms']:g} ms"
                    for m, v in (sc.get("slo") or {}).items() if isinstance(v, dict))
    budget = summary["gpu_minutes_budget"]
    lines = [
        f"# autotune {summary['experiment']}", "",
        f"**{summary['verdict']}.**", "",
        (f"- scenario: {sc['name']} ({sc['hardware']['name']}, model {sc['serve'].get('model')}, "
         f"vLLM {sc.get('vllm_version')})"),
        f"- traffic: {sc['workload'].get('source')} workload, open-loop Poisson arrivals; SLO: {slo}",
        (f"- SLO capacity: the highest request rate at which every SLO holds and the queue stays "
         f"bounded, on a staircase of {plan.step_s:g} s levels"),
        (f"- measured on: {plan.backend}; predicted by the twin's predictor "
         f"({found.trials} configurations searched in {plan.search_s:g} s, {found.pruned} would not start)"),
        "",
        ("| candidate | flags over vLLM's defaults | predicted (req/s) | measured | "
         "start min | measuring min |"),
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in found.rows:
        mark = " **best**" if r.candidate.name == summary["best"] else ""
        lines.append(f"| {r.candidate.name}{mark} | {_candidate_flags(r)} | {_predicted_text(r)} | "
                     f"{r.found.describe()} | {r.spend.start_s / 60:.2f} | {r.spend.measure_s / 60:.2f} |")
    lines += _minutes_lines(summary, budget, found) + _winner_lines(summary)
    return "\n".join(lines) + "\n"


def _minutes_lines(summary: dict[str, Any], budget: float | None, found: Outcome) -> list[str]:
    """The minutes spent, and the flags searched and left to live measurement."""
    return [
        "",
        f"Minutes of the measuring backend: {summary['gpu_minutes']:.2f} "
        f"({summary['gpu_minutes_starts']:.2f} starting and stopping servers, "
        f"{summary['gpu_minutes_measuring']:.2f} measuring)"
        + (f" of a budget of {budget:g}" if budget is not None else "") + "."
        + (" Candidates marked 'not measured' did not fit the budget: raise GPU_MINUTES and run "
           "again with RESUME=1." if any(r.found.status == "not measured" for r in found.rows) else ""),
        "",
        f"Searched flags (the twin models them): {', '.join(found.record.plan.space)}.",
        "Measure-only flags (the twin does not model them: tried live on real vLLM from the "
        "space's measure: section, or swept with make sweep): "
        + "; ".join(f"{k} ({v})" for k, v in MEASURE_ONLY.items()) + ".",
        "",
    ]


def _winner_lines(summary: dict[str, Any]) -> list[str]:
    """Where the winner's scenario file is, and a word on an fp8 KV cache."""
    lines = []
    if summary["best"] and summary["best"] != "defaults":
        lines.append("The winner as a scenario: `best.yaml` beside this report (make baseline "
                     "SCENARIO=<this folder>/best.yaml; its serve: section is also a vLLM --config file).")
        if summary["best_flags"].get("kv-cache-dtype", "auto") != "auto":
            lines.append("It stores the KV cache in fp8: check the answers' quality before serving it.")
    lines.append(f"Each candidate's staircase is its own stress experiment: make report "
                 f"EXPERIMENT={summary['experiment']}-<candidate>.")
    return lines


def markdown_page(md: str, title: str) -> str:
    """A plain HTML page of the report's Markdown (headings, bold, lists, one table)."""
    body, in_list, in_table = [], False, False
    for raw in md.splitlines():
        line = html.escape(raw)
        line = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", line)
        line = re.sub(r"`(.+?)`", r"<code>\1</code>", line)
        if in_list and not raw.startswith("- "):
            body.append("</ul>")
            in_list = False
        if in_table and not raw.startswith("|"):
            body.append("</table>")
            in_table = False
        if raw.startswith("# "):
            body.append(f"<h1>{line[2:]}</h1>")
        elif raw.startswith("- "):
            body.append(("" if in_list else "<ul>") + f"<li>{line[2:]}</li>")
            in_list = True
        elif raw.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-:"):
                continue
            tag = "td" if in_table else "th"
            body.append(("" if in_table else "<table>") + "<tr>"
                        + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            in_table = True
        elif raw.strip():
            body.append(f"<p>{line}</p>")
    body += ["</ul>"] if in_list else []
    body += ["</table>"] if in_table else []
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}")
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
