"""The lab's command line: parse, call one function, print. The Makefile calls this."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sqlite3
import sys
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import yaml

from vllm_lab import lint as lint_mod
from vllm_lab import plans, scenarios, serving
from vllm_lab.flags import redact
from vllm_lab.monitor import MonitorError
from vllm_lab.store import (
    EXPERIMENT_NAME_RULE,
    StoreError,
    check_experiment_name,
    describe_sqlite_error,
    experiment_dir,
)
from vllm_lab.watch import WatchError


class UsageError(Exception):
    """A command line (or a make variable) the lab cannot take; the message is one sentence."""


class LabParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing its usage and exiting."""

    def error(self, message: str):
        """argparse's hook for a bad command line."""
        raise UsageError(message)


def _count(minimum: int):
    """An argparse type: a whole number of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a whole number, "
                                             f"{minimum} or more")
        return value
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a number of seconds, 0 or more")
    return value


def _experiment(text: str) -> str:
    """An argparse type: an experiment name (the store's one pattern)."""
    try:
        return check_experiment_name(text)
    except StoreError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an experiment name: use "
                                          f"{EXPERIMENT_NAME_RULE}") from None


def _scenario_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="default", help="scenario name or file")
    p.add_argument("--hardware", default=None, help="hardware preset name or file (default h200)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one key, e.g. serve.max-num-seqs=128")


def cmd_lint(args: argparse.Namespace) -> int:
    """Lint one scenario, or every shipped one with --all; exit 1 on any error."""
    names = _all_scenario_names() if args.all else [args.scenario]
    failed = False
    for name in names:
        layers = scenarios.load_layers(name, args.hardware, args.overrides)
        scenario = scenarios.validate(layers)
        if args.vllm_version:
            scenario = scenario.model_copy(update={"vllm_version": args.vllm_version})
        findings = lint_mod.lint(scenario, layers)
        print(f"{name}: " + (f"{len(findings)} finding(s)" if findings else "ok"))
        for finding in findings:
            print(f"  {finding}")
        # The guide/ templates are kept as the guide wrote them; with --all their findings are
        # the worked example, not a failure.
        as_written = args.all and name.startswith("guide/")
        failed |= not as_written and any(f.severity == "error" for f in findings)
    return 1 if failed else 0


def _all_scenario_names() -> list[str]:
    guide = sorted((scenarios.SCENARIO_DIR / "guide").glob("*.yaml"))
    return scenarios.available()["scenarios"] + [f"guide/{p.stem}" for p in guide]


def cmd_show(args: argparse.Namespace) -> int:
    """Print the resolved scenario as YAML: what a run would record."""
    scenario = scenarios.resolve(args.scenario, args.hardware, args.overrides)
    print(yaml.safe_dump(redact(scenario.to_record()), sort_keys=False), end="")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    _scenario_args(p)
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--backend", choices=("twin", "vllm", "predict"), default="twin")
    p.add_argument("--out", type=Path, default=Path("reports"), help="reports folder")
    p.add_argument("--store", type=Path, default=None, help="store file (default OUT/lab.db)")
    p.add_argument("--experiment", type=_experiment, default=None,
                   help="experiment id (to resume or name it)")
    p.add_argument("--resume", action="store_true", help="continue the experiment (or the newest alike)")
    p.add_argument("--repeats", type=_count(1), default=None, help="runs per point")
    p.add_argument("--spread", action="store_true", help="spread points over all inventory hosts")
    p.add_argument("--loadgen-processes", type=_count(1), default=None,
                   help="Locust processes per load-generator host (default: sized from the load)")


def _backend(args: argparse.Namespace, experiment: str = ""):
    from vllm_lab.backends import LiveBackend, PredictBackend
    if args.backend == "predict":
        return PredictBackend()
    serving.check_inventory(args.inventory)  # a bad inventory is refused before anything runs
    # Idempotent: on a provisioned host this changes nothing and takes a few seconds. It claims
    # the instances first: another lab process's are refused (InstanceBusy) before any change.
    print(f"provisioning {args.inventory} (playbooks/provision.yml)", flush=True)
    try:
        serving.provision(args.inventory, experiment=experiment)
    except RuntimeError as e:
        raise StoreError(f"{args.inventory}: hosts could not be provisioned: {e}") from None
    return LiveBackend(args.backend, args.inventory, api_key=os.environ.get("VLLM_API_KEY") or None,
                       processes=getattr(args, "loadgen_processes", None), experiment=experiment)


def _experiment_id(args, step: str, scenario, param: str | None, store_path: Path) -> str:
    """EXPERIMENT if given; with --resume the newest experiment of this step, scenario and param."""
    if args.experiment:
        return args.experiment
    if args.resume:
        prefix = plans.experiment_name(step, scenario, param)[: -len("-YYYYmmdd-HHMMSS")]
        newest = _newest_experiment(store_path, prefix + "-")
        if newest is None:
            raise StoreError(f"{store_path}: nothing to resume for {prefix}; run without RESUME=1")
        return newest
    return plans.experiment_name(step, scenario, param)


def _take(args, step: str, scenario, points, meta: dict, param: str | None = None) -> int:
    from vllm_lab import report
    store_path = args.store or args.out / "lab.db"
    exp_id = _experiment_id(args, step, scenario, param, store_path)
    if args.backend == "predict":
        from vllm_lab.backends import PredictBackend
        for point in points:
            PredictBackend.check(point.scenario)  # every point, before the first is taken
    plan = plans.Plan(exp_id, step, points, meta)
    hosts = serving.serve_hosts(args.inventory) if args.spread else [None]
    print(f"{step}: experiment {exp_id}, {len(points)} runs, backend {args.backend}")

    def progress(point, m):
        s = m.summary
        figures = (f"{s.get('output_throughput', 0):.0f} tok/s, TTFT p50 "
                   f"{(s.get('ttft_p50') or 0) * 1000:.0f} ms, TPOT p50 {(s.get('tpot_p50') or 0) * 1000:.1f} ms"
                   if m.status == "ok" else m.error.splitlines()[0][:160])
        print(f"  {point.values or 'baseline'} repeat {point.repeat}: {m.status}: {figures}", flush=True)

    try:
        counts = plans.execute(plan, _backend(args, exp_id), store_path, args.out / ".work", hosts, progress)
    except KeyboardInterrupt:
        print(f"lab: interrupted; finished runs are kept. Continue with: make {step} ... "
              f"RESUME=1 EXPERIMENT={exp_id}", file=sys.stderr)
        return 130
    index = report.build(store_path, exp_id, args.out)
    print(f"runs this session: {counts or 'none (all were already recorded)'}")
    print(f"report: {index}")
    return 0


def cmd_baseline(args: argparse.Namespace) -> int:
    """vLLM's defaults on the scenario's traffic, repeated: the reference later steps compare with."""
    scenario = _resolve_checked(args)
    repeats = args.repeats or max(3, scenario.run.repeats)
    return _take(args, "baseline", scenario, plans.baseline_points(scenario, repeats),
                 {"repeats": repeats})


def cmd_sweep(args: argparse.Namespace) -> int:
    """One flag over a ladder of values."""
    scenario = _resolve_checked(args)
    plans.check_param(args.param, scenario)
    values = plans.parse_values(args.param, args.values) if args.values else \
        plans.default_values(args.param, scenario)
    points = plans.sweep_points(scenario, args.param, values, args.repeats or scenario.run.repeats)
    for p in points:
        _lint_or_note(p)
    return _take(args, "sweep", scenario, points, {"param": args.param, "values": values}, args.param)


def _lint_or_note(point) -> None:
    """A value vLLM would refuse is still a data point: it is measured (and recorded as refused)."""
    for f in lint_mod.lint(point.scenario):
        if f.severity == "error":
            print(f"  note: {point.values}: {f.message}")


def _resolve_checked(args: argparse.Namespace):
    """Resolve the scenario and stop on lint errors: nothing is launched with a refused flag."""
    layers = scenarios.load_layers(args.scenario, args.hardware, args.overrides)
    scenario = scenarios.validate(layers)
    errors = [f for f in lint_mod.lint(scenario, layers) if f.severity == "error"]
    if errors:
        raise scenarios.ScenarioError(f"{errors[0]} (make lint SCENARIO={args.scenario} lists all)")
    return scenario


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run the calibration plan on the backend, then fit a twin profile to it."""
    from vllm_lab import calibrate
    from vllm_lab.models import load_model_shape
    from vllm_lab.twin.profile import load_profile

    scenario = _resolve_checked(args)
    store_path = args.store or args.out / "lab.db"
    if not args.fit_only:
        points = calibrate.calibration_points(scenario)
        rc = _take(args, "calibrate", scenario, points, {"params": ["point"]}, "calibrate")
        if rc:
            return rc
    exp_id = _experiment_id(argparse.Namespace(**{**vars(args), "resume": True}), "calibrate",
                            scenario, "calibrate", store_path)
    scenario = scenarios.Scenario.model_validate_json(
        _first_run_scenario(store_path, exp_id)) if args.fit_only else scenario
    # The profile keeps its own hardware block (the GPU it was measured on, up to 8 per host).
    base = load_profile(scenario.hardware.twin_profile)
    model = load_model_shape(str(scenario.serve["model"]))
    out = args.profile_out or experiment_dir(args.out, exp_id) / f"{scenario.hardware.gpu}-{model.name}.yaml"
    profile, rows = calibrate.fit(store_path, exp_id, base.model_copy(
        update={"name": out.stem, "model": model.name}), model, out, args.reference)
    for row in rows:
        print(f"  {row['point']:6s} {row['metric']:18s} measured {row['measured']:9.2f} "
              f"twin {row['predicted']:9.2f} {row['error']:+7.1%}")
    print(f"profile: {out} (median errors {profile.provenance.errors})")
    return 0


def _first_run_scenario(store_path: Path, exp_id: str) -> str:
    from vllm_lab.store import Store
    store = Store(store_path)
    runs = store.runs(exp_id)
    store.close()
    if runs.empty:
        raise StoreError(f"{store_path}: experiment {exp_id} has no runs to fit")
    return str(runs.iloc[0]["scenario_json"])


def _newest_experiment(store_path: Path, prefix: str = "") -> str | None:
    from vllm_lab.store import Store
    store = Store(store_path)
    try:
        return store.newest_experiment(prefix)
    finally:
        store.close()


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild an experiment's report from the store alone."""
    from vllm_lab import report
    store_path = args.store or args.out / "lab.db"
    experiment = args.experiment or _newest_experiment(store_path)
    if experiment is None:
        raise StoreError(f"{store_path}: no experiments yet; run make baseline or make sweep first")
    check_experiment_name(experiment)  # a store from before the pattern may hold any name
    print(f"report: {report.build(store_path, experiment, args.out)}")
    return 0


# -- steps 3 and 4: combinations, the search, stress ---------------------------------------------

def cmd_combo(args: argparse.Namespace) -> int:
    """A grid of 2-3 flags: every combination, failures as data, resumable and spreadable."""
    from vllm_lab import search
    scenario = _resolve_checked(args)
    params = [p.strip() for p in (args.params or "").split(",")]
    for param in [item.partition("=")[0] for item in (args.grid or "").split()] + params:
        if param:
            plans.check_param(param, scenario, "PARAMS" if param in params else "GRID")
    grid = search.parse_grid(args.grid, args.params, scenario)
    points = search.combo_points(scenario, grid, args.repeats or scenario.run.repeats)
    for p in points:
        _lint_or_note(p)
    return _take(args, "combo", scenario, points, {"params": list(grid), "grid": grid},
                 "-".join(grid))


def cmd_tune(args: argparse.Namespace) -> int:
    """Optuna over a declared space; each trial is a run in the store; CONFIRM re-measures the best live."""
    from vllm_lab import report, search
    scenario = _resolve_checked(args)
    store_path = args.store or args.out / "lab.db"
    space = search.load_space(args.space, scenario)
    exp_id = _experiment_id(args, "tune", scenario, None, store_path)
    settings = search.TuneSettings(exp_id, space, args.objective, args.trials,
                                   search.storage_url(args.study_storage, store_path), args.seed,
                                   args.startup_trials)
    hosts = serving.serve_hosts(args.inventory) if args.spread else [None]
    print(f"tune: study {exp_id}, {args.trials} trial(s) per host on {len(hosts)} host(s), backend "
          f"{args.backend}, objective {search.objective_label(args.objective)}, space {', '.join(space.space)}")

    def progress(number, values, run):
        s = run["summary"]
        figures = (f"goodput {s.get('goodput') or 0:.2f} req/s, {s.get('output_throughput') or 0:.0f} tok/s"
                   if run["state"] == "complete" else f"{run['status']}: {(run['error'] or '').splitlines()[0][:100] if run['error'] else ''}")
        print(f"  trial {number} {values}: {run['state']}: {figures}", flush=True)

    try:
        counts = search.run_trials(scenario, settings, _backend(args, exp_id), store_path, args.out / ".work",
                                   hosts, progress)
    except KeyboardInterrupt:
        print(f"lab: interrupted; finished trials are kept. Continue with: make tune EXPERIMENT={exp_id}",
              file=sys.stderr)
        return 130
    print(f"trials this session: {counts}")
    print(f"report: {report.build(store_path, exp_id, args.out)}")
    if args.confirm:
        study = search.load_study(exp_id, settings.storage)
        configs = search.best_configs(study, args.confirm, args.objective)
        if not configs:
            print("confirm: no trial met the SLO; nothing to confirm")
            return 0
        args.backend, args.experiment, args.resume = args.confirm_backend, f"{exp_id}-confirm", False
        return _take(args, "tune", scenario, search.confirm_points(scenario, configs),
                     {"params": list(space.space), "confirms": exp_id})
    return 0


def cmd_stress(args: argparse.Namespace) -> int:
    """Ramp/step: a staircase of open-loop levels and its knee; spike/soak: one run as a time series."""
    from vllm_lab import stress
    scenario = stress.stress_scenario(_resolve_checked(args), args.shape)
    if args.shape in ("spike", "soak"):
        if args.shape == "spike" and args.backend == "predict":
            raise scenarios.ScenarioError("SHAPE=spike needs a live backend (BACKEND=twin or vllm): "
                                          "the predictor runs constant loads only")
        return _take(args, "stress", scenario, stress.single_points(scenario), {"shape": args.shape},
                     args.shape)
    levels = stress.staircase_levels(scenario, plans.parse_values("load.shape.level", args.levels)
                                     if args.levels else None)
    meta = {"shape": args.shape, "params": ["load.shape.level"]}
    repeats = args.repeats or scenario.run.repeats
    store_path = args.store or args.out / "lab.db"
    exp_id = _experiment_id(args, "stress", scenario, args.shape, store_path)
    args.experiment = exp_id

    def read_levels():
        from vllm_lab.store import Store
        store = Store(store_path)
        try:
            return stress.levels_table(store, exp_id, store.runs(exp_id))
        finally:
            store.close()

    # A ramp zooms into the knee in the same experiment; a step keeps its levels.
    return stress.run_staircase(scenario, levels, args.refine if args.shape == "ramp" else 0,
                                lambda points: _take(args, "stress", scenario, points, meta, args.shape),
                                read_levels, repeats)


def cmd_autotune(args: argparse.Namespace) -> int:
    """Search the serving flags on the predictor by SLO capacity, measure the defaults and the best
    few on the backend within GPU_MINUTES, and write the report with a scenario for the winner."""
    from vllm_lab import autotune, search
    if args.spread:
        raise UsageError("SPREAD=1 is not supported by autotune: its candidates are measured one "
                         "after another on one host")
    scenario = _resolve_checked(args)
    space = autotune.load_space(args.space, scenario)
    store_path = args.store or args.out / "lab.db"
    storage = search.storage_url(None, store_path)
    exp_id = args.experiment or plans.experiment_name("autotune", scenario)
    if args.resume and not args.experiment:
        prefix = plans.experiment_name("autotune", scenario)[: -len("YYYYmmdd-HHMMSS")]
        exp_id = autotune.newest_study(storage, prefix) or ""
        if not exp_id:
            raise StoreError(f"{store_path}: nothing to resume for {prefix[:-1]}; run without RESUME=1")
    # A DURATION given on the command line sets the staircase's levels; else the backend's default.
    step_s = scenario.load.stop.duration_s if any(
        o.startswith("load.stop.duration_s=") for o in args.overrides) else None
    settings = autotune.Settings(exp_id, store_path, args.out, storage, args.gpu_minutes,
                                 trials=args.trials, seed=args.seed, top=args.top, step_s=step_s,
                                 repeats=args.repeats or 1)
    backend = _backend(args, exp_id)
    try:
        summary = autotune.run(scenario, space, backend, settings)
    except KeyboardInterrupt:
        print(f"lab: interrupted; finished runs are kept. Continue with: make autotune ... "
              f"RESUME=1 EXPERIMENT={exp_id}", file=sys.stderr)
        return 130
    print(f"autotune: {summary['verdict']}")
    print(f"report: {experiment_dir(args.out, exp_id) / 'report.md'}")
    return 0


def _minutes(text: str) -> float:
    """An argparse type: a positive number of minutes."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: minutes of the measuring "
                                         f"backend, a number above 0")
    return value


def cmd_claims(args: argparse.Namespace) -> int:
    """The guide's claims, each measured by its experiment, with a verdict table."""
    from vllm_lab import claims
    base = _resolve_checked(args)
    try:
        selected = claims.parse_selection(args.claims)
    except ValueError as e:
        raise scenarios.ScenarioError(str(e)) from None
    points = claims.points(base, selected, args.repeats or 1)
    meta = {"base": base.to_record()}
    if not points:
        print(f"claims {selected}: nothing to measure here (claim 7 is not testable on vLLM {base.vllm_version})")
    return _take(args, "claims", base, points, meta) if points else 0


# -- step 5: monitoring, the regression watch, findings and the quarterly report ---------------

def cmd_monitor(args: argparse.Namespace) -> int:
    """Set up Prometheus (+ node exporter, + Grafana where installable) for the inventory."""
    from vllm_lab import monitor
    result = monitor.deploy(args.inventory, extra_vars=dict(v.split("=", 1) for v in args.var))
    print(monitor.describe(result))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """Probe a live deployment on a schedule; exit 1 when a probe is a regression."""
    from vllm_lab import watch
    store_path = args.store or args.out / "lab.db"
    regressed = watch.run_schedule(
        store_path, url=args.url, inventory=args.inventory, every_s=args.every, count=args.count,
        baseline=args.baseline, repeats=args.repeats, probe_overrides=args.overrides,
        hardware=args.hardware, workdir=args.out / ".work", echo=print)
    return 1 if regressed else 0


def cmd_findings(args: argparse.Namespace) -> int:
    """Print the troubleshooting findings of an experiment's runs (default: the newest)."""
    from vllm_lab import findings
    from vllm_lab.store import Store
    store = Store(args.store or args.out / "lab.db")
    experiment = args.experiment or store.newest_experiment()
    if experiment is None:
        store.close()
        raise StoreError(f"{store.path}: no experiments yet; run make baseline or make sweep first")
    store.experiment(experiment)  # names the known ones when it does not exist
    runs = store.runs(experiment)
    store.close()
    total = 0
    for row in runs.to_dict("records"):
        for f in findings.findings(row):
            total += 1
            print(f"{row['point'] or 'baseline'} repeat {row['repeat']}: {findings.describe(f)}")
    print(f"{experiment}: {total} finding(s) over {len(runs)} run(s)")
    return 0


def cmd_quarterly(args: argparse.Namespace) -> int:
    """Build the quarterly report of every experiment of PERIOD."""
    from vllm_lab import quarterly
    store_path = args.store or args.out / "lab.db"
    print(f"report: {quarterly.build(store_path, args.period, args.out, pdf=not args.no_pdf)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every lab command."""
    parser = LabParser(prog="lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("lint", help="check a scenario's vLLM flags before anything runs")
    _scenario_args(p)
    p.add_argument("--all", action="store_true", help="lint every shipped scenario")
    p.add_argument("--vllm-version", default=None, help="target vLLM version (default: scenario's)")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("show", help="print the resolved scenario")
    _scenario_args(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("baseline", help="measure vLLM's defaults on the scenario's traffic")
    _run_args(p)
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("sweep", help="sweep one flag over a ladder of values")
    _run_args(p)
    p.add_argument("--param", required=True, help="flag (max-num-seqs) or path (load.shape.level)")
    p.add_argument("--values", default=None, help="comma-separated values (default: a ladder)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("calibrate", help="measure the calibration plan and fit a twin profile")
    _run_args(p)
    p.add_argument("--profile-out", type=Path, default=None, help="where to write the profile YAML")
    p.add_argument("--fit-only", action="store_true", help="fit from EXPERIMENT's runs, measure nothing")
    p.add_argument("--reference", type=Path, nargs="*", default=[],
                   help="vllm bench serve result files from the same machine, fitted too")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("report", help="rebuild an experiment's report from the store")
    p.add_argument("--experiment", type=_experiment, default=None,
                   help="experiment id (default: the newest)")
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.add_argument("--store", type=Path, default=None)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("combo", help="a grid of 2-3 flags (step 3)")
    _run_args(p)
    p.add_argument("--params", default=None, help="flags with default ladders, e.g. max-num-seqs,max-num-batched-tokens")
    p.add_argument("--grid", default=None, help='values per flag: "max-num-seqs=8,16 max-num-batched-tokens=2048,8192"')
    p.set_defaults(func=cmd_combo)

    p = sub.add_parser("tune", help="Bayesian search (Optuna) over a declared space of flags (step 3)")
    _run_args(p)
    p.add_argument("--trials", type=_count(1), default=20, help="trials this worker runs (per host with --spread)")
    p.add_argument("--objective", default="goodput", choices=("goodput", "throughput", "pareto"))
    p.add_argument("--space", default=None, help="space name (scenarios/spaces/) or YAML file; default per hardware")
    p.add_argument("--study-storage", default=None, help="Optuna storage URL (default: the lab database)")
    p.add_argument("--seed", type=int, default=None, help="sampler seed")
    p.add_argument("--startup-trials", type=_count(0), default=4, help="random trials before TPE models the space")
    p.add_argument("--confirm", type=_count(0), default=0, help="re-measure the best N configurations live")
    p.add_argument("--confirm-backend", choices=("twin", "vllm"), default="twin")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("stress", help="ramp/step staircase with its knee, spike or soak (step 4)")
    _run_args(p)
    p.add_argument("--shape", required=True, choices=("ramp", "step", "spike", "soak"))
    p.add_argument("--levels", default=None, help="offered loads (req/s) for ramp/step; default: "
                   "fractions of the predicted capacity")
    p.add_argument("--refine", type=_count(0), default=3, help="ramp: rounds of levels added inside the knee's bracket (or of confirmations)")
    p.set_defaults(func=cmd_stress)

    p = sub.add_parser("autotune", help="search flags on the predictor by SLO capacity, measure the "
                       "defaults and the best few within GPU_MINUTES")
    _run_args(p)
    p.add_argument("--gpu-minutes", type=_minutes, default=20.0,
                   help="wall minutes of the measuring backend, server starts counted")
    p.add_argument("--trials", type=_count(1), default=20, help="configurations the predictor ranks")
    p.add_argument("--space", default=None, help="space name (scenarios/spaces/) or YAML file; default autotune")
    p.add_argument("--seed", type=int, default=None, help="sampler seed")
    p.add_argument("--top", type=_count(0), default=None,
                   help="best configurations measured besides the defaults (default: twin 2, vllm 3)")
    p.set_defaults(func=cmd_autotune)

    p = sub.add_parser("claims", help="measure the tuning guide's claims and give each a verdict")
    _run_args(p)
    p.add_argument("--claims", default=None, help="claim numbers, e.g. 1,3,5-8 (default: all nine)")
    p.set_defaults(func=cmd_claims)

    p = sub.add_parser("monitor", help="Prometheus, exporters, alert rules and Grafana (monitor.yml)")
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="extra variable for monitor.yml, e.g. prometheus_port=9091")
    p.set_defaults(func=cmd_monitor)

    p = sub.add_parser("watch", help="probe a live deployment and flag regressions vs its baseline")
    p.add_argument("--url", default=None, help="the deployment (default: every instance of INVENTORY)")
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--hardware", default=None, help="hardware preset the probe scenario records")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="change the probe, e.g. load.shape.level=8")
    p.add_argument("--every", type=_seconds, default=0, help="seconds between probes (0: one round)")
    p.add_argument("--count", type=_count(1), default=1, help="rounds of probes")
    p.add_argument("--baseline", action="store_true", help="record a new baseline first")
    p.add_argument("--repeats", type=_count(1), default=3, help="probes that make a baseline")
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.add_argument("--store", type=Path, default=None)
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("findings", help="troubleshooting findings of an experiment's runs")
    p.add_argument("--experiment", type=_experiment, default=None,
                   help="experiment id (default: the newest)")
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.add_argument("--store", type=Path, default=None)
    p.set_defaults(func=cmd_findings)

    p = sub.add_parser("quarterly", help="the quarterly report of every experiment of a period")
    p.add_argument("--period", required=True, help="a quarter, e.g. 2026Q4 (UTC)")
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.add_argument("--store", type=Path, default=None)
    p.add_argument("--no-pdf", action="store_true", help="skip the PDF (needs Chromium)")
    p.set_defaults(func=cmd_quarterly)
    return parser


# -- make: every make variable reaches the lab as data ---------------------------------------------

# The Makefile copies each variable's text, unexpanded, into the environment as LAB_MAKE_<NAME>
# and runs `lab.py make TARGET`; here it becomes an argument list, never shell or make text.
_SCENARIO_VARS = (("SCENARIO", "--scenario"), ("HARDWARE", "--hardware"))
_RUN_VARS = (("INVENTORY", "--inventory"), ("BACKEND", "--backend"), ("OUT", "--out"),
             ("EXPERIMENT", "--experiment"), ("RESUME", "--resume"), ("REPEATS", "--repeats"),
             ("SPREAD", "--spread"), ("LOADGEN_PROCESSES", "--loadgen-processes"))
MAKE_TARGETS: dict[str, tuple[tuple[str, str], ...]] = {
    "baseline": _RUN_VARS,
    "sweep": _RUN_VARS + (("PARAM", "--param"), ("VALUES", "--values")),
    "calibrate": _RUN_VARS + (("PROFILE_OUT", "--profile-out"), ("FIT_ONLY", "--fit-only"),
                              ("REFERENCE", "--reference")),
    "report": (("OUT", "--out"), ("EXPERIMENT", "--experiment")),
    "quarterly": (("PERIOD", "--period"), ("OUT", "--out"), ("PDF", "--no-pdf")),
    "combo": _RUN_VARS + (("PARAMS", "--params"), ("GRID", "--grid")),
    "tune": _RUN_VARS + (("TRIALS", "--trials"), ("OBJECTIVE", "--objective"), ("SPACE", "--space"),
                         ("STUDY_STORAGE", "--study-storage"), ("SEED", "--seed"),
                         ("CONFIRM", "--confirm"), ("CONFIRM_BACKEND", "--confirm-backend")),
    "stress": _RUN_VARS + (("SHAPE", "--shape"), ("LEVELS", "--levels")),
    "claims": _RUN_VARS + (("CLAIMS", "--claims"),),
    "autotune": _RUN_VARS + (("GPU_MINUTES", "--gpu-minutes"), ("TRIALS", "--trials"),
                             ("SPACE", "--space"), ("SEED", "--seed"), ("CONFIRM", "--top")),
    "monitor": (("INVENTORY", "--inventory"),),
    "watch": (("INVENTORY", "--inventory"), ("OUT", "--out"), ("URL", "--url"), ("EVERY", "--every"),
              ("COUNT", "--count"), ("BASELINE", "--baseline"), ("HARDWARE", "--hardware"),
              ("REPEATS", "--repeats"), ("SET", "--set")),
    "findings": (("OUT", "--out"), ("EXPERIMENT", "--experiment")),
    "lint": (),
    "show": (),
}
# Targets that take the scenario's layers (SCENARIO, HARDWARE, SET, MODEL, DURATION).
_LAYERED = {"baseline", "sweep", "calibrate", "combo", "tune", "stress", "claims", "lint", "show",
            "autotune"}
_REQUIRED = {"sweep": ("PARAM", "make sweep PARAM=max-num-seqs"),
             "stress": ("SHAPE", "make stress SHAPE=ramp (ramp, step, spike or soak)"),
             "combo": ("PARAMS or GRID", "make combo PARAMS=max-num-seqs,max-num-batched-tokens")}
_SWITCHES = {"--resume", "--spread", "--fit-only", "--baseline"}
_ON, _OFF = ("1", "yes", "true", "on"), ("0", "no", "false", "off")


def _switch(name: str, text: str) -> bool:
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    raise UsageError(f"{name}={text!r} is not allowed: write {name}=1 to turn it on, or leave it out")


def _words(name: str, text: str) -> list[str]:
    """A variable that holds several items (SET, REFERENCE), split as a shell would split words,
    so a quoted item keeps its spaces: SET='serve.served-model-name="a b" load.shape.level=2'."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{name}={text!r} cannot be split into items ({e}); close every quote") from None


def make_argv(target: str, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The lab's argument list for ``make TARGET`` from the LAB_MAKE_* environment, and which make
    variable each option came from (for error messages)."""
    def var(name: str) -> str:
        text = env.get(f"LAB_MAKE_{name}", "").strip()
        if any(not c.isprintable() for c in text):
            # A newline or other control character would split the one-line answer it ends up in.
            raise UsageError(f"{name}={text!r} is not allowed: a make variable is one line of "
                             f"printable text")
        return text

    if target == "report" and var("PERIOD"):
        target = "quarterly"
    if target not in MAKE_TARGETS:
        raise UsageError(f"make target {target!r} is not one the lab runs "
                         f"({', '.join(sorted(MAKE_TARGETS))})")
    required = _REQUIRED.get(target)
    if required and not any(var(n) for n in required[0].split(" or ")):
        raise UsageError(f"{required[0]} is required, e.g. {required[1]}")
    names: dict[str, str] = {}
    argv = [target]
    if target in _LAYERED:
        scenario = var("SCENARIO") or "default"
        if target == "lint" and scenario == "all":
            return ["lint", "--all"], names
        for name, option in _SCENARIO_VARS:
            if var(name):
                argv.append(f"{option}={var(name)}")
                names[option] = name
        argv += [f"--set={item}" for item in _words("SET", var("SET"))]
        if var("MODEL"):
            argv.append(f"--set=serve.model={json.dumps(var('MODEL'))}")
        if var("DURATION"):
            duration = _seconds_or_none(var("DURATION"))
            if not duration:
                raise UsageError(f"DURATION={var('DURATION')!r} is not allowed: seconds per run, "
                                 f"a number above 0")
            argv.append(f"--set=load.stop.duration_s={duration:g}")
        names["--set"] = "SET"
    for name, option in MAKE_TARGETS[target]:
        text = var(name)
        names[option] = name
        if not text:
            continue
        if option in _SWITCHES:
            argv += [option] if _switch(name, text) else []
        elif option == "--no-pdf":
            argv += [] if _switch(name, text) else ["--no-pdf"]
        elif option == "--set":
            argv += [f"--set={item}" for item in _words(name, text)]
        elif option == "--reference":
            # The shell used to expand REFERENCE=dir/*.json; the lab does it now, as data.
            files = [f for word in _words(name, text) for f in (sorted(glob.glob(word)) or [word])]
            argv += ["--reference", *(f if not f.startswith("-") else f"./{f}" for f in files)]
        else:
            argv.append(f"{option}={text}")  # one word, even if it starts with '-' (VALUES=-1)
    return argv, names


def _seconds_or_none(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def _for_make(message: str, names: Mapping[str, str]) -> str:
    """An error about an option, reworded for the make variable it came from."""
    if not names:
        return message
    # "argument --experiment: '../x' is not ..." -> "EXPERIMENT='../x' is not ..."
    message = re.sub(r"^argument (--[\w-]+)(?:/[\w-]+)?: (['\"]?)",
                     lambda m: names.get(m.group(1), m.group(1)) + ("=" if m.group(2) else ": ")
                     + m.group(2), message)
    return message.replace("--no-pdf", "PDF=0")


def _ansible_verbosity_problem(args: argparse.Namespace) -> str | None:
    """ANSIBLE_VERBOSITY changes the output the lab reads from ansible-playbook and
    ansible-inventory; a command that runs them refuses it instead of misreading it."""
    level = os.environ.get("ANSIBLE_VERBOSITY", "").strip()
    live = args.command in ("monitor", "watch") or getattr(args, "spread", False) \
        or getattr(args, "backend", "predict") != "predict" or getattr(args, "confirm", 0)
    if not live or level in ("", "0"):
        return None
    return (f"ANSIBLE_VERBOSITY={level!r}: the lab reads Ansible's normal output, which verbosity "
            f"changes; unset it or set it to 0 (failed tasks are quoted in full anyway)")


def _store_of(args: argparse.Namespace | None) -> Path:
    if args is None or not hasattr(args, "out"):
        return Path("reports/lab.db")
    return args.store or args.out / "lab.db"


def main(argv: list[str] | None = None) -> int:
    """Run one lab command; a bad input is one sentence on stderr and exit status 2.

    ``lab make TARGET`` takes its inputs from the LAB_MAKE_* variables the Makefile exports.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    names: dict[str, str] = {}
    args = None
    try:
        if argv[:1] == ["make"]:
            argv, names = make_argv(argv[1] if len(argv) > 1 else "", os.environ)
        args = build_parser().parse_args(argv)
        problem = _ansible_verbosity_problem(args)
        if problem:
            raise UsageError(problem)
        return args.func(args)
    except (UsageError, scenarios.ScenarioError, StoreError, MonitorError, WatchError,
            serving.InventoryError, serving.InstanceBusy) as e:
        print(f"lab: {_for_make(str(e), names)}", file=sys.stderr)
        return 2
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as e:
        # Whatever query met it: a damaged, foreign or locked store, named, with what to do.
        print(f"lab: {_for_make(describe_sqlite_error(_store_of(args), e), names)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted; finished runs are in the store", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
