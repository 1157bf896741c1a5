"""What an autotune recorded, read from the store: its plan (the candidates in the order they are
measured), the minutes each spent, each candidate's SLO capacity from its staircase, and the outcome:
vLLM's defaults against the best, with the verdict.

A configuration's SLO capacity is the highest open-loop request rate at which every SLO holds and
the server serves what it is sent: on a staircase, the highest level below which every level holds.

The plan and the minutes are the meta of the autotune's own experiment in the store (step
``autotune``); a store written before kept them as user attributes of the autotune's Optuna study,
and is read from there. The study itself holds only its trials.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from vllm_lab import search
from vllm_lab.analysis.stress import levels_table, offered_axis, sustainable
from vllm_lab.run_summary import RunSummary
from vllm_lab.store import Store, StoreError

STEP = "autotune"  # the step of an autotune's own experiment, whose meta holds its plan
# Below this gain the defaults are as good as the best: one staircase step is about this wide.
NOISE = 0.05
# The rule that names the best candidate, said on the page (the lab's one rule, on the figure the
# objective ranks by: the SLO capacity, or the output tokens per joule at it).
_RULE = "the best is the cheapest candidate (the fewest flags changed from vLLM's defaults) whose "
RULES = {
    "capacity": _RULE + f"SLO capacity is within {NOISE:.0%} (a staircase step) of the highest measured",
    "energy": _RULE + (f"output tokens per joule at its SLO capacity are within {NOISE:.0%} of the "
                       f"most measured"),
}


@dataclass(frozen=True)
class Capacity:
    """A staircase's measured SLO capacity (req/s), and how sure it is.

    ``bound`` is "=" (a level above it broke the SLO), ">=" (no level broke it) or "<" (the lowest
    level broke it: the capacity is below it); ``bracket`` (last holding, first broken) guides
    refinement; ``status`` is the first level's when none ran ok, "not measured" without levels.
    """

    capacity: float | None = None
    bound: str | None = None
    bracket: tuple[float | None, float | None] | None = None
    status: str = "not measured"
    tokens_per_joule: float | None = None  # output tokens per joule at the last level that held
    # The load offered at the first level that broke (req/s): the capacity lies below it.
    ceiling: float | None = None

    @property
    def interval(self) -> tuple[float | None, float | None]:
        """Where the capacity lies on the offered axis: from the last level that held to the
        first that broke (None: no bound on that side)."""
        if self.measured is None:
            return (None, None)
        if self.bound == "<":
            return (0.0, self.ceiling)
        return (self.capacity, self.ceiling)

    @property
    def measured(self) -> float | None:
        """The capacity of a staircase that ran (None: not measured, or no level ran ok)."""
        return self.capacity if self.status == "ok" else None

    def describe(self) -> str:
        """The capacity as a person reads it: ``37.10 req/s``, ``>= 40.00 req/s``, ``< 4.00 req/s``;
        a bracket left wide (the budget or the deadline cut the refinement) says where it broke."""
        if self.capacity is None:
            return self.status or "not measured"
        bound = {"=": "", ">=": ">= ", "<": "< "}[self.bound]
        value = self.bracket[1] if self.bound == "<" else self.capacity
        low, high = self.bracket or (None, None)
        wide = self.bound == "=" and high and high / low - 1 > 0.08
        return f"{bound}{value:.2f} req/s" + (f" (breaks by {high:.2f})" if wide else "")


def capacity_from_levels(table: pd.DataFrame) -> Capacity:
    """The measured SLO capacity of a staircase: the load really offered at the highest level
    below which every level is sustainable, as the stress report's maximum sustainable load
    (``analysis.stress``: one rule, one axis); the bracket is in levels, to refine by."""
    if table.empty:
        return Capacity()
    ok = table[table["ok"]].sort_values("level")
    if ok.empty:
        return Capacity(status=str(table["status"].iloc[0]))
    good, offered = sustainable(ok), offered_axis(ok)
    broken = ok[~good]
    if broken.empty:
        top = ok["level"].idxmax()
        return Capacity(round(float(offered[top]), 3), ">=", (float(ok.loc[top, "level"]), None), "ok")
    first = float(broken["level"].iloc[0])
    ceiling = round(float(offered[broken.index[0]]), 3)
    below = ok[good & (ok["level"] < first)]
    if below.empty:
        return Capacity(0.0, "<", (None, first), "ok", ceiling=ceiling)
    last = below["level"].idxmax()
    return Capacity(round(float(offered[last]), 3), "=", (float(ok.loc[last, "level"]), first), "ok",
                    ceiling=ceiling)


def measured_capacity(store_path: Path, experiment_id: str) -> Capacity:
    """The SLO capacity of one candidate's staircase experiment, from its runs in the store."""
    with Store(store_path) as store:
        runs = store.runs(experiment_id)
        table = levels_table(store, experiment_id, runs) if len(runs) else pd.DataFrame()
    found = capacity_from_levels(table)
    return replace(found, tokens_per_joule=_tokens_per_joule_at(runs, found))


def _tokens_per_joule_at(runs: pd.DataFrame, found: Capacity) -> float | None:
    """The output tokens per joule of the ok runs at the last level that held (their mean)."""
    level = found.bracket[0] if found.measured and found.bracket else None
    if level is None or runs.empty:
        return None
    values = [RunSummary.of_row(r).output_tokens_per_joule for _, r in runs.iterrows()
              if r["status"] == "ok" and float(r["point"]["load.shape.level"]) == level]
    values = [v for v in values if v]
    return round(sum(values) / len(values), 4) if values else None


@dataclass
class Candidate:
    """A configuration autotune measures: ``flags`` over vLLM's defaults (a measure-only variant's
    are set once its ``base`` is chosen), the predicted SLO capacity, and where its staircase is
    centred (kept once it starts, so a resume measures the same levels)."""

    name: str
    flags: dict[str, Any] | None
    predicted: float | None
    measure: dict[str, Any] | None = None  # a measure-only variant: the flag values it tries
    centre: float | None = None
    base: str | None = None
    # The SLO capacity predicted on the host the defaults were measured on (autotune/host.py).
    host_predicted: float | None = None

    @property
    def measure_only(self) -> bool:
        """A variant of flags the twin does not model, tried on the best measured before it."""
        return self.measure is not None

    def to_record(self) -> dict[str, Any]:
        """The candidate as the plan records it (keys left out until they are known)."""
        record = {"name": self.name, "flags": self.flags, "predicted": self.predicted}
        for key in ("measure", "centre", "base", "host_predicted"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Candidate:
        """A candidate from its record."""
        return cls(record["name"], record.get("flags"), record.get("predicted"),
                   record.get("measure"), record.get("centre"), record.get("base"),
                   record.get("host_predicted"))


@dataclass
class Plan:
    """An autotune's plan, chosen once and kept: the scenario and its defaults (records), the
    searched flags, the backend, the staircase's level length, the search's time and size, the
    defaults' predicted saturation, and the candidates in the order they are measured."""

    scenario: dict[str, Any]
    defaults: dict[str, Any]
    space: list[str]
    backend: str
    step_s: float
    search_s: float
    trials: int
    saturation: float
    candidates: list[Candidate]
    objective: str = "capacity"  # what ranks the candidates: SLO capacity, or energy (tok/J at it)
    # The measuring host's factor on the profile's CPU terms, read from the defaults' measured
    # capacity (autotune/host.py); None until they are measured, and in a plan from before.
    host_scale: float | None = None

    def to_record(self) -> dict[str, Any]:
        """The plan as the store keeps it (no host_scale until it is known)."""
        return {**{k: v for k, v in asdict(self).items()
                   if k != "candidates" and not (k == "host_scale" and v is None)},
                "candidates": [c.to_record() for c in self.candidates]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Plan:
        """A plan from its record."""
        fields = {k: record[k] for k in ("scenario", "defaults", "space", "backend", "step_s",
                                         "search_s", "trials", "saturation")}
        return cls(**fields, candidates=[Candidate.from_record(c) for c in record["candidates"]],
                   objective=record.get("objective", "capacity"),  # a plan from before: capacity
                   host_scale=record.get("host_scale"))

    def candidate(self, name: str) -> Candidate:
        """The candidate named ``name``."""
        return next(c for c in self.candidates if c.name == name)


@dataclass
class Spend:
    """Seconds of the measuring backend a candidate took: starting (and stopping) servers, and
    measuring; and its runs."""

    start_s: float = 0.0
    measure_s: float = 0.0
    runs: int = 0

    def __add__(self, other: Spend) -> Spend:
        return Spend(self.start_s + other.start_s, self.measure_s + other.measure_s,
                     self.runs + other.runs)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Spend:
        """A spend from its record (an early one counted no runs)."""
        return cls(record.get("start_s", 0.0), record.get("measure_s", 0.0), record.get("runs", 0))


@dataclass
class Host:
    """Seconds of the lab's own command on the host, over every phase of an autotune: from the
    command's start to its last level (``wall_s``), and of that the part before its first
    server start (``setup_s``: provisioning, and the search or its plan read back). What the
    measuring backend did not count of the wall is the lab's own time."""

    wall_s: float = 0.0
    setup_s: float = 0.0

    def __add__(self, other: Host) -> Host:
        return Host(self.wall_s + other.wall_s, self.setup_s + other.setup_s)


@dataclass
class Record:
    """What an autotune keeps besides its runs: the plan, the minutes each candidate spent, the
    budget it was last given (GPU_MINUTES) and the host's time (None in a record from before)."""

    plan: Plan
    spend: dict[str, Spend] = field(default_factory=dict)
    budget: float | None = None
    host: Host | None = None

    def meta(self) -> dict[str, Any]:
        """The record as its experiment's meta."""
        return {"plan": self.plan.to_record(), "spend": {k: asdict(v) for k, v in self.spend.items()},
                "gpu_minutes_budget": self.budget} | (
                    {"host": asdict(self.host)} if self.host else {})

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Record:
        """The record from its experiment's meta (or a study's user attributes, the same keys)."""
        return cls(Plan.from_record(meta["plan"]),
                   {k: Spend.from_record(v) for k, v in (meta.get("spend") or {}).items()},
                   meta.get("gpu_minutes_budget"),
                   Host(**meta["host"]) if meta.get("host") else None)


def load_record(store_path: Path, experiment_id: str, storage: str) -> Record | None:
    """The autotune's record: its experiment's meta, or for a store written before, its study's
    user attributes; None when it has chosen no plan yet."""
    try:
        with Store(store_path) as store:
            exp = store.experiment(experiment_id)
        if exp["step"] == STEP:
            return Record.from_meta(exp["meta"])
    except StoreError:
        pass  # no experiment of that name: an autotune from before, or none
    try:
        attrs = search.load_study(experiment_id, storage).user_attrs
    except KeyError:  # no study of that name
        return None
    return Record.from_meta(attrs) if "plan" in attrs else None


@dataclass(frozen=True)
class Row:
    """One candidate's outcome: its plan entry, its measured capacity and what it spent."""

    candidate: Candidate
    found: Capacity
    spend: Spend
    objective: str = "capacity"

    @property
    def measured(self) -> float | None:
        """The measured SLO capacity (None: not measured)."""
        return self.found.measured

    @property
    def score(self) -> float | None:
        """What the objective ranks by: the measured SLO capacity, or (energy) the output tokens
        per joule at it; None where the SLO held at no level (no winner, defaults included)."""
        if self.measured is None or self.measured <= 0:
            return None
        return self.found.tokens_per_joule if self.objective == "energy" else self.measured


@dataclass(frozen=True)
class Outcome:
    """An autotune's outcome: each candidate's row, the best (the highest measured capacity above
    0; the defaults win a tie), the gain over the defaults and the search's size."""

    experiment: str
    record: Record
    rows: list[Row]
    trials: int
    pruned: int

    @property
    def defaults(self) -> Row:
        """vLLM's defaults, always the first candidate."""
        return self.rows[0]

    @property
    def objective(self) -> str:
        """What ranks the candidates (the plan's): capacity, or energy."""
        return self.record.plan.objective

    @property
    def rule(self) -> str:
        """The rule naming the best, in words, for this objective."""
        return RULES[self.objective]

    @property
    def top(self) -> Row | None:
        """The highest score (the defaults win a tie): a configuration that met the SLO at no
        level is no winner, defaults included."""
        return max((r for r in self.rows if r.score is not None),
                   key=lambda r: (r.score, r.candidate.name == "defaults"), default=None)

    @property
    def best(self) -> Row | None:
        """The best by the lab's one rule (``RULES``): the cheapest candidate within noise
        of the top, cheaper meaning fewer flags changed from vLLM's defaults (the defaults
        first); within noise: a score within ``NOISE`` (a staircase step) of the top's."""
        top = self.top
        if top is None:
            return None
        close = [r for r in self.rows if r.score is not None and r.score >= top.score / (1 + NOISE)]
        return min(close, key=lambda r: (len(r.candidate.flags or {}), -r.score))

    @property
    def any_measured(self) -> bool:
        """Whether any candidate's staircase ran."""
        return any(r.measured is not None for r in self.rows)

    @property
    def gain(self) -> float | None:
        """The best's score over the defaults', less one."""
        best, dflt = self.best, self.defaults.score
        return best.score / dflt - 1 if best and dflt else None

    @property
    def gain_interval(self) -> tuple[float | None, float | None] | None:
        """Where the gain lies, from each capacity's interval (last level held, first broken):
        the best's lowest over the defaults' highest, and its highest over their lowest, less
        one; None on either side that no broken level bounds. For the capacity objective."""
        best = self.best
        if self.objective != "capacity" or best is None or self.defaults.measured is None:
            return None
        (b_low, b_high), (d_low, d_high) = best.found.interval, self.defaults.found.interval
        low = b_low / d_high - 1 if b_low is not None and d_high else None
        high = b_high / d_low - 1 if b_high is not None and d_low else None
        return (low, high)

    def unsettled(self) -> list[Row]:
        """Measured candidates whose levels leave room for more than ``NOISE`` over the defaults'
        capacity (the first level they broke offered more), while the one that held offered
        less: their staircases ended before they were told apart from the defaults."""
        dflt = self.defaults.measured
        if not dflt or self.objective != "capacity":
            return []
        return [r for r in self.rows[1:] if r.measured and r.measured < dflt * (1 + NOISE)
                and r.found.ceiling and r.found.ceiling > dflt * (1 + NOISE)]

    def minutes(self) -> tuple[float, float]:
        """Minutes of the measuring backend spent starting (and stopping) servers, and measuring."""
        return (sum(r.spend.start_s for r in self.rows) / 60,
                sum(r.spend.measure_s for r in self.rows) / 60)

    def verdict(self) -> str:
        """The headline in one sentence, honest when the defaults are as good as it gets."""
        if self.objective == "energy" and self.best is not None:
            return self._energy_verdict()
        best, dflt, gain = self.best, self.defaults.measured, self.gain
        if not self.any_measured:
            return "nothing was measured within the budget; raise GPU_MINUTES and run again with RESUME=1"
        if best is None:
            return ("no measured configuration met the SLO at its lowest level: the SLO is out of reach "
                    "of these flags on this backend, or the levels were too high")
        name = best.candidate.name
        if dflt is None:
            return (f"the best measured configuration ({name}) carries {best.measured:.2f} req/s "
                    f"within the SLO; vLLM's defaults were not measured")
        if not dflt:
            return (f"vLLM's defaults do not meet the SLO at the lowest level measured; {name} "
                    f"carries {best.measured:.2f} req/s within it")
        top = self.top.measured
        if name == "defaults" or (gain is not None and gain <= NOISE):
            open_ = self.unsettled()  # candidates whose levels left them undecided
            return (f"the defaults are within {max(top / dflt - 1, 0):.0%} of the best "
                    f"{'measured' if open_ else 'reachable'} on this traffic ({dflt:.2f} against "
                    f"{top:.2f} req/s): keep them"
                    + "".join(f"; {r.candidate.name} lies between {r.found.capacity:.2f} and "
                              f"{r.found.ceiling:.2f} req/s, not yet told apart from them (RESUME=1 "
                              f"with more GPU_MINUTES narrows it)" for r in open_))
        return (f"{name} carries {best.measured:.2f} req/s within the SLO against "
                f"{dflt:.2f} for vLLM's defaults: {gain:+.0%}{self._gain_range()}")

    def _gain_range(self) -> str:
        """The gain's interval in words, from the levels that held and broke on each side."""
        low, high = self.gain_interval or (None, None)
        if low is None and high is None:
            return ""
        where = f"{low:+.0%} to {high:+.0%}" if low is not None and high is not None else (
            f"at least {low:+.0%}" if low is not None else f"at most {high:+.0%}")
        return f" ({where} between the levels that held and broke)"

    def _energy_verdict(self) -> str:
        best, dflt, gain = self.best, self.defaults.score, self.gain
        name, at = best.candidate.name, f"at {best.measured:.2f} req/s within the SLO"
        if dflt is None:
            return (f"the most output tokens per joule measured: {name}, {best.score:.2f} tok/J "
                    f"{at}; vLLM's defaults held the SLO at no level or were not measured")
        if name == "defaults" or (gain is not None and gain <= NOISE):
            return (f"the defaults are within {max(self.top.score / dflt - 1, 0):.0%} of the most "
                    f"output tokens per joule reachable on this traffic ({dflt:.2f} against "
                    f"{self.top.score:.2f} tok/J): keep them")
        return (f"{name} gives {best.score:.2f} output tokens per joule {at}, against {dflt:.2f} "
                f"for vLLM's defaults: {gain:+.0%}")


def outcome(store_path: Path, experiment_id: str, storage: str) -> Outcome:
    """The autotune's outcome from the store: its record, each candidate's staircase, its study."""
    from optuna.trial import TrialState

    record = load_record(store_path, experiment_id, storage)
    if record is None:
        raise StoreError(f"{store_path}: no autotune {experiment_id!r} with a plan")
    rows = [Row(c, measured_capacity(store_path, f"{experiment_id}-{c.name}"),
                record.spend.get(c.name, Spend()), record.plan.objective)
            for c in record.plan.candidates]
    trials = search.load_study(experiment_id, storage).get_trials(deepcopy=False)
    return Outcome(experiment_id, record, rows, len(trials),
                   sum(t.state == TrialState.PRUNED for t in trials))
