"""The whole autotune but its report: the search on the predictor, the plan, and each candidate's
capacity staircase measured on the backend, in order, while GPU_MINUTES last.

A candidate starts only when its estimate (a server start and stop, and its levels) fits what is
left; then each further level only while the slowest run seen so far and a server stop still fit.
Each staircase is a stress experiment of its own, ``<experiment>-<candidate>``, taken through
``plans.execute``: stored as it goes, so a resume measures nothing twice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_lab import plans, search, stress
from vllm_lab.analysis.autotune import Candidate, Capacity, Host, Plan, Record, measured_capacity
from vllm_lab.analysis.stress import level_verdict
from vllm_lab.autotune import candidates, host, records
from vllm_lab.autotune.budget import Budget, Measuring, measuring
from vllm_lab.autotune.ranking import (
    pared_candidates,
    predicted_slo_capacity,
    run_search,
    saturation,
    say_now,
    top_configs,
)
from vllm_lab.autotune.space import defaults_scenario, measure_section, open_loop, with_flags
from vllm_lab.backends import Backend, Measurement
from vllm_lab.flags import redact
from vllm_lab.progress import Progress
from vllm_lab.scenarios import Scenario, ScenarioError
from vllm_lab.store import RunStatus, Store


@dataclass
class Settings:
    """One autotune: where it lives, its budget and how it measures."""

    experiment_id: str
    store_path: Path
    out: Path
    storage: str
    gpu_minutes: float
    trials: int = 40
    seed: int | None = None
    top: int | None = None
    step_s: float | None = None
    repeats: int = 1
    plan: dict[str, Any] | None = None  # the command's recorded plan (commands.plan_record)
    objective: str = "capacity"  # ranking.OBJECTIVES
    began: float | None = None  # when the command started (time.time()), provisioning included


def search_and_measure(scenario: Scenario, space: search.SearchSpace, backend: Backend,
                       settings: Settings, say: Callable[[str], Any] = say_now,
                       progress: Progress | None = None) -> Record:
    """Search on the predictor, plan the candidates (a resume keeps the first plan), and measure
    the defaults and the top-k on ``backend`` within the budget; the record it kept."""
    how = measuring(backend.name)
    step_s = settings.step_s or how.step_s
    if not scenario.slo.targets():
        raise ScenarioError(f"scenario {scenario.name!r} has no slo: section; autotune ranks by the "
                            f"highest rate that meets it, e.g. SET=\"slo.ttft.threshold_ms=500\"")
    Store(settings.store_path).close()  # the study's tables go into the lab's database: make it first
    defaults = defaults_scenario(scenario, space)
    base = open_loop(defaults, step_s)
    t0 = time.time()
    sat = saturation(base)
    if sat.error:
        raise ScenarioError(f"vLLM's defaults do not start on the predictor for this scenario "
                            f"({sat.error})")
    start = 0.8 * sat.value  # an SLO usually binds a little below saturation
    say(f"autotune: experiment {settings.experiment_id}: the defaults saturate at "
        f"{sat.value:.2f} req/s on the predictor; searching {settings.trials} configurations "
        f"of {', '.join(space.space)}")
    study = run_search(base, space, settings.experiment_id, settings.storage, settings.trials,
                       settings.seed, start, step_s, say, settings.objective)
    record = _record(settings, scenario, defaults, space, backend, study, how, sat.value, start, t0, say)
    record.budget = settings.gpu_minutes
    records.keep(settings.store_path, settings.experiment_id, record, settings.plan)
    say(f"autotune: search done in {time.time() - t0:.0f} s; measuring "
        f"{', '.join(c.name for c in record.plan.candidates)} on {backend.name} "
        f"(budget {settings.gpu_minutes:g} min)")
    began, measuring_from = settings.began or t0, time.time()
    try:
        Staircases(record, defaults, backend, settings, how, say, progress).measure()
    finally:  # a phase stopped by its deadline counts too
        record.host = (record.host or Host()) + Host(time.time() - began, measuring_from - began)
        records.keep_host(settings.store_path, settings.experiment_id, record.host)
    return record


def _record(settings: Settings, scenario: Scenario, defaults: Scenario, space: search.SearchSpace,
            backend: Backend, study, how: Measuring, saturated: float, start: float,
            t0: float, say: Callable[[str], Any] = say_now) -> Record:
    """The autotune's record: the one it kept (a resumed experiment keeps the candidates it chose
    first), else a new plan from the search's top configurations, each pared to the flags that
    carry its gain."""
    from vllm_lab.analysis.autotune import load_record

    record = load_record(settings.store_path, settings.experiment_id, settings.storage)
    if record is None:
        step_s = settings.step_s or how.step_s
        top = settings.top if settings.top is not None else how.top
        base = open_loop(defaults, step_s)
        predicted = predicted_slo_capacity(base, start, step_s)
        # Two more than measured: where two pare to one configuration, the next takes its place.
        ranked = pared_candidates(top_configs(study, top + 2), base, step_s, top,
                                  settings.objective, say)
        record = Record(Plan(
            scenario=redact(scenario.to_record()), defaults=redact(defaults.to_record()),
            space=list(space.space), backend=backend.name, step_s=step_s,
            search_s=round(time.time() - t0, 1), trials=settings.trials, saturation=saturated,
            objective=settings.objective,
            candidates=candidates.plan_candidates(predicted.value, ranked,
                                                  measure_section(space, backend.name))))
    if record.plan.objective != settings.objective:
        raise ScenarioError(f"experiment {settings.experiment_id} ranks by {record.plan.objective}: "
                            f"resume it with OBJECTIVE={record.plan.objective}, or leave out "
                            f"EXPERIMENT and RESUME to start a new one by {settings.objective}")
    if record.plan.backend != backend.name:
        raise ScenarioError(f"experiment {settings.experiment_id} measures on {record.plan.backend}: "
                            f"resume it with BACKEND={record.plan.backend}, or leave out EXPERIMENT and "
                            f"RESUME to start a new one on {backend.name}")
    return record


class Staircases:
    """Each candidate's staircase, in order, while the budget lasts."""

    def __init__(self, record: Record, defaults: Scenario, backend: Backend, settings: Settings,
                 how: Measuring, say: Callable[[str], Any], progress: Progress | None):
        self.record, self.plan, self.defaults = record, record.plan, defaults
        self.settings, self.how, self.say, self.progress = settings, how, say, progress
        self.budget = Budget(settings.gpu_minutes, how, self.plan.step_s, record.spend, backend)

    def measure(self) -> None:
        """Every candidate that fits the budget, in the plan's order."""
        if self.progress:  # at most: every level of every candidate and its refinements
            self.progress.expect(len(self.plan.candidates) * (len(self.how.fractions) + self.how.refine))
        for i in range(len(self.plan.candidates)):
            self.candidate(i)

    def experiment(self, cand: Candidate) -> str:
        """The stress experiment of a candidate's staircase."""
        return f"{self.settings.experiment_id}-{cand.name}"

    def candidate(self, i: int) -> None:
        """One candidate's staircase: its flags and levels chosen (once), skipped when its estimate
        does not fit what is left, then its levels and refinements while the budget allows."""
        cand = self.plan.candidates[i]
        if (cand.centre is None and i and not cand.measure_only and self.plan.host_scale is None
                and self.plan.backend not in host.PROFILE_HOSTS):
            self.learn_host()
            cand = self.plan.candidates[i]
        if cand.centre is None:  # decided when the candidate first starts, then kept
            cand = candidates.choose(cand, self.plan, self.measured_besides(cand))
        scenario = open_loop(with_flags(self.defaults, cand.flags), self.plan.step_s)
        levels = candidates.candidate_levels(cand.centre or 0.0, self.plan.saturation,
                                             candidates.fractions(cand, self.how.fractions))
        points = stress.staircase_points(scenario, levels, self.settings.repeats)
        todo = self._todo(self.experiment(cand), points)
        cost = self.budget.cost(todo)
        if todo and self.budget.spent() + cost > self.budget.seconds:
            self.say(f"  {cand.name}: skipped: about {cost / 60:.1f} min, {self.budget.left() / 60:.1f} "
                     f"of GPU_MINUTES={self.settings.gpu_minutes:g} left")
            return
        if cand is not self.plan.candidates[i]:
            self.plan.candidates[i] = cand
            records.keep(self.settings.store_path, self.settings.experiment_id, self.record,
                         self.settings.plan)
        expected = (f"predicted SLO capacity {cand.predicted:.2f}" if cand.predicted is not None
                    else f"{_flags_text(cand.measure)} over {cand.base}, not modelled")
        self.say(f"  {cand.name} {cand.flags or '(vLLM defaults)'}: levels {levels} req/s "
                 f"({expected}; about {cost / 60:.1f} min)")
        self.budget.begin()
        stopped = False
        try:
            stopped = self.staircase(cand, scenario, levels, points)
        finally:
            used = self.budget.end(cand.name, lambda spend: records.keep_spend(
                self.settings.store_path, self.settings.experiment_id, spend))
        self.budget.learn()
        self.say(f"  {cand.name}: measured SLO capacity "
                 f"{measured_capacity(self.settings.store_path, self.experiment(cand)).describe()} "
                 f"({used.start_s / 60:.1f} min starting, {used.measure_s / 60:.1f} min measuring"
                 + ("; stopped by the budget" if stopped else "") + ")")

    def learn_host(self) -> None:
        """Once the defaults are measured: the host's factor on the profile's CPU terms, and each
        ranked candidate not yet started predicted on that host (autotune/host.py), kept in the
        plan. Nothing while the defaults have no capacity to go by."""
        plan, dflt = self.plan, self.plan.candidates[0]
        seen = host.middle(measured_capacity(self.settings.store_path, self.experiment(dflt)))
        if not seen or not dflt.predicted:
            return
        base = open_loop(self.defaults, plan.step_s)
        folder = self.settings.out / ".work" / f"{self.settings.experiment_id}-host"
        plan.host_scale = host.fitted_scale(base, seen, dflt.predicted, seen, plan.step_s, folder)
        todo = [c for c in plan.candidates[1:] if c.centre is None and not c.measure_only]
        if plan.host_scale != 1.0 and todo:
            got = host.predicted_on_host(base, [c.flags for c in todo], plan.host_scale, seen,
                                         plan.step_s, folder)
            for cand, value in zip(todo, got):
                plan.candidates[plan.candidates.index(cand)] = dataclasses.replace(cand, host_predicted=value)
            self.say(f"  the host: the defaults' capacity measured {seen:.2f} req/s (the middle of "
                     f"its interval), predicted {dflt.predicted:.2f}; a host whose CPU takes "
                     f"x{plan.host_scale:g} the profile's host's time gives that, and on it the "
                     f"predictor gives " + ", ".join(f"{c.name} {v:.2f}" for c, v in zip(todo, got))
                     + " req/s")
        records.keep(self.settings.store_path, self.settings.experiment_id, self.record,
                     self.settings.plan)

    def staircase(self, cand: Candidate, scenario: Scenario, levels: list[float],
                  points: list[plans.Point]) -> bool:
        """The staircase's levels, then refining levels inside its SLO bracket; True when the
        budget stopped it (the estimate was low: no run past the budget)."""
        exp = self.experiment(cand)
        found = measured_capacity(self.settings.store_path, exp)
        for round_ in range(self.how.refine + 1):
            for point in points:
                if self._todo(exp, [point]) == 0 or candidates.above_a_break(point, found):
                    continue
                if self.budget.ran() and not self.budget.fits_a_run():
                    return True
                found = self.level(cand, exp, point)
            extra = (candidates.refine_level(found, anchor=self.anchor(cand))
                     if round_ < self.how.refine else None)
            if extra is None or extra in levels or not self.budget.fits_a_run():
                break
            levels = sorted([*levels, extra])
            points = stress.staircase_points(scenario, [extra], self.settings.repeats)
        return False

    def anchor(self, cand: Candidate) -> float | None:
        """The level the best configuration measured before ``cand`` held (its capacity on the
        level's axis); None for the defaults, the first."""
        if cand.name == self.plan.candidates[0].name:
            return None
        found = self.measured_besides(cand)
        best = candidates.best_measured(self.plan, found)
        f = found.get(best.name)
        return f.bracket[0] if f and f.status == "ok" and f.bracket and f.bracket[0] else None

    def measured_besides(self, cand: Candidate) -> dict[str, Capacity]:
        """Every other candidate's capacity as the store has it now."""
        return {c.name: measured_capacity(self.settings.store_path, self.experiment(c))
                for c in self.plan.candidates if c.name != cand.name}

    def level(self, cand: Candidate, exp: str, point: plans.Point) -> Capacity:
        """One level of a candidate's staircase, taken and recorded; the capacity it now shows."""
        if self.progress:
            self.progress.part = cand.name
        meta = {"shape": "step", "params": ["load.shape.level"], "autotune": self.settings.experiment_id,
                "candidate": cand.name, "flags": cand.flags}
        plans.execute(plans.Plan(exp, "stress", [point], meta), self.budget.metered,
                      self.settings.store_path, self.settings.out / ".work",
                      on_run=lambda pt, m: self.say(level_line(pt, m)), progress=self.progress)
        return measured_capacity(self.settings.store_path, exp)

    def _todo(self, exp: str, points: list[plans.Point]) -> int:
        with Store(self.settings.store_path) as store:
            done = store.finished_keys(exp)
        return sum(p.key not in done for p in points)


def _flags_text(flags: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in flags.items()) or "(vLLM defaults)"


def level_line(point: plans.Point, m: Measurement) -> str:
    """One progress line per measured level."""
    level = point.values["load.shape.level"]
    if m.status != RunStatus.OK:
        return f"    {level} req/s: {m.status}: {(m.error or '').splitlines()[0][:120] if m.error else ''}"
    s = m.summary
    held = "meets" if s.meets_slo else "breaks"
    grows = level_verdict(level, s, m.samples, m.server_metrics)["unbounded"]
    return (f"    {level} req/s: TTFT p99 {(s.ttft_p99 or 0) * 1000:.0f} ms, TPOT p99 "
            f"{(s.tpot_p99 or 0) * 1000:.1f} ms: {held} the SLO"
            + (", serves less than it is sent (its work in flight grows)" if grows else ""))
