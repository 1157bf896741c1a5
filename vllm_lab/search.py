"""Step 3, combinations: a grid of 2-3 flags, and a Bayesian search (Optuna) over a declared space.

The grid is ``plans.grid_points`` taken by ``plans.execute`` (failures as data, resume, spreading).
The search asks Optuna for a configuration, measures it as a one-point plan through the same
``plans.execute`` (so every trial is a run in the store, step "tune"), and tells Optuna the result.
The study lives in Optuna's RDB storage: by default the lab's own SQLite database (Optuna's tables
``studies``, ``trials``, ... do not collide with the lab's ``experiments``, ``runs``, ...), or any
SQLAlchemy URL such as PostgreSQL, so several processes or control nodes can work on one study.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm_lab import flags as flagcat
from vllm_lab import plans
from vllm_lab.backends import Backend
from vllm_lab.run_summary import RunSummary
from vllm_lab.scenarios import SCENARIO_DIR, Scenario, ScenarioError, read_yaml
from vllm_lab.store import Store
from vllm_lab.summary import PERCENTILES

log = logging.getLogger(__name__)

SPACE_DIR = SCENARIO_DIR / "spaces"
OBJECTIVES = ("goodput", "throughput", "pareto", "energy")
# Objectives that are maximized subject to the SLO (as a constraint) rather than through it.
CONSTRAINED = ("throughput", "energy")
# The figure of a run's summary each objective maximizes, and so the figure its best is named by
# (``analysis.points.best_point``, among the points meeting the SLO); pareto's two objectives
# have no one figure: goodput weighs throughput and the SLO's latency in one.
RANKED_BY = {"goodput": "goodput", "throughput": "output_throughput", "pareto": "goodput",
             "energy": "output_tokens_per_joule"}
# Statuses the configuration caused (Optuna learns to avoid them: pruned) against those that say
# nothing about it (the measurement itself went wrong: failed).
CONFIG_FAILURES = ("oom", "failed-start", "timeout", "crashed")


# -- the grid ----------------------------------------------------------------------------------

def parse_grid(grid_text: str | None, params_text: str | None, scenario: Scenario) -> dict[str, list]:
    """GRID="a=1,2 b=3,4" and/or PARAMS=a,b (default ladders) as {param: values}, 2-3 params."""
    grid: dict[str, list] = {}
    for item in (grid_text or "").split():
        param, sep, values = item.partition("=")
        if not sep or not param or not values:
            raise ScenarioError(f"GRID item {item!r}: write flag=v1,v2,..., e.g. "
                                f"GRID=\"max-num-seqs=8,16,32 max-num-batched-tokens=2048,8192\"")
        grid[param] = plans.parse_values(param, values, f"GRID {param}")
    for param in (p.strip() for p in (params_text or "").split(",") if p.strip()):
        if param not in grid:
            grid[param] = plans.default_values(param, scenario)
    if not 2 <= len(grid) <= 3:
        raise ScenarioError(f"a combination needs 2 or 3 parameters (got {len(grid)}: "
                            f"{', '.join(grid) or 'none'}); e.g. PARAMS=max-num-seqs,max-num-batched-tokens")
    return grid


def combo_points(scenario: Scenario, grid: dict[str, Sequence[Any]], repeats: int = 1,
                 reference: dict[str, Any] | None = None) -> list[plans.Point]:
    """Every combination of the grid, serve values grouped so a server starts once per
    combination, and the ``reference`` combination (vLLM's defaults) beside it when the grid
    does not hold it: every point's effect is read against it."""
    points = plans.grid_points(scenario, grid, repeats)
    if reference is None or all(reference[p] in values for p, values in grid.items()):
        return points
    return [*_points(scenario, reference, repeats), *points]


def _points(scenario: Scenario, values: dict[str, Any], repeats: int) -> list[plans.Point]:
    point = _point(scenario, values)
    return [plans.Point(point.scenario, point.values, r) for r in range(repeats)]


# -- the declared space ------------------------------------------------------------------------

def _scalar(value: Any) -> bool:
    """Whether ``value`` is one Optuna (and a flag's command line) takes as one choice."""
    return value is None or type(value) in (str, int, float, bool)


class ParamRange(BaseModel):
    """One searched parameter: a numeric range (low..high, optionally log or stepped) or choices."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)
    int: bool | None = Field(None, description="integer range (default: as the flag's type)")
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ParamRange:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not self.choices:
                raise ValueError("give either choices: [..] (non-empty) or low: and high:, not both")
            if not all(map(_scalar, self.choices)):
                # Optuna takes only these; a list or a mapping as one choice fails mid-study.
                raise ValueError("each of choices must be a number, a string, true/false or null, "
                                 "not a list, a mapping or a date")
        elif self.low is None or self.high is None or self.low > self.high:
            raise ValueError("a range needs low: and high: with low <= high (or choices: [..])")
        elif self.log and self.low <= 0:
            raise ValueError("log: true needs low > 0")
        return self


class SearchSpace(BaseModel):
    """The flags a search varies and their ranges (``space:`` in a YAML file), and for autotune
    the values of flags the predictor cannot rank, to try live on the best configuration
    (``measure:``, e.g. ``{api-server-count: [4]}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    space: dict[str, ParamRange]
    measure: dict[str, list[Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> SearchSpace:
        if not self.space:
            raise ValueError("space: needs at least one parameter")
        if not all(_scalar(v) for values in self.measure.values() for v in values):
            raise ValueError("each value under measure: must be a number, a string, true/false or "
                             "null, not a list, a mapping or a date")
        return self


def default_space(scenario: Scenario) -> SearchSpace:
    """The batching flags over the ladders the sweep uses on this hardware, on a log scale."""
    space = {}
    for param in ("max-num-seqs", "max-num-batched-tokens"):
        ladder = plans.default_values(param, scenario)
        space[param] = ParamRange(low=min(ladder), high=max(ladder), log=True)
    return SearchSpace(space=space)


def load_space(spec: str | None, scenario: Scenario, measure: bool = False) -> SearchSpace:
    """SPACE: empty or 'default' (the hardware's default), a name in scenarios/spaces/, or a file.
    ``measure``: the command reads a ``measure:`` section (autotune); others refuse one."""
    if not spec or spec == "default":
        return default_space(scenario)
    path = Path(spec)
    if not path.suffix:
        path = SPACE_DIR / f"{spec}.yaml"
    data = read_yaml(path)
    try:
        space = SearchSpace.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ScenarioError(f"{path}: key {key}: {err['msg']} (a space is space: {{flag: {{low: .., "
                            f"high: .., log: true}} or {{choices: [..]}}}})") from None
    for section, params in (("space", space.space), ("measure", space.measure)):
        for param in params:
            if any(flagcat.is_secret(part) for part in param.split(".")):
                # Its values would be in the study, the plan's meta and every label.
                raise ScenarioError(f"{path}: key {section}.{param}: a secret is not searched; "
                                    f"give it once in the scenario file, VLLM_API_KEY in the "
                                    f"environment, or vllm_api_key in the inventory's ansible-vault")
    if space.measure and not measure:
        raise ScenarioError(f"{path}: key measure: only make autotune reads it (flags to try live "
                            f"on its best configuration); drop it for this command")
    for section, params in (("space", space.space), ("measure", space.measure)):
        for param in params:
            if plans.is_serve_flag(param) and param not in flagcat.FLAGS:
                raise ScenarioError(f"{path}: key {section}.{param}: not a vLLM flag the lab knows "
                                    f"(tuning flags: {', '.join(n for n, f in flagcat.FLAGS.items() if f.tuning)})")
    return space


def _is_int(param: str, r: ParamRange) -> bool:
    if r.int is not None:
        return r.int
    flag = flagcat.FLAGS.get(param)
    return flag.kind == "int" if flag else float(r.low).is_integer() and float(r.high).is_integer()


def suggest(trial, space: SearchSpace) -> dict[str, Any]:
    """Ask the trial for one value of every parameter of the space."""
    values = {}
    for param, r in space.space.items():
        if r.choices is not None:
            values[param] = trial.suggest_categorical(param, r.choices)
        elif _is_int(param, r):
            values[param] = trial.suggest_int(param, int(r.low), int(r.high), log=r.log,
                                              step=int(r.step or 1))
        else:
            values[param] = trial.suggest_float(param, r.low, r.high, log=r.log and not r.step,
                                                step=r.step)
    return values


def snap(param: str, r: ParamRange, value: Any) -> Any:
    """``value`` as a point of the range: itself among choices (else the first choice), or clamped
    to low..high, on the step's grid and an integer where the range is of integers."""
    if r.choices is not None:
        return value if value in r.choices else r.choices[0]
    low, high = float(r.low), float(r.high)
    v = min(max(float(value if value is not None else low), low), high)
    if r.step:
        v = min(low + round((v - low) / r.step) * r.step, high)
    return round(v) if _is_int(param, r) else round(v, 6)


def one_at_a_time(space: SearchSpace, home: dict[str, Any]) -> list[dict[str, Any]]:
    """``home`` (snapped into the space), then ``home`` with one parameter moved: to each other
    choice, or to each end of its range. Step 2 of the method (one flag at a time) as the first
    points of a combined search: each flag's effect alone is known before the sampler combines
    them, whatever its seed."""
    centre = {p: snap(p, r, home.get(p)) for p, r in space.space.items()}
    points, seen = [centre], {json.dumps(centre, sort_keys=True, default=str)}
    for p, r in space.space.items():
        values = r.choices if r.choices is not None else [snap(p, r, r.low), snap(p, r, r.high)]
        for v in values:
            point = {**centre, p: v}
            key = json.dumps(point, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                points.append(point)
    return points


# -- objectives ---------------------------------------------------------------------------------

def slo_latency(scenario: Scenario) -> tuple[str, float] | None:
    """The summary column of the SLO's first latency at its percentile, and its threshold (s)."""
    for metric, target in scenario.slo.targets().items():
        pct = round(target.percentile)
        if pct in (50, 90, 99):
            return f"{metric}_p{pct}", target.threshold_ms / 1000
    return None


def slo_violation(summary: RunSummary, scenario: Scenario) -> float:
    """How far the run is over its worst SLO, as a fraction of the threshold (<= 0: feasible)."""
    worst = -1.0
    verdicts = summary.slo_verdicts or {}
    for metric, target in scenario.slo.targets().items():
        pct = round(target.percentile)
        value = summary.figure(f"{metric}_p{pct}") if pct in PERCENTILES else None
        if pct not in PERCENTILES and metric in verdicts:
            worst = max(worst, -0.5 if verdicts[metric] else 0.5)  # only the verdict is stored
            continue
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return math.inf
        worst = max(worst, float(value) / (target.threshold_ms / 1000) - 1.0)
    return worst if scenario.slo.targets() else -1.0


def objective_values(summary: RunSummary, objective: str, scenario: Scenario) -> list[float]:
    """The value(s) Optuna gets: the objective's figure (``RANKED_BY``), or for pareto
    (throughput, the SLO's latency)."""
    if objective != "pareto":
        # Energy is tokens per joule, what a fleet's power bill buys: a run with no energy figure
        # (a host with no GPU telemetry) counts as none, as a run that served nothing does.
        return [float(summary.figure(RANKED_BY[objective]) or 0.0)]
    latency = slo_latency(scenario)
    value = summary.figure(latency[0] if latency else "e2e_p99")
    return [float(summary.output_throughput or 0.0), value if value is not None else math.inf]


def directions(objective: str) -> list[str]:
    """Optuna's study directions for an objective."""
    if objective not in OBJECTIVES:
        raise ScenarioError(f"OBJECTIVE={objective!r}: allowed values are {', '.join(OBJECTIVES)}")
    return ["maximize", "minimize"] if objective == "pareto" else ["maximize"]


# -- the study ----------------------------------------------------------------------------------

def storage_url(storage: str | None, store_path: Path) -> str:
    """STUDY_STORAGE, or the lab's own SQLite database (Optuna's tables sit beside the lab's)."""
    return storage or f"sqlite:///{Path(store_path).resolve()}"


def _storage(url: str):
    import optuna
    import sqlalchemy.exc
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several workers write one file: wait for the lock instead of failing at once.
        kwargs = {"connect_args": {"timeout": 60}}
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except sqlalchemy.exc.DBAPIError as e:
            # Two workers starting at once both create Optuna's tables and stamp their version;
            # the loser finds them made: a table that exists (PostgreSQL says so as a
            # ProgrammingError, SQLite as an OperationalError), or the stamp already there.
            lost_race = "already exists" in str(e) or "alembic_version" in str(e)
            if not lost_race or attempt == 4:
                raise _unreachable(url, e) from None
            time.sleep(0.5)
        except (sqlalchemy.exc.SQLAlchemyError, ImportError, ValueError) as e:  # URL, driver
            raise _unreachable(url, e) from None
    raise AssertionError("unreachable")


def _unreachable(url: str, error: Exception) -> ScenarioError:
    """The sentence for a study storage that cannot be opened; its password never in it."""
    cause = getattr(error, "orig", None) or error
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    hidden = " (password hidden)" if flagcat.redact_url(url) != url else ""
    return ScenarioError(f"STUDY_STORAGE={flagcat.redact_url(url)}: cannot reach the study "
                         f"storage ({flagcat.redact_url(first)[:300]}){hidden}; give a database URL "
                         f"that answers, or leave STUDY_STORAGE empty for the lab's own database")


def check_storage(url: str) -> None:
    """ScenarioError (one sentence, no password) unless the study storage ``url`` opens: checked
    before anything is recorded."""
    _storage(url)  # Optuna connects (and makes its tables) as it opens the storage


def _constraints(trial) -> list[float]:
    return [float(trial.user_attrs.get("slo_violation", math.inf))]


def _has_set_constraint() -> bool:
    import optuna
    return hasattr(optuna.trial.Trial, "set_constraint")  # Optuna 5 replaces constraints_func


def sampler_for(objective: str, seed: int | None, startup_trials: int = 4):
    """TPE by default (throughput: with the SLO as a constraint); NSGA-II for two objectives."""
    import optuna
    if objective == "pareto":
        return optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, startup_trials * 2),
            **({} if _has_set_constraint() else {"constraints_func": _constraints}))
    # constant_liar: trials asked together (autotune's batches, make tune's workers) are spread
    # apart instead of drawn from one density; it changes nothing for one trial at a time.
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=startup_trials, multivariate=True, constant_liar=True,
        **({"constraints_func": _constraints}
           if objective in CONSTRAINED and not _has_set_constraint() else {}))


def open_study(name: str, url: str, objective: str, seed: int | None = None, startup_trials: int = 4):
    """Create the study, or join it when another worker made it already."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(study_name=name, storage=_storage(url), load_if_exists=True,
                               directions=directions(objective),
                               sampler=sampler_for(objective, seed, startup_trials))


def load_study(name: str, url: str):
    """An existing study (for reports), without a sampler."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=_storage(url))


@dataclass
class TuneSettings:
    """What a search needs besides its scenario: the space, the objective and where things live."""

    experiment_id: str
    space: SearchSpace
    objective: str = "goodput"
    trials: int = 20
    storage: str = ""
    seed: int | None = None
    startup_trials: int = 4
    plan: dict[str, Any] | None = None  # the command's recorded plan (commands.plan_record)
    reference: dict[str, Any] | None = None  # vLLM's defaults of the space's flags


def tune_meta(settings: TuneSettings) -> dict[str, Any]:
    """The experiment's meta: what the report needs to find the study and label its axes, the
    reference the trials are read against, and the plan a resume restores."""
    return {"params": list(settings.space.space), "objective": settings.objective,
            "space": {k: v.model_dump(exclude_none=True) for k, v in settings.space.space.items()},
            "study": settings.experiment_id, "storage": settings.storage,
            "reference": settings.reference, **({"made_by": settings.plan} if settings.plan else {})}


def measure_reference(scenario: Scenario, settings: TuneSettings, backend: Backend,
                      store_path: Path, workdir: Path, host: str | None = None) -> None:
    """vLLM's defaults of the space's flags, measured once as a run of the search's experiment
    (not a trial: the study learns only from what it asked), so every trial is read against
    them; already recorded on a resume or by another worker."""
    if settings.reference is None:
        return
    plan = plans.Plan(settings.experiment_id, "tune",
                      _points(scenario, settings.reference, scenario.run.repeats), tune_meta(settings))
    plans.execute(plan, backend, store_path, workdir, [host])


def run_trials(scenario: Scenario, settings: TuneSettings, backend: Backend, store_path: Path,
               workdir: Path, hosts: Sequence[str | None] = (None,),
               on_trial: Callable[[int, dict, dict], None] | None = None) -> dict[str, int]:
    """Run ``settings.trials`` trials per host (one thread each) and return counts by state.

    Each trial is a one-point plan: the run lands in the store, a configuration already measured
    in this experiment (asked again by the sampler, or by another worker) is read back, not rerun.
    """
    study = open_study(settings.experiment_id, settings.storage, settings.objective, settings.seed,
                       settings.startup_trials)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def work(host: str | None) -> None:
        for _ in range(settings.trials):
            state = _one_trial(study, scenario, settings, backend, store_path, workdir, host, on_trial)
            with lock:
                counts[state] = counts.get(state, 0) + 1

    if len(hosts) <= 1:
        work(hosts[0] if hosts else None)
        return counts
    threads = [threading.Thread(target=work, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)  # wake for Ctrl-C
    return counts


def _one_trial(study, scenario: Scenario, settings: TuneSettings, backend: Backend, store_path: Path,
               workdir: Path, host: str | None, on_trial) -> str:
    from optuna.trial import TrialState

    trial = study.ask()
    try:
        values = suggest(trial, settings.space)
        point = _point(scenario, values)
        plan = plans.Plan(settings.experiment_id, "tune", [point], tune_meta(settings))
        plans.execute(plan, backend, store_path, workdir, [host])
        run = _run(store_path, settings.experiment_id, point.key)
    except BaseException:
        study.tell(trial, state=TrialState.FAIL)  # never leave a trial RUNNING
        raise
    trial.set_user_attr("run_key", point.key)
    trial.set_user_attr("status", run["status"])
    trial.set_user_attr("host", run["host"])
    if run["status"] == "ok":
        violation = slo_violation(run["summary"], point.scenario)
        violation = violation if math.isfinite(violation) else 1e9
        trial.set_user_attr("slo_violation", violation)
        if settings.objective in (*CONSTRAINED, "pareto") and _has_set_constraint():
            trial.set_constraint("slo", violation)
        result = objective_values(run["summary"], settings.objective, point.scenario)
        study.tell(trial, result if len(result) > 1 else result[0])
        state = "complete"
    else:
        trial.set_user_attr("cause", run["status"])
        trial.set_user_attr("error", (run["error"] or "").splitlines()[0][:300] if run["error"] else "")
        trial.set_user_attr("slo_violation", 1e9)
        failed = TrialState.PRUNED if run["status"] in CONFIG_FAILURES else TrialState.FAIL
        study.tell(trial, state=failed)
        state = "pruned" if failed == TrialState.PRUNED else "failed"
    if on_trial:
        on_trial(trial.number, values, {"state": state, **run})
    return state


def _point(scenario: Scenario, values: dict[str, Any]) -> plans.Point:
    s = scenario
    for param, value in values.items():
        s = plans.apply_value(s, param, value)
    return plans.Point(s, dict(values), 0)


def _run(store_path: Path, experiment_id: str, key: str) -> dict[str, Any]:
    """The stored run of one trial: status, error, host and the summary (columns + json)."""
    with Store(store_path) as store:
        runs = store.runs(experiment_id)
    row = runs[runs["run_key"] == key].iloc[-1]
    return {"status": row["status"], "error": row["error"], "host": row["host"],
            "summary": RunSummary.of_row(row)}


# -- the best configurations ----------------------------------------------------------------------


def scenario_file(scenario: dict[str, Any], params: dict[str, Any], note: str) -> str:
    """A ready scenario file (YAML) for the given resolved scenario with ``params`` applied."""
    body = {k: v for k, v in scenario.items() if k not in ("name", "sources")}
    body["description"] = note
    body["serve"] = {**body["serve"], **{k: v for k, v in params.items() if plans.is_serve_flag(k)}}
    for param, value in params.items():
        if not plans.is_serve_flag(param):
            node = body
            *parents, leaf = param.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
    header = (f"# {note}\n# Use it as it is: make baseline SCENARIO=<this file>; its serve: section is "
              f"also a vLLM --config file.\n")
    return header + yaml.safe_dump(body, sort_keys=False)


def confirm_points(scenario: Scenario, configs: list[dict[str, Any]]) -> list[plans.Point]:
    """The best configurations of a pre-screen, as points to measure on a live backend."""
    return [plans.Point(_point(scenario, c).scenario, c, r) for c in configs
            for r in range(scenario.run.repeats)]


def objective_label(objective: str) -> str:
    """Words for an objective, for reports and progress lines."""
    return {"goodput": "goodput (req/s meeting every SLO)",
            "throughput": "output tokens/s subject to the SLO",
            "pareto": "output tokens/s vs the SLO's latency (NSGA-II)",
            "energy": "output tokens per joule subject to the SLO"}[objective]

