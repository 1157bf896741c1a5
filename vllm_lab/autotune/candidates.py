"""Which configurations autotune measures, in which order, and where each one's staircase stands.

The defaults first, then the measure-only variants (each on the best configuration measured before
it), then the predictor's top configurations, each pared to the flags that carry its gain
(``ranking.pared_candidates``). A candidate's staircase is centred on what was measured before it
(``staircase_centre``), and refined inside its SLO bracket (``refine_level``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm_lab import plans
from vllm_lab.analysis.autotune import Candidate, Capacity, Plan


def plan_candidates(predicted_defaults: float, ranked: list[Candidate],
                    measure: dict[str, list[Any]]) -> list[Candidate]:
    """The order candidates are measured in: the defaults, the measure-only flags (each on the best
    configuration measured before it: on a fresh plan, the defaults; they test what the predictor
    cannot see, so they come before configurations it ranks alike), then the ranked ones."""
    variants = [Candidate(f"m{j + 1}", None, None, measure={param: value})
                for j, (param, value) in enumerate((p, v) for p, vs in measure.items() for v in vs)]
    return [Candidate("defaults", {}, predicted_defaults), *variants, *ranked]


def aim(found: Capacity | None) -> float | None:
    """A measured capacity as one number to aim at: the capacity itself when a level broke above
    it, a little above the top when none broke, a little below the lowest when that one broke."""
    if not found or found.status != "ok" or found.capacity is None:
        return None
    if found.bound == "<":
        return 0.7 * found.bracket[1]
    return found.capacity * (1.15 if found.bound == ">=" else 1.0)


def staircase_centre(cand: Candidate, plan: Plan, found: Mapping[str, Capacity]) -> float:
    """Where a candidate's staircase is centred, from what was measured before it.

    The defaults: on their prediction. A ranked candidate: on its prediction on the host the
    defaults were measured on (``host_predicted``, autotune/host.py), where the defaults said the
    host differs from the profile's; else on its prediction scaled by how far the predictor was
    from the defaults' measured capacity (within noise of it: the profile's host). A measure-only
    variant: on its base's measured capacity, since the flag is tried for a gain over it.
    """
    dflt = plan.candidates[0]
    seen = aim(found.get("defaults"))
    ratio = seen / dflt.predicted if seen and dflt.predicted else 1.0
    if not cand.measure_only:
        if cand.name != dflt.name and cand.host_predicted:
            return round(cand.host_predicted, 3)
        return round(cand.predicted * (1.0 if cand.name == dflt.name else ratio), 3)
    base_seen = aim(found.get(cand.base))
    if base_seen:
        return round(base_seen, 3)
    return round((plan.candidate(cand.base).predicted or 0.0) * ratio, 3)


def best_measured(plan: Plan, found: Mapping[str, Capacity]) -> Candidate:
    """The candidate (not a measure-only variant) with the highest measured capacity so far; the
    defaults while nothing better was measured."""
    best = plan.candidates[0]
    for cand in plan.candidates[1:]:
        f, b = found.get(cand.name), found.get(best.name)
        if not cand.measure_only and f and f.capacity and (
                not b or not b.capacity or f.capacity > b.capacity):
            best = cand
    return best


def choose(cand: Candidate, plan: Plan, found: Mapping[str, Capacity]) -> Candidate:
    """The candidate with its flags (a measure-only variant's on the best measured so far) and its
    staircase's centre chosen: decided when it first starts, then kept."""
    chosen = cand
    if cand.measure_only:
        base = best_measured(plan, found)
        chosen = dataclasses.replace(cand, base=base.name, flags={**base.flags, **cand.measure})
    return dataclasses.replace(chosen, centre=staircase_centre(chosen, plan, found))


def fractions(cand: Candidate, planned: tuple[float, ...]) -> tuple[float, ...]:
    """The staircase's levels as fractions of its centre: a measure-only flag is tried for a gain,
    so its staircase starts at its base's capacity."""
    if not cand.measure_only:
        return planned
    return tuple(round(f + 1 - min(planned), 3) for f in planned)


def candidate_levels(centre: float, saturation: float | None, fractions: tuple[float, ...]) -> list[float]:
    """The staircase around an expected SLO capacity (a tenth of saturation when it is 0)."""
    centre = centre if centre > 0 else 0.1 * (saturation or 1.0)
    return sorted({round(centre * f, 3) for f in fractions})


def refine_level(found: Capacity, tolerance: float = 0.08, anchor: float | None = None) -> float | None:
    """One more level that narrows the measured capacity, or None when it is narrow enough.

    ``anchor``: a rate another configuration held (the best measured before this one), tried
    first where even the lowest level broke above it: whether this candidate holds what is
    already known to hold is what it is measured to tell."""
    low, high = found.bracket or (None, None)
    if found.status != "ok":
        return None
    if high is None:
        return round(low * 1.3, 3)  # nothing broke: look higher
    if low is None:  # the lowest broke: look lower, at the anchor when it lies below
        if anchor and anchor < high / (1 + tolerance):
            return round(anchor, 3)
        return round(high * 0.5, 3) if high > 0.05 else None
    return round((low + high) / 2, 3) if high / low - 1 > tolerance else None


def above_a_break(point: plans.Point, found: Capacity) -> bool:
    """A level above one that already broke the SLO cannot change the capacity: not run."""
    broke = found.bracket[1] if found.bracket else None
    return broke is not None and point.values["load.shape.level"] > broke
