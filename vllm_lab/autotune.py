"""The headline command: the serving flags that carry the most traffic within the SLO, found offline
and confirmed on the real thing within a budget of GPU minutes.

1. Search (Optuna, ``search``) on the twin's predictor over the flags the twin models. Each
   configuration is ranked by its **SLO capacity**: the highest open-loop (Poisson) request rate at
   which the scenario's SLO holds and the queue stays bounded, found by bisection below the
   saturated capacity (``stress.predicted_capacity``).
2. Measure vLLM's defaults and the top-k configurations on the chosen backend, each with its own
   capacity staircase (``stress.staircase_points`` through ``plans.execute``: stored, resumable),
   starting a candidate only when its estimated cost (server start + its runs) fits what is left
   of ``GPU_MINUTES``.
3. Report: defaults against the best, the prediction beside every measurement, the minutes spent,
   and a ready scenario file for the winner.

The search lives in an Optuna study named after the experiment (in the lab's database); each
candidate's staircase is its own stress experiment, ``<experiment>-defaults``, ``<experiment>-c1``,
...; the plan and the minutes spent are the study's user attributes, so the report is rebuilt from
what was recorded.
"""

from __future__ import annotations

import html
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from vllm_lab import lint, plans, search, stress
from vllm_lab.analysis.stress import level_verdict, levels_table
from vllm_lab.backends import Backend, Measurement, PredictBackend
from vllm_lab.flags import redact
from vllm_lab.progress import Progress
from vllm_lab.scenarios import Scenario, ScenarioError
from vllm_lab.store import Store, experiment_dir

log = logging.getLogger(__name__)

# Flags the twin's engine and step-time model react to (twin/engine.py resolve_flags, steptime.py):
# only these can be ranked on the predictor.
MODELLED = ("max-num-seqs", "max-num-batched-tokens", "long-prefill-token-threshold",
            "gpu-memory-utilization", "block-size", "kv-cache-dtype", "enable-prefix-caching",
            "enforce-eager", "api-server-count", "async-scheduling")
# Serving flags of vLLM 0.26 the twin does not model, and why: a ranking on the predictor would
# call every value equal, so they are left to a live sweep.
MEASURE_ONLY = {
    "max-num-partial-prefills": "the twin's scheduler does not limit concurrent partial prefills",
    "stream-interval": "the predictor streams every token as it is made",
    "enable-chunked-prefill": "chunked prefill is always on in vLLM's V1 engine",
}
DEFAULT_SPACE = "autotune"
# The search: probes per configuration (a bracket widened by BRACKET, then halved: about 4% wide).
PROBES = 7
BRACKET = 1.4
# Below this gain the defaults are as good as the best: one staircase step is about this wide.
NOISE = 0.05


@dataclass(frozen=True)
class Measuring:
    """How a backend measures a candidate: top-k, staircase, and the cost estimates of the budget."""

    top: int
    step_s: float  # seconds per staircase level
    fractions: tuple[float, ...]  # of the predicted SLO capacity
    refine: int  # extra levels inside the SLO bracket, budget permitting
    start_s: float  # a server start (and stop), until one is observed
    run_overhead_s: float  # per run beyond its duration: Locust start, drain, audit


MEASURING = {
    "predict": Measuring(top=3, step_s=30, fractions=(0.7, 0.85, 1.0, 1.15, 1.3), refine=2,
                         start_s=0, run_overhead_s=1),
    # The twin on a small machine: short levels, few candidates, so a run takes minutes.
    # A twin level costs its duration plus about a minute more on 2 busy cores (Locust's start,
    # the drain of long answers, the audit): two levels and one refinement each.
    "twin": Measuring(top=2, step_s=15, fractions=(0.7, 1.0), refine=1, start_s=30,
                      run_overhead_s=45),
    # A real vLLM start (weights, compile, CUDA graphs) is one to two minutes.
    "vllm": Measuring(top=3, step_s=60, fractions=(0.7, 0.85, 1.0, 1.15, 1.3), refine=2,
                      start_s=120, run_overhead_s=15),
}


def measuring(backend: str) -> Measuring:
    """How ``backend`` measures a candidate (a backend not listed: as real vLLM)."""
    return MEASURING.get(backend, MEASURING["vllm"])


def _say(line: str) -> None:
    """Progress on stdout, flushed: a make log written to a file shows each level as it ends."""
    print(line, flush=True)


# -- the space ----------------------------------------------------------------------------------

def load_space(spec: str | None, scenario: Scenario) -> search.SearchSpace:
    """SPACE (default scenarios/spaces/autotune.yaml), holding only flags the twin models."""
    spec = spec if spec and spec != "default" else DEFAULT_SPACE
    space = search.load_space(spec, scenario, measure=True)
    path = Path(spec) if Path(spec).suffix else search.SPACE_DIR / f"{spec}.yaml"
    for param, values in space.measure.items():
        if param not in MEASURE_ONLY:
            raise ScenarioError(f"{path}: key measure.{param}: only flags the twin does not model "
                                f"are tried live this way (allowed: {', '.join(MEASURE_ONLY)}); "
                                f"put a modelled flag under space:")
        if not values:
            raise ScenarioError(f"{path}: key measure.{param}: give at least one value to try")
        for value in values:
            bad = [f for f in lint.lint(scenario.with_serve(**{param: value}))
                   if f.severity == "error" and f.key == param]
            if bad:
                raise ScenarioError(f"{path}: key measure.{param}: {value!r}: {bad[0].message}")
    for param in space.space:
        if param in MEASURE_ONLY:
            raise ScenarioError(f"{path}: key space.{param}: the twin does not model it "
                                f"({MEASURE_ONLY[param]}), so the predictor cannot rank it; measure "
                                f"it with make sweep PARAM={param} (autotune searches "
                                f"{', '.join(MODELLED)})")
        if param not in MODELLED:
            raise ScenarioError(f"{path}: key space.{param}: not a flag autotune can search "
                                f"(allowed: {', '.join(MODELLED)})")
    return space


def defaults_scenario(scenario: Scenario, space: search.SearchSpace) -> Scenario:
    """The scenario with vLLM's defaults for every searched flag (its other flags are kept)."""
    return scenario.model_copy(update={"serve": {k: v for k, v in scenario.serve.items()
                                                 if k not in space.space}})


def open_loop(scenario: Scenario, duration_s: float) -> Scenario:
    """The scenario as capacity levels: open-loop Poisson arrivals at a constant rate."""
    s = stress.stress_scenario(scenario, "step")
    return plans.apply_value(s, "load.stop.duration_s", float(duration_s))


def with_flags(scenario: Scenario, flags: dict[str, Any]) -> Scenario:
    """The scenario with serve ``flags`` set."""
    return scenario.with_serve(**flags) if flags else scenario


# -- SLO capacity on the predictor ----------------------------------------------------------------

def level_holds(level: float, m: Measurement) -> bool:
    """A level holds when its run is ok, meets every SLO and its queue does not grow without bound."""
    if m.status != "ok" or not m.summary.get("meets_slo"):
        return False
    return not level_verdict(level, m.summary, m.samples, m.server_metrics)["unbounded"]


def predicted_slo_capacity(scenario: Scenario, start: float, duration_s: float,
                           probes: int = PROBES) -> dict[str, Any]:
    """The predictor's SLO capacity of a configuration: bracket it from ``start`` (req/s), then bisect.

    Each probe is one open-loop run of ``duration_s`` on the predictor (the levels the live staircase
    runs last as long, so both read the same p99). Returns {"capacity": req/s, 0 when even a tenth
    of ``start`` breaks the SLO}, or {"error": vLLM's words} when the configuration would not start.
    """
    backend = PredictBackend()
    base = open_loop(scenario, duration_s)
    low, high, rate = 0.0, math.inf, start
    for _ in range(probes):
        point = stress.staircase_points(base, [round(rate, 4)])[0]
        m = backend.measure(point.scenario, None, Path("."))
        if m.status != "ok":
            return {"error": m.error or m.status}
        if level_holds(rate, m):
            low = rate
        else:
            high = rate
        if math.isinf(high):
            rate = low * BRACKET
        elif low == 0:
            rate = high / BRACKET**2
            if rate < start / 10:
                break
        else:
            rate = (low + high) / 2
    return {"capacity": round(low, 3)}


def saturation(scenario: Scenario) -> dict[str, Any]:
    """The predictor's saturated capacity (closed loop, a queue that never empties), or its error."""
    try:
        return {"saturation": round(stress.predicted_capacity(scenario), 3)}
    except ScenarioError as e:
        return {"error": str(e)}


def run_search(base: Scenario, space: search.SearchSpace, study_name: str, storage: str,
               trials: int, seed: int | None, start: float, duration_s: float,
               say: Callable[[str], Any] = _say):
    """Optuna over ``space`` on the predictor, maximizing the SLO capacity; resumes its study."""
    from optuna.trial import TrialState

    study = search.open_study(study_name, storage, "goodput", seed, startup_trials=min(8, max(trials // 2, 1)))
    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    for _ in range(max(trials - done, 0)):
        trial = study.ask()
        try:
            values = _tidy(search.suggest(trial, space))
            result = predicted_slo_capacity(with_flags(base, values), start, duration_s)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)  # never leave a trial RUNNING
            raise
        if "error" in result:
            trial.set_user_attr("error", result["error"].splitlines()[0][:300])
            study.tell(trial, state=TrialState.PRUNED)
            say(f"  trial {trial.number} {values}: does not start")
        else:
            study.tell(trial, result["capacity"])
            say(f"  trial {trial.number} {values}: predicted SLO capacity {result['capacity']:.2f} req/s")
    return study


def _tidy(values: dict[str, Any]) -> dict[str, Any]:
    """Flag values as a person writes them: a stepped float's 0.8500000000000001 is 0.85."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}


def top_configs(study, k: int) -> list[dict[str, Any]]:
    """The ``k`` distinct configurations of the highest predicted SLO capacity (above 0)."""
    from optuna.trial import TrialState

    ranked = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
                    key=lambda t: -t.value)
    out, seen = [], set()
    for t in ranked:
        key = json.dumps(t.params, sort_keys=True)
        if t.value > 0 and key not in seen:
            seen.add(key)
            out.append({"flags": _tidy(t.params), "predicted": t.value})
        if len(out) == k:
            break
    return out


# -- measuring within a budget --------------------------------------------------------------------

class MeteredBackend:
    """A backend whose wall time is split into server starts (and stops) and measurement, and whose
    server stays up between the rounds of one candidate's staircase (``release`` stops it)."""

    def __init__(self, inner: Backend):
        self.inner, self.name = inner, inner.name
        self.start_s = self.measure_s = 0.0
        self.runs = 0
        self.calls: list[tuple[float, float]] = []  # (wall, run) of each measure
        self.stops: list[float] = []

    def measure(self, scenario: Scenario, host: str | None, workdir: Path) -> Measurement:
        """Measure through the inner backend; time before the run began is start time."""
        t0 = time.time()
        m = self.inner.measure(scenario, host, workdir)
        wall = time.time() - t0
        # A run with samples sent load (client-limited ones too); one without never got a server.
        sent = m.samples is not None and len(m.samples) > 0
        run = min(max(m.ended - m.started, 0.0), wall) if sent else 0.0
        self.measure_s += run
        self.start_s += wall - run  # the server's start, warm-up, or a failed attempt
        self.runs += 1
        self.calls.append((wall, run))
        return m

    def close(self, host: str | None) -> None:
        """Kept up: the next round of the same candidate reuses the server."""

    def release(self, host: str | None = None) -> None:
        """Stop the server now; its stop counts as start time."""
        t0 = time.time()
        self.inner.close(host)
        self.stops.append(time.time() - t0)
        self.start_s += self.stops[-1]


def capacity_from_levels(table: pd.DataFrame) -> dict[str, Any]:
    """The measured SLO capacity of a staircase: the highest level below which every level holds.

    ``bound`` is "=" (a level above it broke the SLO), ">=" (no level broke it) or "<" (the lowest
    level broke it: capacity below it); ``bracket`` (last holding, first broken) guides refinement.
    """
    if table.empty:
        return {"capacity": None, "bound": None, "bracket": None, "status": "not measured"}
    ok = table[table["ok"]].sort_values("level")
    if ok.empty:
        return {"capacity": None, "bound": None, "bracket": None, "status": str(table["status"].iloc[0])}
    good = ok["meets_slo"].astype(bool) & ~ok["unbounded"].astype(bool)
    broken = ok[~good]
    if broken.empty:
        top = float(ok["level"].max())
        return {"capacity": top, "bound": ">=", "bracket": (top, None), "status": "ok"}
    first = float(broken["level"].iloc[0])
    below = ok[good & (ok["level"] < first)]
    if below.empty:
        return {"capacity": 0.0, "bound": "<", "bracket": (None, first), "status": "ok"}
    cap = float(below["level"].max())
    return {"capacity": cap, "bound": "=", "bracket": (cap, first), "status": "ok"}


def refine_level(found: dict[str, Any], tolerance: float = 0.08) -> float | None:
    """One more level that narrows the measured capacity, or None when it is narrow enough."""
    low, high = found["bracket"] or (None, None)
    if found["status"] != "ok":
        return None
    if high is None:
        return round(low * 1.3, 3)  # nothing broke: look higher
    if low is None:
        return round(high * 0.5, 3) if high > 0.05 else None  # the lowest broke: look lower
    return round((low + high) / 2, 3) if high / low - 1 > tolerance else None


def candidate_levels(centre: float, saturation: float | None, fractions: tuple[float, ...]) -> list[float]:
    """The staircase around an expected SLO capacity (a tenth of saturation when it is 0)."""
    centre = centre if centre > 0 else 0.1 * (saturation or 1.0)
    return sorted({round(centre * f, 3) for f in fractions})


def _estimate(found: dict[str, Any] | None) -> float | None:
    """A measured capacity as one number to aim at: the capacity itself when a level broke above
    it, a little above the top when none broke, a little below the lowest when that one broke."""
    if not found or found.get("status") != "ok" or found.get("capacity") is None:
        return None
    if found["bound"] == "<":
        return 0.7 * found["bracket"][1]
    return found["capacity"] * (1.15 if found["bound"] == ">=" else 1.0)


def staircase_centre(cand: dict[str, Any], plan: dict[str, Any],
                     found: dict[str, dict[str, Any]]) -> float:
    """Where a candidate's staircase is centred, from what was measured before it.

    The defaults: on their prediction. A ranked candidate: on its prediction scaled by how far the
    predictor was from the defaults' measured capacity (what made the twin optimistic there, a
    frontend it does not model for one, is there for every candidate). A measure-only variant: on
    its base's measured capacity, since the flag is tried for a gain over it.
    """
    dflt = plan["candidates"][0]
    seen = _estimate(found.get("defaults"))
    ratio = seen / dflt["predicted"] if seen and dflt["predicted"] else 1.0
    if cand.get("measure") is None:
        return round(cand["predicted"] * (1.0 if cand["name"] == dflt["name"] else ratio), 3)
    base_seen = _estimate(found.get(cand["base"]))
    if base_seen:
        return round(base_seen, 3)
    base = next(c for c in plan["candidates"] if c["name"] == cand["base"])
    return round((base["predicted"] or 0.0) * ratio, 3)


def best_measured(plan: dict[str, Any], found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The candidate (not a measure-only variant) with the highest measured capacity so far; the
    defaults while nothing better was measured."""
    best = plan["candidates"][0]
    for cand in plan["candidates"][1:]:
        f, b = found.get(cand["name"]), found.get(best["name"])
        if cand.get("measure") is None and f and f.get("capacity") and (
                not b or not b.get("capacity") or f["capacity"] > b["capacity"]):
            best = cand
    return best


def plan_candidates(predicted_defaults: float, configs: list[dict[str, Any]],
                    measure: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The order candidates are measured in: the defaults, the measure-only flags (each on the best
    configuration measured before it: on a fresh plan, the defaults; they test what the predictor
    cannot see, so they come before configurations it ranks alike), then the ranked ones."""
    ranked = [{"name": f"c{i + 1}", **c} for i, c in enumerate(configs)]
    variants = [{"name": f"m{j + 1}", "flags": None, "measure": {param: value}, "predicted": None}
                for j, (param, value) in enumerate((p, v) for p, vs in measure.items() for v in vs)]
    return [{"name": "defaults", "flags": {}, "predicted": predicted_defaults}, *variants, *ranked]


def measure_section(space: search.SearchSpace, backend: str) -> dict[str, list[Any]]:
    """The measure-only flags to try: on real vLLM only; the twin and its predictor would read each
    as no change, and a candidate measured for nothing costs minutes."""
    return dict(space.measure) if backend not in ("twin", "predict") else {}


def _levels(store_path: Path, exp_id: str) -> pd.DataFrame:
    with Store(store_path) as store:
        runs = store.runs(exp_id)
        return levels_table(store, exp_id, runs) if len(runs) else pd.DataFrame()


def _todo(store_path: Path, exp_id: str, points: list[plans.Point]) -> int:
    with Store(store_path) as store:
        done = store.finished_keys(exp_id)
    return sum(p.key not in done for p in points)


@dataclass
class Settings:
    """One autotune: where it lives, its budget and how it measures."""

    experiment_id: str
    store_path: Path
    out: Path
    storage: str
    gpu_minutes: float
    trials: int = 20
    seed: int | None = None
    top: int | None = None
    step_s: float | None = None
    repeats: int = 1


def run(scenario: Scenario, space: search.SearchSpace, backend: Backend, settings: Settings,
        say: Callable[[str], Any] = _say, progress: Progress | None = None) -> dict[str, Any]:
    """Search on the predictor, measure the defaults and the top-k within the budget, report.

    Returns the summary (also written to OUT/<experiment>/summary.json).
    """
    how = measuring(backend.name)
    top = settings.top if settings.top is not None else how.top
    step_s = settings.step_s or how.step_s
    if not scenario.slo.targets():
        raise ScenarioError(f"scenario {scenario.name!r} has no slo: section; autotune ranks by the "
                            f"highest rate that meets it, e.g. SET=\"slo.ttft.threshold_ms=500\"")
    Store(settings.store_path).close()  # the study's tables go into the lab's database: make it first
    defaults = defaults_scenario(scenario, space)
    base = open_loop(defaults, step_s)
    t0 = time.time()
    sat = saturation(base)
    if "error" in sat:
        raise ScenarioError(f"vLLM's defaults do not start on the predictor for this scenario "
                            f"({sat['error']})")
    start = 0.8 * sat["saturation"]  # an SLO usually binds a little below saturation
    say(f"autotune: experiment {settings.experiment_id}: the defaults saturate at "
        f"{sat['saturation']:.2f} req/s on the predictor; searching {settings.trials} configurations "
        f"of {', '.join(space.space)}")
    study = run_search(base, space, settings.experiment_id, settings.storage, settings.trials,
                       settings.seed, start, step_s, say)
    plan = study.user_attrs.get("plan")
    if plan is None:  # a resumed experiment keeps the candidates it chose first
        predicted_defaults = predicted_slo_capacity(base, start, step_s)
        configs = top_configs(study, top)
        plan = {"scenario": redact(scenario.to_record()), "defaults": redact(defaults.to_record()),
                "space": list(space.space), "backend": backend.name, "step_s": step_s,
                "search_s": round(time.time() - t0, 1), "trials": settings.trials,
                "saturation": sat["saturation"],
                "candidates": plan_candidates(predicted_defaults.get("capacity", 0.0), configs,
                                              measure_section(space, backend.name))}
        study.set_user_attr("plan", plan)
    if plan["backend"] != backend.name:
        raise ScenarioError(f"experiment {settings.experiment_id} measures on {plan['backend']}: "
                            f"resume it with BACKEND={plan['backend']}, or leave out EXPERIMENT and "
                            f"RESUME to start a new one on {backend.name}")
    study.set_user_attr("gpu_minutes_budget", settings.gpu_minutes)
    say(f"autotune: search done in {time.time() - t0:.0f} s; measuring "
        f"{', '.join(c['name'] for c in plan['candidates'])} on {backend.name} "
        f"(budget {settings.gpu_minutes:g} min)")
    measure_candidates(plan, defaults, backend, settings, how, study, say, progress)
    summary = build_report(settings.store_path, settings.experiment_id, settings.out, settings.storage)
    return summary


def measure_candidates(plan: dict[str, Any], defaults: Scenario, backend: Backend, settings: Settings,
                       how: Measuring, study, say: Callable[[str], Any],
                       progress: Progress | None = None) -> None:
    """Each candidate's staircase, in order, while the budget lasts.

    A candidate starts only when its estimate (a server start and stop, and its levels) fits what
    is left; then each further level only while the slowest run seen so far and a server stop
    still fit, so an estimate that was too low is corrected after one run. The estimates follow
    what the backend really took.
    """
    spend: dict[str, dict[str, float]] = dict(study.user_attrs.get("spend") or {})
    budget_s = settings.gpu_minutes * 60
    start_est, run_wall = how.start_s, plan["step_s"] + how.run_overhead_s
    stop_est = how.start_s / 4  # a server's stop, kept in reserve until one is observed
    metered = MeteredBackend(backend)
    workdir = settings.out / ".work"

    def spent() -> float:
        recorded = sum(v["start_s"] + v["measure_s"] for v in spend.values())
        return recorded + metered.start_s + metered.measure_s - sum(before[:2])

    before = (0.0, 0.0, 0)
    if progress:  # at most: every level of every candidate and its refinements
        progress.expect(len(plan["candidates"]) * (len(how.fractions) + how.refine))
    for cand in plan["candidates"]:
        exp = f"{settings.experiment_id}-{cand['name']}"
        # Decided when the candidate first starts, then kept: a resume measures the same levels.
        chosen = {} if "centre" in cand else _choose(cand, plan, {
            c["name"]: capacity_from_levels(_levels(settings.store_path, f"{settings.experiment_id}-{c['name']}"))
            for c in plan["candidates"] if c is not cand})
        flags = cand["flags"] if cand["flags"] is not None else chosen["flags"]
        scenario = open_loop(with_flags(defaults, flags), plan["step_s"])
        # A measure-only flag is tried for a gain: its staircase starts at its base's capacity.
        fractions = how.fractions if cand.get("measure") is None else tuple(
            round(f + 1 - min(how.fractions), 3) for f in how.fractions)
        levels = candidate_levels(cand.get("centre", chosen.get("centre", 0.0)), plan["saturation"],
                                  fractions)
        points = stress.staircase_points(scenario, levels, settings.repeats)
        todo = _todo(settings.store_path, exp, points)
        cost = (start_est + todo * run_wall) if todo else 0.0
        if todo and spent() + cost > budget_s:
            say(f"  {cand['name']}: skipped: about {cost / 60:.1f} min, "
                f"{max(budget_s - spent(), 0) / 60:.1f} of GPU_MINUTES={settings.gpu_minutes:g} left")
            continue
        if chosen:
            cand.update(chosen)
            study.set_user_attr("plan", plan)
        expected = (f"predicted SLO capacity {cand['predicted']:.2f}" if cand["predicted"] is not None
                    else f"{_flags_text(cand['measure'])} over {cand['base']}, not modelled")
        say(f"  {cand['name']} {cand['flags'] or '(vLLM defaults)'}: levels {levels} req/s "
            f"({expected}; about {cost / 60:.1f} min)")
        meta = {"shape": "step", "params": ["load.shape.level"], "autotune": settings.experiment_id,
                "candidate": cand["name"], "flags": cand["flags"]}
        before = (metered.start_s, metered.measure_s, metered.runs)
        first_call = len(metered.calls)
        stopped = False

        def next_run(first_call: int = first_call, run_wall: float = run_wall) -> float:
            # The slowest run of this candidate so far (the first one's run part: its wall paid
            # the start), else the estimate: conservative, so the budget is not overrun.
            calls = metered.calls[first_call:]
            seen = [calls[0][1]] + [wall for wall, _ in calls[1:]] if calls else []
            return max([run_wall, *seen])
        try:
            found = capacity_from_levels(_levels(settings.store_path, exp))
            for round_ in range(how.refine + 1):
                for point in points:
                    if _todo(settings.store_path, exp, [point]) == 0 or _above_a_break(point, found):
                        continue
                    if metered.runs > before[2] and spent() + next_run() + stop_est > budget_s:
                        stopped = True  # the estimate was low: no run past the budget
                        break
                    if progress:
                        progress.part = cand["name"]
                    plans.execute(plans.Plan(exp, "stress", [point], meta), metered,
                                  settings.store_path, workdir,
                                  on_run=lambda pt, m: say(_level_line(pt, m)), progress=progress)
                    found = capacity_from_levels(_levels(settings.store_path, exp))
                extra = refine_level(found) if round_ < how.refine and not stopped else None
                if extra is None or extra in levels or spent() + next_run() + stop_est > budget_s:
                    break
                levels = sorted([*levels, extra])
                points = stress.staircase_points(scenario, [extra], settings.repeats)
        finally:
            try:
                metered.release()
            finally:  # a deadline or Ctrl-C during the server's stop must not lose the minutes spent
                used = {"start_s": metered.start_s - before[0], "measure_s": metered.measure_s - before[1]}
                runs = metered.runs - before[2]
                old = spend.get(cand["name"], {"start_s": 0.0, "measure_s": 0.0, "runs": 0})
                spend[cand["name"]] = {"start_s": old["start_s"] + used["start_s"],
                                       "measure_s": old["measure_s"] + used["measure_s"],
                                       "runs": old.get("runs", 0) + runs}
                before = (metered.start_s, metered.measure_s, metered.runs)
                study.set_user_attr("spend", spend)
        calls = metered.calls[first_call:]
        if calls and backend.name != "predict":
            # The first call of a candidate paid its server's start; the stop came at release.
            start_est = calls[0][0] - calls[0][1] + metered.stops[-1]
            stop_est = metered.stops[-1]
            later = [wall for wall, _ in calls[1:]] or [calls[0][1]]
            run_wall = max(sum(later) / len(later), plan["step_s"])
        found = capacity_from_levels(_levels(settings.store_path, exp))
        say(f"  {cand['name']}: measured SLO capacity {_fmt_cap(found)} "
            f"({used['start_s'] / 60:.1f} min starting, {used['measure_s'] / 60:.1f} min measuring"
            + ("; stopped by the budget" if stopped else "") + ")")


def _above_a_break(point: plans.Point, found: dict[str, Any]) -> bool:
    """A level above one that already broke the SLO cannot change the capacity: not run."""
    broke = found["bracket"][1] if found.get("bracket") else None
    return broke is not None and point.values["load.shape.level"] > broke


def _choose(cand: dict[str, Any], plan: dict[str, Any], found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A candidate's flags (a measure-only variant's on the best measured so far) and centre."""
    chosen = dict(cand)
    if cand.get("measure") is not None:
        base = best_measured(plan, found)
        chosen |= {"base": base["name"], "flags": {**base["flags"], **cand["measure"]}}
    chosen["centre"] = staircase_centre(chosen, plan, found)
    return {k: chosen[k] for k in ("flags", "centre", "base") if k in chosen}


def _level_line(point: plans.Point, m: Measurement) -> str:
    """One progress line per measured level."""
    level = point.values["load.shape.level"]
    if m.status != "ok":
        return f"    {level} req/s: {m.status}: {(m.error or '').splitlines()[0][:120] if m.error else ''}"
    s = m.summary
    held = "meets" if s.get("meets_slo") else "breaks"
    grows = level_verdict(level, s, m.samples, m.server_metrics)["unbounded"]
    return (f"    {level} req/s: TTFT p99 {(s.get('ttft_p99') or 0) * 1000:.0f} ms, TPOT p99 "
            f"{(s.get('tpot_p99') or 0) * 1000:.1f} ms: {held} the SLO"
            + (", queue grows without bound" if grows else ""))


# -- the report -----------------------------------------------------------------------------------

def _fmt_cap(found: dict[str, Any]) -> str:
    if found.get("capacity") is None:
        return found.get("status") or "not measured"
    bound = {"=": "", ">=": ">= ", "<": "< "}[found["bound"]]
    value = found["bracket"][1] if found["bound"] == "<" else found["capacity"]
    low, high = found["bracket"] or (None, None)
    # A bracket left wide (the budget or the deadline cut the refinement) is shown as such.
    wide = found["bound"] == "=" and high and high / low - 1 > 0.08
    return f"{bound}{value:.2f} req/s" + (f" (breaks by {high:.2f})" if wide else "")


def _flags_text(flags: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in flags.items()) or "(vLLM defaults)"


def build_report(store_path: Path, experiment_id: str, out: Path, storage: str) -> dict[str, Any]:
    """report.md, index.html, best.yaml and summary.json under OUT/<experiment>/, from the store."""
    study = search.load_study(experiment_id, storage)
    plan = study.user_attrs["plan"]
    spend = study.user_attrs.get("spend") or {}
    budget = study.user_attrs.get("gpu_minutes_budget")
    rows = []
    for cand in plan["candidates"]:
        found = capacity_from_levels(_levels(store_path, f"{experiment_id}-{cand['name']}"))
        used = spend.get(cand["name"], {"start_s": 0.0, "measure_s": 0.0, "runs": 0})
        rows.append({**cand, "measured": found["capacity"] if found["status"] == "ok" else None,
                     "found": found, "start_s": used["start_s"], "measure_s": used["measure_s"]})
    measured = [r for r in rows if r["measured"] is not None]
    # A configuration that met the SLO at no level is no winner, defaults included.
    best = max((r for r in measured if r["measured"] > 0),
               key=lambda r: (r["measured"], r["name"] == "defaults"), default=None)
    dflt = rows[0]
    gain = (best["measured"] / dflt["measured"] - 1
            if best and dflt["measured"] else None)
    start_min = sum(r["start_s"] for r in rows) / 60
    measure_min = sum(r["measure_s"] for r in rows) / 60
    pred_best = max((r for r in rows if r["predicted"] is not None), key=lambda r: r["predicted"])
    summary = {
        "experiment": experiment_id, "backend": plan["backend"],
        "scenario": plan["scenario"]["name"],
        "defaults_capacity": dflt["measured"], "best_capacity": best["measured"] if best else (0.0 if measured else None),
        "gain": round(gain, 4) if gain is not None else None,
        "best": best["name"] if best else None, "best_flags": best["flags"] if best else None,
        "predicted_defaults_capacity": dflt["predicted"],
        "predicted_best_capacity": (best or pred_best)["predicted"],
        "prediction_error": (round(best["predicted"] / best["measured"] - 1, 4)
                             if best and best["predicted"] is not None else None),
        "gpu_minutes": round(start_min + measure_min, 3),
        "gpu_minutes_starts": round(start_min, 3), "gpu_minutes_measuring": round(measure_min, 3),
        "gpu_minutes_budget": budget,
        "candidates": [{k: r.get(k) for k in ("name", "flags", "predicted", "measured", "centre")}
                       | {"bound": r["found"]["bound"], "status": r["found"]["status"]}
                       | ({"measure": r["measure"], "base": r.get("base")} if r.get("measure") else {})
                       for r in rows],
        "verdict": verdict(dflt, best, gain, bool(measured)),
        "measure_only_flags": sorted(MEASURE_ONLY),
    }
    folder = experiment_dir(out, experiment_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if best:
        note = (f"autotune {experiment_id}: {_flags_text(best['flags'])}; SLO capacity "
                f"{best['measured']:.2f} req/s on {plan['backend']} (defaults {_num(dflt['measured'])})")
        (folder / "best.yaml").write_text(search.scenario_file(plan["defaults"], best["flags"], note))
    md = report_markdown(summary, plan, rows, study)
    (folder / "report.md").write_text(md)
    (folder / "index.html").write_text(markdown_page(md, f"autotune {experiment_id}"))
    return summary


def _candidate_flags(row: dict[str, Any]) -> str:
    if row.get("measure") is None:
        return _flags_text(row["flags"])
    if row.get("base") is None:
        return f"{_flags_text(row['measure'])} on the best measured before it (not reached)"
    if row["flags"] == row["measure"]:
        return f"{_flags_text(row['measure'])} on {row['base']}"
    return f"{_flags_text(row['measure'])} on {row['base']}: {_flags_text(row['flags'])}"


def _predicted_text(row: dict[str, Any]) -> str:
    if row["predicted"] is not None:
        return f"{row['predicted']:.2f}"
    return "not modelled"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} req/s"


def verdict(dflt: dict[str, Any], best: dict[str, Any] | None, gain: float | None,
            any_measured: bool = True) -> str:
    """The headline in one sentence, honest when the defaults are as good as it gets."""
    if not any_measured:
        return "nothing was measured within the budget; raise GPU_MINUTES and run again with RESUME=1"
    if best is None:
        return ("no measured configuration met the SLO at its lowest level: the SLO is out of reach "
                "of these flags on this backend, or the levels were too high")
    if dflt["measured"] is None:
        return (f"the best measured configuration ({best['name']}) carries {best['measured']:.2f} req/s "
                f"within the SLO; vLLM's defaults were not measured")
    if not dflt["measured"]:
        return (f"vLLM's defaults do not meet the SLO at the lowest level measured; {best['name']} "
                f"carries {best['measured']:.2f} req/s within it")
    if gain is not None and gain <= NOISE:
        return (f"the defaults are within {max(gain, 0):.0%} of the best reachable on this traffic "
                f"({dflt['measured']:.2f} against {best['measured']:.2f} req/s): keep them")
    return (f"{best['name']} carries {best['measured']:.2f} req/s within the SLO against "
            f"{dflt['measured']:.2f} for vLLM's defaults: {gain:+.0%}")


def report_markdown(summary: dict[str, Any], plan: dict[str, Any], rows: list[dict], study) -> str:
    """The report as Markdown."""
    from optuna.trial import TrialState

    sc = plan["scenario"]
    slo = ", ".join(f"{m} p{v['percentile']:g} < {v['threshold_ms']:g} ms"
                    for m, v in (sc.get("slo") or {}).items() if isinstance(v, dict))
    trials = study.get_trials(deepcopy=False)
    pruned = sum(t.state == TrialState.PRUNED for t in trials)
    budget = summary["gpu_minutes_budget"]
    lines = [
        f"# autotune {summary['experiment']}", "",
        f"**{summary['verdict']}.**", "",
        (f"- scenario: {sc['name']} ({sc['hardware']['name']}, model {sc['serve'].get('model')}, "
        f"vLLM {sc.get('vllm_version')})"),
        f"- traffic: {sc['workload'].get('source')} workload, open-loop Poisson arrivals; SLO: {slo}",
        (f"- SLO capacity: the highest request rate at which every SLO holds and the queue stays "
        f"bounded, on a staircase of {plan['step_s']:g} s levels"),
        (f"- measured on: {plan['backend']}; predicted by the twin's predictor "
        f"({len(trials)} configurations searched in {plan['search_s']:g} s, {pruned} would not start)"),
        "",
        ("| candidate | flags over vLLM's defaults | predicted (req/s) | measured | "
        "start min | measuring min |"),
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        mark = " **best**" if r["name"] == summary["best"] else ""
        lines.append(f"| {r['name']}{mark} | {_candidate_flags(r)} | {_predicted_text(r)} | "
                     f"{_fmt_cap(r['found'])} | {r['start_s'] / 60:.2f} | {r['measure_s'] / 60:.2f} |")
    lines += [
        "",
        f"Minutes of the measuring backend: {summary['gpu_minutes']:.2f} "
        f"({summary['gpu_minutes_starts']:.2f} starting and stopping servers, "
        f"{summary['gpu_minutes_measuring']:.2f} measuring)"
        + (f" of a budget of {budget:g}" if budget is not None else "") + "."
        + (" Candidates marked 'not measured' did not fit the budget: raise GPU_MINUTES and run "
           "again with RESUME=1." if any(r["found"]["status"] == "not measured" for r in rows) else ""),
        "",
        f"Searched flags (the twin models them): {', '.join(plan['space'])}.",
        "Measure-only flags (the twin does not model them: tried live on real vLLM from the "
        "space's measure: section, or swept with make sweep): "
        + "; ".join(f"{k} ({v})" for k, v in MEASURE_ONLY.items()) + ".",
        "",
    ]
    if summary["best"] and summary["best"] != "defaults":
        lines.append("The winner as a scenario: `best.yaml` beside this report (make baseline "
                     "SCENARIO=<this folder>/best.yaml; its serve: section is also a vLLM --config file).")
        if summary["best_flags"].get("kv-cache-dtype", "auto") != "auto":
            lines.append("It stores the KV cache in fp8: check the answers' quality before serving it.")
    lines.append(f"Each candidate's staircase is its own stress experiment: make report "
                 f"EXPERIMENT={summary['experiment']}-<candidate>.")
    return "\n".join(lines) + "\n"


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


def newest_study(storage: str, prefix: str) -> str | None:
    """The newest autotune study whose name starts with ``prefix`` (names end with their time)."""
    import optuna

    try:
        names = [s.study_name for s in optuna.study.get_all_study_summaries(storage)]
    except Exception:  # noqa: BLE001 - a store without Optuna's tables holds no study
        return None
    names = [n for n in names if n.startswith(prefix)]
    return max(names) if names else None
