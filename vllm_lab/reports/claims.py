"""The claims report: each guide claim, its experiment, the measured effect and a verdict.

Reads the store only. For real vLLM it also judges the twin's predictions of the same arms, as
recorded with each run when it was measured, so the table shows where the twin and the hardware
disagree; a store from before predictions were recorded says so instead. Claim 9 falls back on the newest
tensor-parallel-size sweep in the same store when the claims experiment itself has no TP arms
(a TP sweep needs a machine with several GPUs, usually a separate call).
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from vllm_lab import claims
from vllm_lab.analysis.points import NO_PREDICTION, TWIN_METRICS, recorded_prediction
from vllm_lab.reports import page
from vllm_lab.reports.figures import save
from vllm_lab.reports.page import Block
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store
from vllm_lab.summary import metric, select

# The figures of an arm's row (medians over its runs): the catalog's heading and display scale.
ARM_METRICS = {name: (metric(name).heading, metric(name).scale) for name in select(
    "output_throughput", "ttft_p50", "tpot_p50", "e2e_p50", "gpu_util_mean", "kv_cache_tokens",
    "preemptions", "errors")}


def _figures(row: dict) -> dict:
    """A run's figures: the store's metric columns plus the rest of its summary."""
    skip = {"summary", "point", "summary_json", "point_json", "scenario_json", "error", "status"}
    columns = {k: v for k, v in row.items() if k not in skip and isinstance(v, (int, float))}
    return {**columns, **(row["summary"] or {})}


def runs_by_label(runs: pd.DataFrame) -> dict[str, list[dict]]:
    """The experiment's runs grouped by arm label (the run's point)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for row in runs.to_dict("records"):
        label = (row["point"] or {}).get("arm")
        if label:
            out[label].append({"status": row["status"], "summary": _figures(row),
                               "error": row["error"] or "",
                               "prediction": recorded_prediction(row["summary"])})
    return dict(out)


def predicted_by_label(measured: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """What the twin's predictor said for each measured arm's scenario, as recorded with its first
    run (one prediction each); an arm measured before predictions were recorded has none."""
    out = {}
    for label, runs in measured.items():
        rec = runs[0].get("prediction")
        if rec is None:
            out[label] = [{"status": "no-prediction", "summary": {}, "error": NO_PREDICTION}]
            continue
        out[label] = [{"status": rec["status"], "summary": rec["summary"], "error": rec["error"]}]
    return out


def _tp_sweep(store: Store, base: Scenario) -> tuple[str, Scenario, dict[str, list[dict]]] | None:
    """The newest tensor-parallel-size sweep of the same model, as claim 9's arms."""
    for exp in store.experiments().to_dict("records"):  # newest first
        meta = json.loads(exp["meta_json"] or "{}")
        if exp["step"] != "sweep" or meta.get("param") != "tensor-parallel-size":
            continue
        runs = store.runs(exp["id"])
        if runs.empty:
            continue
        first = Scenario.model_validate_json(runs.iloc[0]["scenario_json"])
        if first.serve.get("model") != base.serve.get("model"):
            continue
        sweep_base = first.model_copy(update={"serve": {k: v for k, v in first.serve.items()
                                                        if k != "tensor-parallel-size"}})
        mapped: dict[str, list[dict]] = defaultdict(list)
        for row in runs.to_dict("records"):
            n = int(row["point"]["tensor-parallel-size"])
            arm = claims.Arm(f"tp-{n}", "saturating", {"tensor-parallel-size": n} if n > 1 else {})
            mapped[arm.label].append({"status": row["status"], "summary": _figures(row),
                                      "error": row["error"] or ""})
        return exp["id"], sweep_base, dict(mapped)
    return None


def verdict_table(store: Store, exp: dict, runs: pd.DataFrame) -> tuple[list[claims.Verdict], dict]:
    """The verdicts (claim 9 from a TP sweep where the claims experiment has none) and notes."""
    base = Scenario.model_validate(exp["meta"]["base"])
    measured = runs_by_label(runs)
    selected = measured_claims(base, measured)
    verdicts = claims.judge(base, measured, selected)
    notes: dict[int, str] = {}
    nine = next((v for v in verdicts if v.claim.number == 9), None)
    if nine is None or nine.verdict == claims.UNTESTABLE:
        found = _tp_sweep(store, base)
        if found:
            exp_id, sweep_base, mapped = found
            redone = claims.judge(sweep_base, mapped, [9])[0]
            load = sweep_base.load.shape.level
            notes[9] = f"measured by the sweep {exp_id} ({load:g} {'users' if sweep_base.load.mode == 'closed' else 'req/s'})"
            verdicts = [v for v in verdicts if v.claim.number != 9] + [redone]
    return verdicts, notes


def measured_claims(base: Scenario, measured: dict[str, list[dict]]) -> list[int]:
    """The claims with a measured arm beyond the defaults, and those that need no run here (swap
    on vLLM 0.18+, tensor parallelism on one GPU): they are judged as not testable, with why.
    A claims experiment taken in several calls (CLAIMS=1-4, then 5-9) reports them all."""
    return [c.number for c in claims.catalog(base)
            if not any(a.serve for a in c.arms) or any(a.serve and a.label in measured for a in c.arms)]


def _median(runs: list[dict], key: str, scale: float) -> float | None:
    ok = [r for r in runs if r["status"] in claims.OK_STATUSES]
    vals = [r["summary"].get(key) for r in ok if isinstance(r["summary"].get(key), (int, float))]
    return round(float(pd.Series(vals).median()) * scale, 2) if vals else None


def arm_table(measured: dict[str, list[dict]], predicted: dict[str, list[dict]] | None = None) -> pd.DataFrame:
    """One row per arm: runs, statuses, the median of each figure (and the twin's prediction)."""
    rows = []
    for label, rs in sorted(measured.items()):
        row = {"arm": label, "runs": len(rs), "status": ",".join(sorted({r["status"] for r in rs}))}
        for key, (name, scale) in ARM_METRICS.items():
            row[name] = _median(rs, key, scale)
        if predicted is not None:
            for key in TWIN_METRICS:
                name, scale = ARM_METRICS[key]
                row[f"twin {name}"] = _median(predicted.get(label, []), key, scale)
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


def build_claims(store: Store, exp: dict, runs: pd.DataFrame, folder: Path) -> Path:
    """Write the claims report folder (index.html, report.md, verdicts.csv, arms.csv)."""
    verdicts, notes = verdict_table(store, exp, runs)
    ctx = page.context(runs)
    duration = Scenario.model_validate(exp["meta"]["base"]).load.stop.duration_s
    ctx.workload, ctx.load = "a traffic per claim (the arms table names each)", f"{duration:g} s per run"
    measured = runs_by_label(runs)
    twin, predicted = None, None
    if ctx.backend == "vllm":
        base = Scenario.model_validate(exp["meta"]["base"])
        predicted = predicted_by_label(measured)
        twin = claims.judge(base, predicted, measured_claims(base, measured))
    rows = []
    twin_by = {v.claim.number: v for v in twin or []}
    for v in verdicts:
        evidence = " · ".join(f"{p.statement}: {p.verdict} — {p.evidence}" for p in v.parts)
        if v.claim.number in notes:
            evidence = f"({notes[v.claim.number]}) {evidence}"
        row = {"claim": v.claim.number, "statement": v.claim.statement, "experiment": v.claim.method,
               "measured": evidence, "verdict": v.verdict}
        if twin is not None:
            row["twin predicts"] = twin_by[v.claim.number].verdict if v.claim.number in twin_by else ""
        rows.append(row)
    table = pd.DataFrame(rows)
    table.to_csv(folder / "verdicts.csv", index=False)
    arms = arm_table(measured, predicted)
    arms.to_csv(folder / "arms.csv", index=False)
    fig = effects_figure(verdicts, twin, ctx.caption, folder)
    unpredicted = sum(1 for p in (predicted or {}).values() if p[0]["status"] == "no-prediction")
    return page.write_page(claims_page(exp, ctx, table, arms, fig, unpredicted), folder)


def claims_page(exp, ctx, table: pd.DataFrame, arms: pd.DataFrame, fig: Path | None,
                unpredicted: int = 0) -> page.Page:
    """The claims page: the verdicts, the effects figure, the arms."""
    e = html.escape
    counts = table["verdict"].value_counts().to_dict()
    verdict_line = "Verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items())
    blocks = [
        Block(f"<h1>{e(exp['id'])}: the guide's claims, measured</h1>\n",
              [f"# {exp['id']}: the guide's claims, measured", ""]),
        Block(f'<p class="ctx">{e(ctx.caption)}</p>\n', ["```", ctx.caption, "```", "", verdict_line, ""]),
    ]
    if unpredicted:
        text = (f"Twin predictions: no prediction recorded for {unpredicted} arm(s) (measured before "
                f"the lab recorded the twin's prediction with each run on real vLLM).")
        blocks.append(Block(f"<p>{e(text)}</p>\n", [text, ""]))
    blocks += [
        page.table(table, "text"),
        Block(page.img(fig) + "\n" if fig else "\n"),
        Block("<h2>Arms (medians over their runs)</h2>\n", ["", "## Arms (medians over their runs)", ""]),
        page.table(arms, "text", groups=["arm" if c in ("arm", "runs", "status") else
                                         "twin predicts (recorded)" if c.startswith("twin ") else
                                         "measured (median over runs)" for c in arms.columns]),
    ]
    if fig:
        blocks.append(Block(md=["", *page.md_img(fig)]))
    blocks += [Block(md=[""]), page.footer(f"make report EXPERIMENT={exp['id']}", md=True)]
    return page.Page(exp["id"], blocks, CSS)


# Wider than a laptop's window: the padding keeps the text off its edges there.
CSS = """body{font-family:system-ui,sans-serif;max-width:1300px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}
th{background:#f3f3f3}img{max-width:100%}.ctx{color:#555;white-space:pre-line}"""
