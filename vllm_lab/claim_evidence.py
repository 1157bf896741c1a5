"""What a claim's verdict is read from: each arm's runs (``Evidence``), the parts of a verdict,
and the figures as the verdicts write them. A difference under the threshold is no change: the
reference's run-to-run spread on a measured backend, and never less than ``MATERIAL`` (the smallest
change the lab calls one, the deterministic predictor's only threshold: it has no noise)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from vllm_lab.run_summary import RunSummary
from vllm_lab.store import DETERMINISTIC_BACKENDS

HOLDS, PARTLY, NO, UNTESTABLE = "holds", "holds partly", "does not hold", "not testable here"
# Below 3% a difference is no change, however exact (the predictor) or closely the repeats agree:
# the same 3% a single run's spread is taken as (stats.SINGLE_RUN_CV) and the point of a claim.
MATERIAL = 0.03
OK_STATUSES = ("ok",)  # a client-limited run measured the client, not vLLM


class Arm(Protocol):
    """What the evidence reads of a claim's arm (``claims.Arm``): its name, and the label its runs
    carry in the store."""

    @property
    def name(self) -> str: ...

    @property
    def label(self) -> str: ...


@dataclass(frozen=True)
class Part:
    """One checkable statement of a claim, its verdict and the numbers behind it."""

    statement: str
    verdict: str
    evidence: str
    claimed: float | None = None   # the claimed relative change, where the claim gives one
    measured: float | None = None  # the measured relative change


class Evidence:
    """Each arm's runs (summaries and statuses), read by the judges.

    An arm's runs are those of its label or, where another claim's arm ran the same scenario
    under another label (a scenario whose own traffic is 64 closed-loop users runs
    near-capacity's), that one's: an identical arm is measured once and counts for every claim. On a deterministic
    backend (the predictor) a repeat reads the same figures: no noise is assumed for it, only
    ``MATERIAL``.
    """

    def __init__(self, runs_by_label: Mapping[str, Sequence[dict]], arms: Sequence[Arm],
                 same: Mapping[str, str] | None = None):
        same = same or {}
        by_key: dict[str, Sequence[dict]] = {}
        for label, runs in runs_by_label.items():
            if runs and label in same:
                by_key.setdefault(same[label], runs)
        # Each run's summary typed, whether it came from the store or as a mapping of figures.
        self._runs = {a.name: [{**r, "summary": RunSummary.of(r.get("summary"))}
                               for r in (runs_by_label.get(a.label)
                                         or by_key.get(same.get(a.label, ""), []))] for a in arms}
        runs = [r for rs in self._runs.values() for r in rs]
        self.deterministic = bool(runs) and all(r.get("backend") in DETERMINISTIC_BACKENDS for r in runs)

    def measured(self, arm: str) -> bool:
        """The arm has at least one run."""
        return bool(self._runs.get(arm))

    def ok(self, arm: str) -> bool:
        """The arm has at least one run that produced figures."""
        return any(r["status"] in OK_STATUSES for r in self._runs.get(arm, []))

    def status(self, arm: str) -> str:
        """The arm's statuses, and the first error line of a failed run."""
        runs = self._runs.get(arm, [])
        if not runs:
            return "not measured"
        bad = [r for r in runs if r["status"] not in OK_STATUSES]
        if not bad:
            return "ok"
        status, error = bad[0]["status"], (bad[0].get("error") or "").strip()
        line = error.splitlines()[0] if error else ""
        return f"{status}: {line.removeprefix(f'{status}: ')[:160]}"  # the error may name its cause already

    def values(self, arm: str, metric: str) -> list[float]:
        """The metric over the arm's runs that produced figures."""
        out = []
        for r in self._runs.get(arm, []):
            v = r["summary"].figure(metric)
            if r["status"] in OK_STATUSES and isinstance(v, (int, float)) and not math.isnan(v):
                out.append(float(v))
        return out

    def mean(self, arm: str, metric: str) -> float | None:
        """The arm's mean of the metric over its ok runs (None where it has none): the statistic
        every figure of the lab is."""
        v = self.values(arm, metric)
        return statistics.mean(v) if v else None

    def spread(self, arm: str, metric: str) -> float | None:
        """Run-to-run spread (coefficient of variation) of the arm's metric; None under 2 runs."""
        v = self.values(arm, metric)
        if len(v) < 2 or not statistics.mean(v):
            return None
        return statistics.stdev(v) / abs(statistics.mean(v))

    def change(self, arm: str, ref: str, metric: str) -> tuple[float | None, float]:
        """(relative change of arm against ref, threshold) for the metric: a change within the
        threshold is no change. The threshold is ``MATERIAL``, raised to twice the run-to-run
        spread on a measured backend (a deterministic one has none)."""
        a, b = self.mean(arm, metric), self.mean(ref, metric)
        spreads = [s for s in (self.spread(ref, metric), self.spread(arm, metric)) if s is not None]
        floor = max([MATERIAL] + ([] if self.deterministic else [2 * s for s in spreads]))
        if a is None or b is None or b == 0:
            return None, floor
        return (a - b) / b, floor


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f} ms"


def _change_words(rel: float, floor: float | None, exact: bool) -> tuple[str, str]:
    """A relative change and what qualifies it: the threshold, and "no change" within it."""
    text = f"{rel:+.1%}" if exact else f"{rel:+.0%}"
    if floor is None:
        return text, ""
    if exact:
        return text, ("deterministic: no noise" + (f"; under {floor:.0%}: no change" if abs(rel) < floor else ""))
    return text, f"noise ±{floor:.0%}" + (": no change" if abs(rel) < floor else "")


def pct(rel: float | None, floor: float | None = None, exact: bool = False) -> str:
    """A relative change as the verdicts write it: with its threshold, and "no change" within it;
    ``exact``: measured on a deterministic backend, which has no run-to-run noise."""
    if rel is None:
        return "n/a"
    text, note = _change_words(rel, floor, exact)
    return f"{text} ({note})" if note else text


def compare(ev: Evidence, arm: str, ref: str, metric: str, fmt=ms) -> str:
    """The reference's figure, the arm's and the change between them, with its threshold."""
    rel, floor = ev.change(arm, ref, metric)
    change = "n/a" if rel is None else ", ".join(w for w in _change_words(rel, floor, ev.deterministic) if w)
    return f"{fmt(ev.mean(ref, metric))} → {fmt(ev.mean(arm, metric))} ({change})"


def sized(rel: float | None, floor: float, claimed: float, holds_at: float | None = None) -> str:
    """The verdict on a claim that states a size (``claimed``, a relative change): it holds when the
    change reaches ``holds_at`` (default nine tenths of the claim), holds partly when it goes the
    claimed way by at least half the claim and beyond the threshold, and otherwise does not hold
    (x1.02 on a claimed 3x is no part of it)."""
    if rel is None:
        return UNTESTABLE
    sign = 1 if claimed > 0 else -1
    size = sign * rel
    if size >= abs(holds_at if holds_at is not None else 0.9 * claimed):
        return HOLDS
    if size >= abs(claimed) / 2 and size > floor:
        return PARTLY
    return NO


def tok(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} tok/s"


def absent(ev: Evidence, *arms: str) -> str | None:
    """Why the arms give no figures (not measured, or failed), or None when they all have some."""
    for a in arms:
        if not ev.ok(a):
            return f"arm {a}: {ev.status(a)}"
    return None


def overall(parts: Sequence[Part]) -> str:
    """A claim's verdict from its parts: untestable parts do not count against it."""
    tested = [p.verdict for p in parts if p.verdict != UNTESTABLE]
    if not tested:
        return UNTESTABLE
    if all(v == HOLDS for v in tested):
        return HOLDS
    if all(v == NO for v in tested):
        return NO
    return PARTLY
