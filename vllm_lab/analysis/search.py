"""What a search's Optuna study says: its trials, the parameters' importances and the best
configurations meeting the SLO. The study lives in the lab's database (or STUDY_STORAGE), beside
the runs its trials recorded."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
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


# Importances need enough complete trials, an objective that moved by more than a run's noise,
# and, flag by flag, a flag that moved it itself.
MIN_TRIALS = 10
MIN_SPREAD = 2 * stats.SINGLE_RUN_CV
MEANING = ("PED-ANOVA (Optuna's default): how far each flag's values among the best 10% of trials "
           "lie from its values over every trial, normalized to sum to 1 over every flag searched")
MAX_GROUPS = 4  # a numeric flag with more values tried is read in this many quantile bins


@dataclass(frozen=True)
class Importances:
    """Each parameter's importance for the (first) objective, and a sentence saying what the
    numbers mean, or why none are shown; ``effects``: each flag's own effect (``flag_effects``);
    ``no_effect``: the flags whose effect is within the noise, whose importance is not shown."""

    values: dict[str, float]
    note: str
    effects: dict[str, float] = field(default_factory=dict)
    no_effect: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The note, then one line per flag: its importance, or that it had no measurable effect."""
        out = [self.note]
        out += [f"importance of {k}: {v:.2f} (its values' mean objectives {self.effects[k]:.0%} apart)"
                for k, v in self.values.items()]
        out += [f"{k}: no measurable effect (its values' mean objectives {self.effects[k]:.1%} apart, "
                f"within the {MIN_SPREAD:.0%} noise)" for k in self.no_effect]
        return out


def flag_effects(trials: Sequence[tuple[dict[str, Any], float]]) -> dict[str, float]:
    """Each flag's own effect on the objective: how far apart the objective's mean lies over the
    trials at each of its values (a numeric flag with more than ``MAX_GROUPS`` values in quantile
    bins), relative to the best trial's objective. A flag whose marginal means lie within the noise
    barely moves the objective, whatever rank PED-ANOVA gives it."""
    frame = pd.DataFrame([{**params, "_objective": value} for params, value in trials])
    top = frame["_objective"].abs().max() if len(frame) else 0.0
    out = {}
    for name in (c for c in frame.columns if c != "_objective"):
        column = frame[name]
        numeric = pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)
        if numeric and column.nunique() > MAX_GROUPS:
            groups = pd.qcut(column.rank(method="first"), MAX_GROUPS, labels=False)
        else:
            groups = column.astype(str)
        means = frame.groupby(groups)["_objective"].mean()
        out[name] = float((means.max() - means.min()) / top) if top and len(means) > 1 else 0.0
    return out


def importances(study) -> Importances:
    """optuna.importance (PED-ANOVA) of each parameter, where the trials can support it: at
    least ``MIN_TRIALS`` complete trials whose objective spread past ``MIN_SPREAD`` of its
    mean; a flat objective (every setting alike within noise) ranks noise, so none is shown. Of
    the rest, a flag's importance is shown only where its own effect (``flag_effects``) is past
    ``MIN_SPREAD``: the others had no measurable effect."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    done = [t.values[0] for t in complete]
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
    effects = flag_effects([(t.params, t.values[0]) for t in complete])
    moved = {k: v for k, v in values.items() if effects.get(k, 0.0) > MIN_SPREAD}
    quiet = tuple(k for k in values if k not in moved)
    note = f"importances: {MEANING}"
    if quiet:
        note += (f"; shown only for a flag whose values' mean objectives lie more than {MIN_SPREAD:.0%} "
                 f"apart")
    return Importances(moved, note, effects, quiet)
