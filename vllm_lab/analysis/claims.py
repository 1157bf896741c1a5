"""The claims experiment's verdicts, read from the store: each arm's runs, the guide's claims judged
on them (``claims.judge``), and for real vLLM the same judgment of the twin's predictions recorded
with each run.

Claim 9 falls back on the newest tensor-parallel-size sweep in the same store when the claims
experiment itself has no TP arms (a TP sweep needs a machine with several GPUs, usually a separate
call). A store from before predictions were recorded has none: its arms say so.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

import pandas as pd

from vllm_lab import claims
from vllm_lab.analysis.points import NO_PREDICTION, recorded_prediction
from vllm_lab.run_summary import RunSummary
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store


def runs_by_label(runs: pd.DataFrame) -> dict[str, list[dict]]:
    """The experiment's runs grouped by arm label (the run's point)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for row in runs.to_dict("records"):
        label = (row["point"] or {}).get("arm")
        if label:
            out[label].append({"status": row["status"], "summary": RunSummary.of_row(row),
                               "error": row["error"] or "", "backend": row.get("backend", ""),
                               "prediction": recorded_prediction(row["summary"])})
    return dict(out)



def predicted_by_label(measured: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """What the twin's predictor said for each measured arm's scenario, as recorded with its first
    run (one prediction each); an arm measured before predictions were recorded has none."""
    out = {}
    for label, runs in measured.items():
        rec = runs[0].get("prediction")
        if rec is None:
            out[label] = [{"status": "no-prediction", "summary": RunSummary(), "error": NO_PREDICTION}]
            continue
        out[label] = [{"status": rec["status"], "summary": RunSummary.of(rec["summary"]),
                       "error": rec["error"]}]
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
            mapped[arm.label].append({"status": row["status"], "summary": RunSummary.of_row(row),
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


@dataclass(frozen=True)
class Judged:
    """A claims experiment judged: the verdicts with their notes, each arm's runs, and, for real
    vLLM, the twin's recorded predictions of the same arms and its verdicts from them."""

    verdicts: list[claims.Verdict]
    notes: dict[int, str]
    measured: dict[str, list[dict]]
    predicted: dict[str, list[dict]] | None = None
    twin: list[claims.Verdict] | None = None

    @property
    def unpredicted(self) -> int:
        """Arms measured before the lab recorded the twin's prediction with each run."""
        return sum(1 for p in (self.predicted or {}).values() if p[0]["status"] == "no-prediction")


def judge_experiment(store: Store, exp: dict, runs: pd.DataFrame, backend: str) -> Judged:
    """The verdicts of a claims experiment's runs (and of the twin's predictions, on real vLLM)."""
    verdicts, notes = verdict_table(store, exp, runs)
    measured = runs_by_label(runs)
    if backend != "vllm":
        return Judged(verdicts, notes, measured)
    base = Scenario.model_validate(exp["meta"]["base"])
    predicted = predicted_by_label(measured)
    return Judged(verdicts, notes, measured, predicted,
                  claims.judge(base, predicted, measured_claims(base, measured)))
