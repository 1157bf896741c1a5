"""One command's experiment: its id, its store, its points, its backend, resume and the deadline.

Every long command (baseline, sweep, combo, tune, stress, claims, calibrate) is built here as an
``Experiment`` (the scenario, the plan's points, the backend, the store) and taken by ``run()``;
the command line only parses, calls one function of this module and prints what it returns.

A ``Deadline`` is a time the lab must stop by (a GPU reservation that ends): no point is started
whose expected time (its server start and its run, from the plan's duration and start timeout
until this experiment has measured them on this host) would end past it, a run still going when
it is near is stopped, the servers are stopped, and the command exits ``EXIT_DEADLINE`` with the
command that resumes it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lab import lint as lint_mod
from vllm_lab import plans, progress, scenarios, serving, stats
from vllm_lab.backends import Backend
from vllm_lab.deadline import (
    EXIT_DEADLINE,
    RUN_OVERHEAD_S,
    Deadline,
    DeadlineError,
    DeadlineGuard,
    DeadlineReached,
    Timing,
    Watchdog,
)
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store, StoreError, check_experiment_name, experiment_dir

__all__ = ["EXIT_DEADLINE", "RUN_OVERHEAD_S", "Deadline", "DeadlineError", "Timing", "Watchdog"]


def store_path(out: Path, store: Path | None = None) -> Path:
    """The store a command reads and writes: STORE if given, else OUT/lab.db."""
    return store or Path(out) / "lab.db"


@contextmanager
def watched(deadline: Deadline | None, backend: Backend, shown: progress.Progress) -> Iterator[Watchdog]:
    """The block a long command takes its runs in: the progress drawn, a Watchdog armed for the
    deadline (disarmed once a DeadlineGuard stops), and the Ctrl-C the watchdog sends raised as
    DeadlineReached; a Ctrl-C of the user's stays a KeyboardInterrupt."""
    with Watchdog(deadline, getattr(backend, "margin", 0.0)) as watch, progress.tracking(shown):
        if isinstance(backend, DeadlineGuard):
            backend.on_stop = watch.disarm
        try:
            yield watch
        except KeyboardInterrupt:
            if not watch.fired.is_set():
                raise
            raise DeadlineReached("") from None


# -- what a command runs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a command's scenario comes from: a scenario, a hardware preset and overrides."""

    scenario: str = "default"
    hardware: str | None = None
    overrides: tuple[str, ...] = ()

    def resolve_checked(self) -> Scenario:
        """Resolve the scenario and stop on lint errors: nothing is launched with a refused flag."""
        layers = scenarios.load_layers(self.scenario, self.hardware, list(self.overrides))
        scenario = scenarios.validate(layers)
        errors = [f for f in lint_mod.lint(scenario, layers) if f.severity == "error"]
        if errors:
            raise scenarios.ScenarioError(f"{errors[0]} (make lint SCENARIO={self.scenario} lists all)")
        return scenario


@dataclass(frozen=True)
class Settings:
    """How a command takes its runs: backend, inventory, folders, resume, the deadline."""

    backend: str = "twin"
    inventory: Path = Path("inventory/local.yml")
    out: Path = Path("reports")
    store: Path | None = None
    experiment: str | None = None
    resume: bool = False
    repeats: int | None = None
    spread: bool = False
    loadgen_processes: int | None = None
    deadline: Deadline | None = None
    live_host: str | None = None  # LIVE=1: Locust's web UI for the run in flight, bound here
    precision: Precision | None = None  # PRECISION=: repeat each point until this precise
    # The exact command that resumes an experiment, as the user would type it: given its id, and
    # make variables to change (TRIALS=<left>).
    resume_command: Callable[..., str] = field(
        default=lambda exp_id, **changes: f"make ... RESUME=1 EXPERIMENT={exp_id}", compare=False)

    @property
    def store_path(self) -> Path:
        """The store file (STORE, else OUT/lab.db)."""
        return store_path(self.out, self.store)

    def hosts(self) -> list[str | None]:
        """Every inventory host with SPREAD, else the one default host."""
        return serving.serve_hosts(self.inventory) if self.spread else [None]


def experiment_name(step: str, scenario: Scenario, param: str | None = None) -> str:
    """A readable experiment id: step, scenario, parameter and the time.

    The scenario's name is free text (a file may set any ``name:``); it is cut down to the store's
    experiment name pattern, so the id is always a single folder name inside OUT.
    """
    middle = "-".join([scenario.name] + ([param] if param else []))
    middle = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", middle)).strip("-.") or "scenario"
    stamp = time.strftime("-%Y%m%d-%H%M%S")
    return f"{step}-{middle}"[: 120 - len(stamp)].rstrip("-.") + stamp


_STAMP = len("-YYYYmmdd-HHMMSS")


def experiment_id(settings: Settings, step: str, scenario: Scenario, param: str | None = None) -> str:
    """EXPERIMENT if given; with RESUME the newest experiment of this step, scenario and param;
    else a new name, made unique in the store (two commands started in the same second)."""
    if settings.experiment:
        return settings.experiment
    name = experiment_name(step, scenario, param)
    if not settings.store_path.exists():  # asking must not create the store: a bad input writes nothing
        if settings.resume:
            raise StoreError(f"{settings.store_path}: nothing to resume for {name[:-_STAMP]}; "
                             f"run without RESUME=1")
        return check_experiment_name(name)
    with Store(settings.store_path) as store:
        if settings.resume:
            newest = store.newest_experiment(name[:-_STAMP] + "-")
            if newest is None:
                raise StoreError(f"{settings.store_path}: nothing to resume for {name[:-_STAMP]}; "
                                 f"run without RESUME=1")
            return newest
        taken = set(store.experiments()["id"])
    unique, n = name, 2
    while unique in taken:
        unique, n = f"{name}-{n}", n + 1
    return check_experiment_name(unique)


def make_backend(settings: Settings, experiment: str = "") -> Backend:
    """The backend that measures the points: the predictor, or live servers (provisioned first)."""
    import os

    from vllm_lab.backends import LiveBackend, PredictBackend
    if settings.backend == "predict":
        return PredictBackend()
    serving.check_inventory(settings.inventory)  # a bad inventory is refused before anything runs
    # Idempotent: on a provisioned host this changes nothing and takes a few seconds. It claims
    # the instances first: another lab process's are refused (InstanceBusy) before any change.
    print(f"provisioning {settings.inventory} (playbooks/provision.yml)", flush=True)
    try:
        serving.provision(settings.inventory, experiment=experiment)
    except RuntimeError as e:
        raise StoreError(f"{settings.inventory}: hosts could not be provisioned: {e}") from None
    return LiveBackend(settings.backend, settings.inventory,
                       api_key=os.environ.get("VLLM_API_KEY") or None,
                       processes=settings.loadgen_processes, experiment=experiment,
                       live_host=settings.live_host)


def guarded_backend(settings: Settings, exp_id: str) -> Backend:
    """The experiment's backend, behind a DeadlineGuard when DEADLINE is set (its expected times
    from this experiment's runs already in the store)."""
    backend = make_backend(settings, exp_id)
    if settings.deadline is None:
        return backend
    return DeadlineGuard(backend, settings.deadline,
                         Timing.from_store(settings.store_path, exp_id, backend.name))


def _identity(point: plans.Point) -> str:
    """A point apart from its repeat index."""
    return dataclasses.replace(point, repeat=0).key


# The metrics PRECISION may name, and the short names it takes for them.
PRECISION_METRICS = ("output_throughput", "request_throughput", "goodput", "ttft_p50", "tpot_p50",
                     "itl_p50", "e2e_p50", "ttft_p99", "tpot_p99", "e2e_p99")
_PRECISION_ALIASES = {"throughput": "output_throughput", "ttft": "ttft_p50", "tpot": "tpot_p50",
                      "itl": "itl_p50", "e2e": "e2e_p50"}


class PrecisionError(ValueError):
    """A PRECISION the lab cannot take."""


@dataclass(frozen=True)
class Precision:
    """How narrow each point's 95% intervals must be (half-width over the mean, per metric), and
    the most runs a point may take to get there."""

    targets: dict[str, float] = field(default_factory=lambda: {
        "output_throughput": 0.02, "ttft_p50": 0.05, "tpot_p50": 0.05})
    max_repeats: int = 10
    min_repeats: int = 3  # two runs give a t-interval 12.7 standard errors wide

    @classmethod
    def parse(cls, text: str) -> Precision:
        """``default`` (or 1/on), or items like ``throughput=2%,ttft=5%,max=8``."""
        rule = ("write PRECISION=default (±2% throughput, ±5% TTFT and TPOT p50, at most 10 runs) "
                "or items like throughput=2%,ttft_p50=5%,max=8 (metrics: "
                + ", ".join(PRECISION_METRICS) + ")")
        if text.strip().lower() in ("default", "1", "on", "yes", "true"):
            return cls()
        targets, cap = {}, cls.max_repeats
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, sep, value = item.partition("=")
            name = _PRECISION_ALIASES.get(name.strip(), name.strip())
            try:
                if name == "max" and sep:
                    cap = int(value)
                    if cap < 2:
                        raise ValueError
                    continue
                share = float(value.strip().removesuffix("%")) / (100 if value.strip().endswith("%") else 1)
            except ValueError:
                raise PrecisionError(f"PRECISION={text!r}: {item!r} is not allowed; {rule}") from None
            if not sep or name not in PRECISION_METRICS or not 0 < share < 1:
                raise PrecisionError(f"PRECISION={text!r}: {item!r} is not allowed; {rule}")
            targets[name] = share
        if not targets:
            raise PrecisionError(f"PRECISION={text!r} names no metric; {rule}")
        return cls(targets=targets, max_repeats=cap, min_repeats=min(cls.min_repeats, cap))

    def judge(self, runs, base: dict[str, plans.Point], rounds: int) -> dict[str, dict]:
        """Each point's interval half-widths (share of the mean) over its ok runs so far, and
        whether every one is within its target."""
        out = {}
        for i, point in base.items():
            keys = {dataclasses.replace(point, repeat=r).key for r in range(rounds)}
            mine = runs[runs["run_key"].isin(keys) & (runs["status"] == "ok")]
            verdict: dict[str, Any] = {"runs": len(mine)}
            for m in self.targets:
                values = [float(v) for v in mine[m]] if m in mine else \
                    [float(x[m]) for x in mine["summary"] if x.get(m) is not None]
                verdict[m] = stats.mean_ci(values).relative
                verdict[f"{m}_cv"] = stats.cv(values)
            verdict["reached"] = all(verdict[m] <= t for m, t in self.targets.items())
            out[i] = verdict
        return out

    def noise(self, reached: dict[str, dict]) -> dict[str, float]:
        """The host's run-to-run spread: the median CV over points, per metric."""
        out = {}
        for m in self.targets:
            cvs = [v[f"{m}_cv"] for v in reached.values() if not math.isnan(v[f"{m}_cv"])]
            if cvs:
                out[m] = statistics.median(cvs)
        return out


def _runs_of(path: Path, exp_id: str):
    with Store(path) as st:
        return st.runs(exp_id)


def lint_notes(points: Sequence[plans.Point], say: Callable[[str], Any] = print) -> None:
    """A value vLLM would refuse is still a data point: it is measured (and recorded as refused).
    Each distinct scenario is linted once, however many repeats it has."""
    seen: set[str] = set()
    for point in points:
        if point.serve_key in seen:
            continue
        seen.add(point.serve_key)
        for f in lint_mod.lint(point.scenario):
            if f.severity == "error":
                say(f"  note: {progress.point_label(point.values)}: {f.message}")


@dataclass
class Experiment:
    """The runs of one command: its id and step, the scenario, the plan's points and the settings."""

    id: str
    step: str
    scenario: Scenario
    points: list[plans.Point]
    meta: dict[str, Any]
    settings: Settings

    @classmethod
    def build(cls, settings: Settings, step: str, scenario: Scenario, points: list[plans.Point],
              meta: dict[str, Any], param: str | None = None) -> Experiment:
        """The experiment for these points, its id named (or found, to resume) in the store."""
        return cls(experiment_id(settings, step, scenario, param), step, scenario, points, meta, settings)

    def todo(self) -> list[plans.Point]:
        """The points a run would take: those not in the store yet, and those a resume retries
        (store.RETRIED_ON_RESUME)."""
        with Store(self.settings.store_path) as store:
            done = store.finished_keys(self.id)
        return [p for p in self.points if p.key not in done]

    def run(self, say: Callable[[str], Any] = print) -> int:
        """Take the points not yet recorded, build the report; 0, 130 on Ctrl-C, or
        EXIT_DEADLINE when the deadline stopped it."""
        from vllm_lab import reports as report
        s = self.settings
        if s.backend == "predict":
            from vllm_lab.backends import PredictBackend
            for point in self.points:
                PredictBackend.check(point.scenario)  # every point, before the first is taken
        plan = plans.Plan(self.id, self.step, self.points, self.meta)
        hosts = s.hosts()
        shown = progress.Progress(self.step, self.id, s.backend, s.out,
                                  window_s=self.points[0].scenario.load.stop.duration_s)
        backend = guarded_backend(s, self.id)
        try:
            with watched(s.deadline, backend, shown):
                if s.precision is None:
                    counts = plans.execute(plan, backend, s.store_path, s.out / ".work", hosts,
                                           progress=shown)
                else:
                    counts = self.take_to_precision(backend, hosts, shown, say)
        except DeadlineReached:
            return self.stopped_for_deadline()
        except KeyboardInterrupt:
            print(f"lab: interrupted; finished runs are kept. Continue with: make {self.step} ... "
                  f"RESUME=1 EXPERIMENT={self.id}", file=sys.stderr)
            return 130
        index = report.build(s.store_path, self.id, s.out)
        say(f"runs taken now: {counts or 'none (all were already recorded)'}")
        progress.closing_table(_runs_of(s.store_path, self.id))
        say(f"report: {index}")
        return 0

    def take_to_precision(self, backend: Backend, hosts: Sequence[str | None],
                          shown: progress.Progress, say: Callable[[str], Any]) -> dict[str, int]:
        """Repeat each point, round after round, until its intervals are as narrow as PRECISION
        asks or the cap is hit; round r takes the r-th repeat of every point still open, so a
        drift of the host over time lands on every point alike instead of passing for an effect."""
        s, target = self.settings, self.settings.precision
        base: dict[str, plans.Point] = {}
        for point in self.points:
            base.setdefault(_identity(point), dataclasses.replace(point, repeat=0))
        planned = max(max(p.repeat for p in self.points) + 1, target.min_repeats)
        counts: dict[str, int] = {}
        still, reached = list(base), {}
        for r in range(target.max_repeats):
            round_points = [dataclasses.replace(base[i], repeat=r) for i in still]
            plan = plans.Plan(self.id, self.step, round_points, self.meta)
            for status, n in plans.execute(plan, backend, s.store_path, s.out / ".work", hosts,
                                           progress=shown).items():
                counts[status] = counts.get(status, 0) + n
            if r + 1 < planned:
                continue
            reached = target.judge(_runs_of(s.store_path, self.id), base, r + 1)
            still = [i for i in still if not reached[i]["reached"]]
            if not still:
                break
        self._record_precision(base, reached, say)
        return counts

    def _record_precision(self, base: dict[str, plans.Point], reached: dict[str, dict],
                          say: Callable[[str], Any]) -> None:
        """Say which points reached the precision and which hit the cap; keep it, with the host's
        run-to-run noise, in the experiment's meta."""
        target = self.settings.precision
        for i, verdict in reached.items():
            widths = ", ".join(f"±{verdict[m]:.1%} {m}" for m in target.targets if m in verdict)
            how = "reached" if verdict["reached"] else f"cap of {target.max_repeats} runs hit"
            say(f"precision {how}: {progress.point_label(base[i].values)}: {widths} "
                f"after {verdict['runs']} runs")
        noise = target.noise(reached)
        with Store(self.settings.store_path) as store:
            store.update_meta(self.id, precision={"targets": target.targets,
                                                  "max_repeats": target.max_repeats,
                                                  "points": {progress.point_label(base[i].values): v
                                                             for i, v in reached.items()}},
                              host_noise_cv=noise)
        if noise:
            say("host noise (run-to-run CV, median over points): "
                + ", ".join(f"{m} {v:.1%}" for m, v in noise.items()))

    def stopped_for_deadline(self) -> int:
        """One sentence on stderr (done, left, the command that resumes) and EXIT_DEADLINE."""
        todo = self.todo()
        left = {p.key for p in todo}
        # The work folders of runs now in the store go; an interrupted run's are kept for a look.
        work = self.settings.out / ".work" / self.id
        for point in self.points:
            if point.key not in left:
                shutil.rmtree(work / point.key, ignore_errors=True)
        left = len(todo)
        stopped = ", servers stopped" if self.settings.backend != "predict" else ""
        print(f"lab: stopped for DEADLINE={self.settings.deadline}: {len(self.points) - left} of "
              f"{len(self.points)} runs done, {left} left{stopped}; resume with: "
              f"{self.settings.resume_command(self.id)}", file=sys.stderr)
        return EXIT_DEADLINE


# -- the commands ----------------------------------------------------------------------------------

def baseline(settings: Settings, source: Source) -> int:
    """vLLM's defaults on the scenario's traffic, repeated: the reference later steps compare with."""
    scenario = source.resolve_checked()
    repeats = settings.repeats or max(3, scenario.run.repeats)
    return Experiment.build(settings, "baseline", scenario, plans.baseline_points(scenario, repeats),
                            {"repeats": repeats}).run()


def sweep(settings: Settings, source: Source, param: str, values_text: str | None) -> int:
    """One flag over a ladder of values (VALUES, else a ladder for the hardware)."""
    scenario = source.resolve_checked()
    values, points = plans.sweep_plan(scenario, param, values_text, settings.repeats or scenario.run.repeats)
    lint_notes(points)
    return Experiment.build(settings, "sweep", scenario, points, {"param": param, "values": values},
                            param).run()


def combo(settings: Settings, source: Source, params_text: str | None, grid_text: str | None) -> int:
    """A grid of 2-3 flags: every combination, failures as data, resumable and spreadable."""
    from vllm_lab import search
    scenario = source.resolve_checked()
    params = [p.strip() for p in (params_text or "").split(",")]
    for param in [item.partition("=")[0] for item in (grid_text or "").split()] + params:
        if param:
            plans.check_param(param, scenario, "PARAMS" if param in params else "GRID")
    grid = search.parse_grid(grid_text, params_text, scenario)
    points = search.combo_points(scenario, grid, settings.repeats or scenario.run.repeats)
    lint_notes(points)
    return Experiment.build(settings, "combo", scenario, points, {"params": list(grid), "grid": grid},
                            "-".join(grid)).run()


def calibrate(settings: Settings, source: Source, fit_only: bool = False,
              profile_out: Path | None = None, reference: Sequence[Path] = ()) -> int:
    """Run the calibration plan on the backend, then fit a twin profile to it."""
    from vllm_lab import calibrate as calibrate_mod
    from vllm_lab.models import load_model_shape
    from vllm_lab.twin.profile import load_profile

    scenario = source.resolve_checked()
    if not fit_only:
        rc = Experiment.build(settings, "calibrate", scenario, calibrate_mod.calibration_points(scenario),
                              {"params": ["point"]}, "calibrate").run()
        if rc:
            return rc
    exp_id = experiment_id(dataclasses.replace(settings, resume=True), "calibrate", scenario, "calibrate")
    if fit_only:
        scenario = Scenario.model_validate_json(_first_run_scenario(settings.store_path, exp_id))
    # The profile keeps its own hardware block (the GPU it was measured on, up to 8 per host).
    base = load_profile(scenario.hardware.twin_profile)
    model = load_model_shape(str(scenario.serve["model"]))
    out = profile_out or experiment_dir(settings.out, exp_id) / f"{scenario.hardware.gpu}-{model.name}.yaml"
    profile, rows = calibrate_mod.fit(settings.store_path, exp_id, base.model_copy(
        update={"name": out.stem, "model": model.name}), model, out, list(reference))
    for row in rows:
        print(f"  {row['point']:6s} {row['metric']:18s} measured {row['measured']:9.2f} "
              f"twin {row['predicted']:9.2f} {row['error']:+7.1%}")
    print(f"profile: {out} (median errors {profile.provenance.errors})")
    return 0


def _first_run_scenario(path: Path, exp_id: str) -> str:
    with Store(path) as store:
        runs = store.runs(exp_id)
    if runs.empty:
        raise StoreError(f"{path}: experiment {exp_id} has no runs to fit")
    return str(runs.iloc[0]["scenario_json"])


@dataclass(frozen=True)
class TuneOptions:
    """The study: trials, objective, space, storage, seed; CONFIRM re-measures the best live."""

    trials: int = 20
    objective: str = "goodput"
    space: str | None = None
    study_storage: str | None = None
    seed: int | None = None
    startup_trials: int = 4
    confirm: int = 0
    confirm_backend: str = "twin"


def tune(settings: Settings, source: Source, options: TuneOptions) -> int:
    """Optuna over a declared space; each trial is a run in the store; CONFIRM re-measures the best live."""
    from vllm_lab import reports as report
    from vllm_lab import search
    from vllm_lab.analysis.search import best_configs
    scenario = source.resolve_checked()
    space = search.load_space(options.space, scenario)
    exp_id = experiment_id(settings, "tune", scenario)
    tune_settings = search.TuneSettings(
        exp_id, space, options.objective, options.trials,
        search.storage_url(options.study_storage, settings.store_path), options.seed,
        options.startup_trials)
    hosts = settings.hosts()
    print(f"tune: study {exp_id}, {options.trials} trial(s) per host on {len(hosts)} host(s), backend "
          f"{settings.backend}, objective {search.objective_label(options.objective)}, space "
          f"{', '.join(space.space)}")

    shown = progress.Progress("tune", exp_id, settings.backend, settings.out, noun="trial",
                              window_s=scenario.load.stop.duration_s)
    shown.expect(options.trials * len(hosts))

    def on_trial(number, values, run):
        shown.point_done({"trial": number, **values}, 0, run["status"], run["summary"],
                         run["error"] or "")
        done.append(number)

    done: list[int] = []
    backend = guarded_backend(settings, exp_id)
    try:
        with watched(settings.deadline, backend, shown):
            with _quiet_deadline_in_threads():
                counts = search.run_trials(scenario, tune_settings, backend, settings.store_path,
                                           settings.out / ".work", hosts, on_trial)
            if getattr(backend, "stopped", False):
                raise DeadlineReached("")  # SPREAD: the hosts' threads stopped, the study did not say
    except DeadlineReached:
        total = options.trials * len(hosts)
        per_host = max(1, -(-(total - len(done)) // len(hosts)))  # TRIALS counts per host
        print(f"lab: stopped for DEADLINE={settings.deadline}: {len(done)} of {total} trials done, "
              f"{total - len(done)} left{', servers stopped' if settings.backend != 'predict' else ''}; "
              f"resume with: {settings.resume_command(exp_id, TRIALS=per_host)}", file=sys.stderr)
        return EXIT_DEADLINE
    except KeyboardInterrupt:
        print(f"lab: interrupted; finished trials are kept. Continue with: make tune EXPERIMENT={exp_id}",
              file=sys.stderr)
        return 130
    print(f"trials taken now: {counts}")
    print(f"report: {report.build(settings.store_path, exp_id, settings.out)}")
    if options.confirm:
        study = search.load_study(exp_id, tune_settings.storage)
        configs = best_configs(study, options.confirm, options.objective)
        if not configs:
            print("confirm: no trial met the SLO; nothing to confirm")
            return 0
        confirm = dataclasses.replace(settings, backend=options.confirm_backend,
                                      experiment=f"{exp_id}-confirm", resume=False)
        return Experiment.build(confirm, "tune", scenario, search.confirm_points(scenario, configs),
                                {"params": list(space.space), "confirms": exp_id}).run()
    return 0


@contextmanager
def _quiet_deadline_in_threads():
    """A host's trial thread that ends on DeadlineReached ends as planned: no traceback for it."""
    previous = threading.excepthook

    def hook(args):
        if not isinstance(args.exc_value, DeadlineReached):
            previous(args)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def stress(settings: Settings, source: Source, shape: str, levels_text: str | None, refine: int) -> int:
    """Ramp/step: a staircase of open-loop levels and its knee; spike/soak: one run as a time series."""
    from vllm_lab import stress as stress_mod
    from vllm_lab.analysis.stress import levels_table
    scenario = stress_mod.stress_scenario(source.resolve_checked(), shape)
    if shape in ("spike", "soak"):
        if shape == "spike" and settings.backend == "predict":
            raise scenarios.ScenarioError("SHAPE=spike needs a live backend (BACKEND=twin or vllm): "
                                          "the predictor runs constant loads only")
        return Experiment.build(settings, "stress", scenario, stress_mod.single_points(scenario),
                                {"shape": shape}, shape).run()
    levels = stress_mod.staircase_levels(scenario, plans.parse_values("load.shape.level", levels_text)
                                         if levels_text else None)
    meta = {"shape": shape, "params": ["load.shape.level"]}
    repeats = settings.repeats or scenario.run.repeats
    fixed = dataclasses.replace(settings, experiment=experiment_id(settings, "stress", scenario, shape))

    def read_levels():
        with Store(fixed.store_path) as store:
            return levels_table(store, fixed.experiment, store.runs(fixed.experiment))

    stopped: list[int] = []

    def take(points: list[plans.Point]) -> int:
        # Once stopped (the deadline, Ctrl-C), a later refinement round takes nothing and says nothing.
        if stopped:
            return stopped[0]
        rc = Experiment.build(fixed, "stress", scenario, points, meta, shape).run()
        stopped.extend([rc] if rc else [])
        return rc

    # A ramp zooms into the knee in the same experiment; a step keeps its levels.
    return stress_mod.run_staircase(scenario, levels, refine if shape == "ramp" else 0, take,
                                    read_levels, repeats)


def claims(settings: Settings, source: Source, selection: str | None) -> int:
    """The guide's claims, each measured by its experiment, with a verdict table."""
    from vllm_lab import claims as claims_mod
    base = source.resolve_checked()
    try:
        selected = claims_mod.parse_selection(selection)
    except ValueError as e:
        raise scenarios.ScenarioError(str(e)) from None
    points = claims_mod.points(base, selected, settings.repeats or 1)
    if not points:
        print(f"claims {selected}: nothing to measure here (claim 7 is not testable on vLLM "
              f"{base.vllm_version})")
        return 0
    return Experiment.build(settings, "claims", base, points, {"base": base.to_record()}).run()


def newest_experiment(path: Path) -> str:
    """The newest experiment in the store, or StoreError saying there is none yet."""
    with Store(path) as store:
        newest = store.newest_experiment()
    if newest is None:
        raise StoreError(f"{path}: no experiments yet; run make baseline or make sweep first")
    return newest



# -- autotune --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AutotuneOptions:
    """What make autotune takes beyond the common settings."""

    gpu_minutes: float = 20.0
    trials: int = 20
    space: str | None = None
    seed: int | None = None
    top: int | None = None


def autotune(settings: Settings, source: Source, options: AutotuneOptions) -> int:
    """Search on the predictor by SLO capacity, measure the defaults and the best few within
    GPU_MINUTES and before DEADLINE; 0, 130 on Ctrl-C, or EXIT_DEADLINE with the resume command."""
    from vllm_lab import autotune as tuning
    from vllm_lab import search
    if settings.spread:
        raise scenarios.ScenarioError("SPREAD=1 is not supported by autotune: its candidates are measured one "
                            "after another on one host")
    scenario = source.resolve_checked()
    space = tuning.load_space(options.space, scenario)
    storage = search.storage_url(None, settings.store_path)
    exp_id = settings.experiment or experiment_name("autotune", scenario)
    if settings.resume and not settings.experiment:
        prefix = experiment_name("autotune", scenario)[: -len("YYYYmmdd-HHMMSS")]
        exp_id = tuning.newest_study(storage, prefix) or ""
        if not exp_id:
            raise StoreError(f"{settings.store_path}: nothing to resume for {prefix[:-1]}; run "
                             f"without RESUME=1")
    # A DURATION given on the command line sets the staircase's levels; else the backend's default.
    step_s = scenario.load.stop.duration_s if any(
        o.startswith("load.stop.duration_s=") for o in source.overrides) else None
    tune_settings = tuning.Settings(exp_id, settings.store_path, settings.out, storage,
                                    options.gpu_minutes, trials=options.trials, seed=options.seed,
                                    top=options.top, step_s=step_s, repeats=settings.repeats or 1)
    backend = guarded_backend(settings, exp_id)
    shown = progress.Progress("autotune", exp_id, settings.backend, settings.out, noun="level",
                              window_s=step_s or tuning.measuring(settings.backend).step_s)
    try:
        with watched(settings.deadline, backend, shown):
            summary = tuning.run(scenario, space, backend, tune_settings, progress=shown)
    except DeadlineReached:
        summary = tuning.build_report(settings.store_path, exp_id, settings.out, storage)
        print(f"lab: stopped for DEADLINE={settings.deadline}: {summary['gpu_minutes']:.1f} of "
              f"GPU_MINUTES={options.gpu_minutes:g} spent, servers stopped; what was measured is "
              f"kept and reported; resume with: {settings.resume_command(exp_id)}", file=sys.stderr)
        return EXIT_DEADLINE
    except KeyboardInterrupt:
        print(f"lab: interrupted; finished runs are kept. Continue with: "
              f"{settings.resume_command(exp_id)}", file=sys.stderr)
        return 130
    print(f"autotune: {summary['verdict']}")
    print(f"report: {experiment_dir(settings.out, exp_id) / 'report.md'}")
    return 0
