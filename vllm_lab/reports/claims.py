"""The claims report: each guide claim, its experiment, the measured effect and a verdict.

The verdicts come from ``analysis.claims`` (the store only); for real vLLM the twin's verdicts from
its recorded predictions stand beside them, so the table shows where the twin and the hardware
disagree, and a store from before predictions were recorded says so instead.
"""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from vllm_lab import claims
from vllm_lab.analysis.claims import Judged, judge_experiment
from vllm_lab.analysis.points import TWIN_METRICS
from vllm_lab.claim_evidence import OK_STATUSES
from vllm_lab.reports import host_time, page
from vllm_lab.reports.figures import save
from vllm_lab.reports.page import Block
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store
from vllm_lab.summary import metric, select

# The figures of an arm's row (means over its ok runs): the catalog's heading and display scale.
ARM_METRICS = {name: (metric(name).heading if metric(name).short else
                      f"{metric(name).label}{' ms' if metric(name).unit == 's' else ''}",
                      metric(name).scale) for name in select(
    "output_throughput", "ttft_p50", "tpot_p50", "e2e_p50", "gpu_util_mean", "kv_cache_tokens",
    "preemptions", "errors")}


def _mean(runs: list[dict], key: str, scale: float) -> float | None:
    ok = [r for r in runs if r["status"] in OK_STATUSES]
    vals = [v for r in ok if (v := r["summary"].figure(key)) is not None]
    return float(pd.Series(vals).mean()) * scale if vals else None


def arm_table(measured: dict[str, list[dict]], predicted: dict[str, list[dict]] | None = None,
              same: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per arm: runs, statuses, the mean of each figure over its ok runs (and the twin's
    prediction); an arm that other claims' arms share (the same scenario) names them too."""
    rows = []
    same = same or {}
    for label, rs in sorted(measured.items()):
        also = sorted(a for a, k in same.items() if k == same.get(label) and a != label
                      and a not in measured)
        row = {"arm": label + (f" (also {'; '.join(also)})" if also else ""), "runs": len(rs),
               "status": ",".join(sorted({r["status"] for r in rs}))}
        for key, (name, scale) in ARM_METRICS.items():
            row[name] = _mean(rs, key, scale)
        if predicted is not None:
            for key in TWIN_METRICS:
                name, scale = ARM_METRICS[key]
                row[f"twin {name}"] = _mean(predicted.get(label, []), key, scale)
        rows.append(row)
    return pd.DataFrame(rows)


def effects_figure(verdicts: list[claims.Verdict], twin: list[claims.Verdict] | None, caption: str,
                   folder: Path) -> Path | None:
    """Measured against claimed relative changes, one bar pair per part that states a number."""
    parts = [(v.claim.number, p) for v in verdicts for p in v.parts if p.measured is not None]
    if not parts:
        return None
    twin_parts = {(v.claim.number, p.statement): p for v in (twin or []) for p in v.parts}
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(parts) + 1.8))
    y = range(len(parts))
    ax.barh([i + 0.27 for i in y], [p.measured * 100 for _, p in parts], 0.27, label="measured", color="#1f77b4")
    ax.barh(list(y), [(p.claimed or 0) * 100 for _, p in parts], 0.27, label="the guide claims", color="#bbbbbb")
    if twin:
        tw = [twin_parts.get((n, p.statement)) for n, p in parts]
        ax.barh([i - 0.27 for i in y], [(t.measured or 0) * 100 if t else 0 for t in tw], 0.27,
                label="twin predicts", color="#ff7f0e")
    ax.set_yticks(list(y), [f"{n}: {p.statement[:60]}" for n, p in parts], fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("change against vLLM's defaults (%)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("The guide's claims: measured effect against claimed\n" + caption, fontsize=9)
    return save(fig, folder / "effects.png")


def verdicts(store: Store, exp: dict, runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The verdicts table and its one line ("Verdicts: holds 2, ..."), as the page has them."""
    table = verdicts_frame(judge_experiment(store, exp, runs, page.context(runs).backend))
    return table, verdict_line(table)


def verdict_line(table: pd.DataFrame) -> str:
    """How many claims got each verdict."""
    counts = table["verdict"].value_counts().to_dict()
    return "Verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items())


def build_claims(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """Write the claims report folder (index.html, report.md, verdicts.csv, arms.csv)."""
    ctx = page.context(runs)
    duration = Scenario.model_validate(exp["meta"]["base"]).load.stop.duration_s
    ctx.workload, ctx.load = "a traffic per claim (the arms table names each)", f"{duration:g} s per run"
    judged = judge_experiment(store, exp, runs, ctx.backend)
    table = verdicts_frame(judged)
    table.to_csv(folder / "verdicts.csv", index=False)
    base = Scenario.model_validate(exp["meta"]["base"])
    arms = arm_table(judged.measured, judged.predicted, claims.arm_keys(base))
    arms.to_csv(folder / "arms.csv", index=False)
    fig = effects_figure(judged.verdicts, judged.twin, ctx.caption, folder)
    return page.write_page(claims_page(exp, ctx, table, arms, fig, judged.unpredicted, runs), folder)


def verdicts_frame(judged: Judged) -> pd.DataFrame:
    """One row per claim: statement, experiment, the evidence of its parts, the verdict (and the
    twin's, on real vLLM)."""
    rows = []
    twin_by = {v.claim.number: v for v in judged.twin or []}
    for v in judged.verdicts:
        evidence = " · ".join(f"{p.statement}: {p.verdict} — {p.evidence}" for p in v.parts)
        if v.claim.number in judged.notes:
            evidence = f"({judged.notes[v.claim.number]}) {evidence}"
        row = {"claim": v.claim.number, "statement": v.claim.statement, "experiment": v.claim.method,
               "measured": evidence, "verdict": v.verdict}
        if judged.twin is not None:
            row["twin predicts"] = twin_by[v.claim.number].verdict if v.claim.number in twin_by else ""
        rows.append(row)
    return pd.DataFrame(rows)


def unmeasured_claims(exp: dict, table: pd.DataFrame) -> list[int]:
    """The claims the experiment's plan selected (its CLAIMS=) that have no verdict yet: a claims
    experiment cut short shows what is still to come, not only what it has."""
    made_by = exp.get("meta", {}).get("made_by")
    if made_by is None:
        return []  # made before plans were recorded: what it selected is not known
    judged = set(table["claim"]) if len(table) else set()
    selection = (made_by.get("options", {}).get("--claims") or [""])[-1]  # none given: all nine
    return [n for n in claims.parse_selection(selection) if n not in judged]


def claims_page(exp, ctx, table: pd.DataFrame, arms: pd.DataFrame, fig: Path | None,
                unpredicted: int, runs: pd.DataFrame) -> page.Page:
    """The claims page: the verdicts, the effects figure, the arms, where the hosts' time went."""
    e = html.escape
    line = verdict_line(table)
    blocks = [
        Block(f"<h1>{e(exp['id'])}: the guide's claims, measured</h1>\n",
              [f"# {exp['id']}: the guide's claims, measured", ""]),
        Block(f'<p class="ctx">{e(ctx.caption)}</p>\n', ["```", ctx.caption, "```", "", line, ""]),
    ]
    if waiting := unmeasured_claims(exp, table):
        text = (f"Planned and not measured yet: claim{'s' if len(waiting) > 1 else ''} "
                f"{', '.join(map(str, waiting))} (RESUME=1 EXPERIMENT={exp['id']} takes them).")
        blocks.append(Block(f"<p>{e(text)}</p>\n", [text, ""]))
    if unpredicted:
        text = (f"Twin predictions: no prediction recorded for {unpredicted} arm(s) (measured before "
                f"the lab recorded the twin's prediction with each run on real vLLM).")
        blocks.append(Block(f"<p>{e(text)}</p>\n", [text, ""]))
    blocks += [
        page.table(table, "text"),
        Block(page.img(fig) + "\n" if fig else "\n"),
        Block("<h2>Arms (means over their ok runs)</h2>\n", ["", "## Arms (means over their ok runs)", ""]),
        page.table(arms, groups=["arm" if c in ("arm", "runs", "status") else
                                 "twin predicts (recorded)" if c.startswith("twin ") else
                                 "measured (mean over ok runs)" for c in arms.columns]),
    ]
    if fig:
        blocks.append(Block(md=["", *page.md_img(fig)]))
    blocks += [Block(md=[""]), *host_time.section(exp, runs),
               page.footer(f"make report EXPERIMENT={exp['id']}", md=True)]
    return page.Page(exp["id"], blocks, CSS)


# Wider than a laptop's window: the padding keeps the text off its edges there.
CSS = """body{font-family:system-ui,sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}
td.num{text-align:right;white-space:nowrap}
th{background:#f3f3f3}img{max-width:100%}.ctx{color:#555;white-space:pre-line}"""
