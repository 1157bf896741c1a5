"""What a search's Optuna study says: its trials, the parameters' importances and the best
configurations meeting the SLO. The study lives in the lab's database (or STUDY_STORAGE), beside
the runs its trials recorded."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import pandas as pd

from vllm_lab import search, stats


def best_configs(study, k: int = 1, objective: str = "goodput") -> list[dict[str, Any]]:
    """The ``k`` best distinct configurations meeting the SLO (pareto: the feasible front)."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("slo_violation", math.inf) <= 0 or objective == "goodput"]
    if objective == "pareto":
        front = [t for t in study.best_trials if t.user_attrs.get("slo_violation", math.inf) <= 0]
        done = sorted(front, key=lambda t: -t.values[0])
    else:
        done = sorted(done, key=lambda t: -t.values[0])
    out, seen = [], set()
    for t in done:
        key = tuple(sorted(t.params.items()))
        if key not in seen:
            seen.add(key)
            out.append(dict(t.params))
        if len(out) == k:
            break
    return out


def trials_frame(study) -> pd.DataFrame:
    """One row per trial: number, state, values, params and the cause of a failure."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"trial": t.number, "state": t.state.name, **t.params,
               "value": t.values[0] if t.values else math.nan,
               "value2": t.values[1] if t.values and len(t.values) > 1 else math.nan,
               "cause": t.user_attrs.get("cause", ""), "error": t.user_attrs.get("error", ""),
               "run_key": t.user_attrs.get("run_key", ""),
               "slo_violation": t.user_attrs.get("slo_violation", math.nan)}
        rows.append(row)
    return pd.DataFrame(rows)


def tune_study(exp: dict, store_path):
    """The study a tune experiment's trials were asked by (its meta names it and its storage)."""
    meta = exp["meta"]
    return search.load_study(meta["study"], meta["storage"] or search.storage_url(None, store_path))


# Importances need enough complete trials, and an objective that moved by more than a run's noise.
MIN_TRIALS = 10
MIN_SPREAD = 2 * stats.SINGLE_RUN_CV
MEANING = ("PED-ANOVA (Optuna's default): how far each flag's values among the best 10% of trials "
           "lie from its values over every trial, normalized to sum to 1; a flag near 0 can stay "
           "at its default")


@dataclass(frozen=True)
class Importances:
    """Each parameter's importance for the (first) objective, and a sentence saying what the
    numbers mean, or why none are shown."""

    values: dict[str, float]
    note: str


def importances(study) -> Importances:
    """optuna.importance (PED-ANOVA) of each parameter, where the trials can support it: at
    least ``MIN_TRIALS`` complete trials whose objective spread past ``MIN_SPREAD`` of its
    mean; a flat objective (every setting alike within noise) ranks noise, so none is shown."""
    import optuna
    from optuna.trial import TrialState

    done = [t.values[0] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(done) < MIN_TRIALS:
        return Importances({}, f"importances not shown: {len(done)} complete trial(s), fewer than "
                               f"the {MIN_TRIALS} they need")
    top, low = max(done), min(done)
    spread = (top - low) / abs(top) if top else 0.0
    if spread <= MIN_SPREAD:
        return Importances({}, f"importances not shown: the objective varied by {spread:.1%} over "
                               f"{len(done)} trials, within the run-to-run noise ({MIN_SPREAD:.0%}): "
                               f"no flag moved it")
    # PED-ANOVA ranks what it takes to reach *low* target values: flip a maximized objective
    # (so its warning about the direction does not apply).
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            values = optuna.importance.get_param_importances(study, target=lambda t: sign * t.values[0])
    except (RuntimeError, ValueError, ZeroDivisionError):
        return Importances({}, "importances not shown: Optuna could not compute them")
    return Importances(dict(values), f"importances: {MEANING}")
