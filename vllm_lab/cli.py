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
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pandas as pd
import yaml

from vllm_lab import experiment, progress, scenarios, serving
from vllm_lab import lint as lint_mod
from vllm_lab.flags import redact
from vllm_lab.monitor import MonitorError
from vllm_lab.store import (
    EXPERIMENT_NAME_RULE,
    StoreError,
    check_experiment_name,
    describe_sqlite_error,
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
    p.add_argument("--deadline", type=_deadline, default=None,
                   help="stop gracefully by then: 2026-12-01T05:30, 05:30 (today) or 1h30m from now; "
                        f"exit {experiment.EXIT_DEADLINE} with the command that resumes")
    p.add_argument("--precision", type=_precision, default=None,
                   help="repeat each point until its 95%% intervals are this narrow: default "
                        "(±2%% throughput, ±5%% TTFT/TPOT p50, at most 10 runs) or e.g. "
                        "throughput=2%%,ttft=5%%,max=8")
    p.add_argument("--live", action="store_true", help="serve Locust's web UI for the run in flight")
    p.add_argument("--live-host", default="127.0.0.1", help="address the web UI binds (with --live)")


def _deadline(text: str) -> experiment.Deadline:
    """An argparse type: a deadline (an ISO time, HH:MM today or a duration from now)."""
    try:
        return experiment.Deadline.parse(text)
    except experiment.DeadlineError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _precision(text: str) -> experiment.Precision:
    """An argparse type: PRECISION's targets."""
    try:
        return experiment.Precision.parse(text)
    except experiment.PrecisionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _settings(args: argparse.Namespace) -> experiment.Settings:
    """How a long command takes its runs, from its options."""
    return experiment.Settings(
        backend=args.backend, inventory=args.inventory, out=args.out, store=args.store,
        experiment=args.experiment, resume=args.resume, repeats=args.repeats, spread=args.spread,
        loadgen_processes=args.loadgen_processes, deadline=args.deadline,
        live_host=args.live_host if getattr(args, "live", False) else None,
        precision=getattr(args, "precision", None),
        resume_command=getattr(args, "resume_command", None) or _resume_command([]))


def _source(args: argparse.Namespace) -> experiment.Source:
    return experiment.Source(args.scenario, args.hardware, tuple(args.overrides))


def cmd_status(args: argparse.Namespace) -> int:
    """What the lab under OUT is doing now (experiment, point, phase, since when), or did last."""
    store_path = args.out / "lab.db"
    newest = None
    if store_path.exists():
        from vllm_lab.store import Store
        with Store(store_path) as store:
            exp = store.newest_experiment()
            if exp:
                runs = store.runs(exp)
                newest = {"id": exp, "step": store.experiment(exp)["step"],
                          "statuses": runs["status"].value_counts().to_dict()}
    print(progress.describe_status(args.out, newest))
    return 0


def cmd_baseline(args: argparse.Namespace) -> int:
    """vLLM's defaults on the scenario's traffic, repeated: the reference later steps compare with."""
    return experiment.baseline(_settings(args), _source(args))


def cmd_sweep(args: argparse.Namespace) -> int:
    """One flag over a ladder of values."""
    return experiment.sweep(_settings(args), _source(args), args.param, args.values)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run the calibration plan on the backend, then fit a twin profile to it."""
    return experiment.calibrate(_settings(args), _source(args), args.fit_only, args.profile_out,
                                args.reference)


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild an experiment's report from the store alone."""
    from vllm_lab import reports as report
    store_path = experiment.store_path(args.out, args.store)
    name = args.experiment or experiment.newest_experiment(store_path)
    check_experiment_name(name)  # a store from before the pattern may hold any name
    print(f"report: {report.build(store_path, name, args.out)}")
    return 0


# -- steps 3 and 4: combinations, the search, stress ---------------------------------------------

def cmd_combo(args: argparse.Namespace) -> int:
    """A grid of 2-3 flags: every combination, failures as data, resumable and spreadable."""
    return experiment.combo(_settings(args), _source(args), args.params, args.grid)


def cmd_tune(args: argparse.Namespace) -> int:
    """Optuna over a declared space; each trial is a run in the store; CONFIRM re-measures the best live."""
    return experiment.tune(_settings(args), _source(args), experiment.TuneOptions(
        args.trials, args.objective, args.space, args.study_storage, args.seed, args.startup_trials,
        args.confirm, args.confirm_backend))


def cmd_stress(args: argparse.Namespace) -> int:
    """Ramp/step: a staircase of open-loop levels and its knee; spike/soak: one run as a time series."""
    return experiment.stress(_settings(args), _source(args), args.shape, args.levels, args.refine)


def cmd_autotune(args: argparse.Namespace) -> int:
    """Search the serving flags on the predictor by SLO capacity, measure the defaults and the best
    few on the backend within GPU_MINUTES, and write the report with a scenario for the winner."""
    return experiment.autotune(_settings(args), _source(args), experiment.AutotuneOptions(
        args.gpu_minutes, args.trials, args.space, args.seed, args.top))


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
    return experiment.claims(_settings(args), _source(args), args.claims)


# -- step 5: monitoring, the regression watch, findings and the quarterly report ---------------

def cmd_monitor(args: argparse.Namespace) -> int:
    """Set up Prometheus (+ node exporter, + Grafana where installable) for the inventory."""
    from vllm_lab import monitor
    result = monitor.deploy(args.inventory, extra_vars=dict(v.split("=", 1) for v in args.var))
    print(monitor.describe(result))
    return 0


def cmd_hosts(args: argparse.Namespace) -> int:
    """Provision, stop or tear down the inventory's hosts through their playbook."""
    serving.check_inventory(args.inventory)  # a bad inventory is one sentence before anything runs
    playbook = {"provision": "provision.yml", "stop": "stop.yml", "teardown": "teardown.yml"}[args.command]
    print(f"{args.command}: {args.inventory} (playbooks/{playbook})", flush=True)
    action = {"provision": serving.provision, "stop": serving.stop, "teardown": serving.teardown}
    try:
        run = action[args.command](args.inventory)
    except RuntimeError as e:
        raise StoreError(f"{args.inventory}: {args.command} failed: {e}") from None
    for host, counts in run.recap.items():
        print(f"  {host}: {counts.get('changed', 0)} changed, {counts.get('ok', 0)} ok")
    for host, why in run.unreachable.items():
        print(f"  {host}: unreachable ({why})")
    return 1 if run.unreachable else 0


BENCH_DIR = Path(__file__).resolve().parents[1] / "scripts"


def benchmarks() -> dict[str, Path]:
    """The benchmark scripts by name: scripts/bench_<name>.py is <name>, '_' spelled '-'."""
    return {p.stem.removeprefix("bench_").replace("_", "-"): p
            for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one benchmark script with this Python, its arguments as given (no shell)."""
    known = benchmarks()
    if args.name not in known:
        raise UsageError(f"benchmark {args.name!r} is not one of scripts/bench_*.py "
                         f"({', '.join(known)})")
    import subprocess
    return subprocess.run([sys.executable, str(known[args.name]), *args.args], check=False).returncode


def cmd_watch(args: argparse.Namespace) -> int:
    """Probe a live deployment on a schedule; exit 1 when a probe is a regression."""
    from vllm_lab import watch
    store_path = experiment.store_path(args.out, args.store)
    regressed = watch.run_schedule(
        store_path, url=args.url, inventory=args.inventory, every_s=args.every, count=args.count,
        baseline=args.baseline, repeats=args.repeats, probe_overrides=args.overrides,
        hardware=args.hardware, workdir=args.out / ".work", echo=print)
    return 1 if regressed else 0


def cmd_findings(args: argparse.Namespace) -> int:
    """Print the troubleshooting findings of an experiment's runs (default: the newest)."""
    from vllm_lab.analysis import findings
    from vllm_lab.store import Store
    store_path = experiment.store_path(args.out, args.store)
    name = args.experiment or experiment.newest_experiment(store_path)
    with Store(store_path) as store:
        store.experiment(name)  # names the known ones when it does not exist
        runs = store.runs(name)
    total = 0
    for row in runs.to_dict("records"):
        for f in findings.findings(row):
            total += 1
            print(f"{row['point'] or 'baseline'} repeat {row['repeat']}: {findings.describe(f)}")
    print(f"{name}: {total} finding(s) over {len(runs)} run(s)")
    return 0


def cmd_quarterly(args: argparse.Namespace) -> int:
    """Build the quarterly report of every experiment of PERIOD."""
    from vllm_lab.reports import quarterly
    store_path = experiment.store_path(args.out, args.store)
    began = time.time()

    def say(line: str) -> None:  # plain, timestamped: a short command needs no live view
        print(f"{time.strftime('%H:%M:%S')} {line} ({time.time() - began:.1f} s)", flush=True)
    print(f"report: {quarterly.build(store_path, args.period, args.out, pdf=not args.no_pdf, say=say)}")
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

    p = sub.add_parser("status", help="what the lab is doing now (or did last), from another shell too")
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.set_defaults(func=cmd_status)

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

    for name, what in (("provision", "make the inventory's hosts ready to serve (provision.yml)"),
                       ("stop", "stop every instance on the inventory's hosts (stop.yml)"),
                       ("teardown", "stop, then remove what provision.yml and serve.yml put there")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
        p.set_defaults(func=cmd_hosts)

    p = sub.add_parser("bench", help="run one of the benchmarks in scripts/bench_*.py")
    p.add_argument("name", help="the benchmark, e.g. twin for scripts/bench_twin.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments")
    p.set_defaults(func=cmd_bench)

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
             ("SPREAD", "--spread"), ("LOADGEN_PROCESSES", "--loadgen-processes"),
             ("DEADLINE", "--deadline"), ("PRECISION", "--precision"), ("LIVE", "--live"),
             ("LIVE_HOST", "--live-host"))
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
    "provision": (("INVENTORY", "--inventory"),),
    "stop": (("INVENTORY", "--inventory"),),
    "teardown": (("INVENTORY", "--inventory"),),
    "bench": (("NAME", "name"), ("ARGS", "args")),
    "lint": (),
    "show": (),
    "status": (("OUT", "--out"),),
}
# Targets that take the scenario's layers (SCENARIO, HARDWARE, SET, MODEL, DURATION).
_LAYERED = {"baseline", "sweep", "calibrate", "combo", "tune", "stress", "claims", "lint", "show",
            "autotune"}
_REQUIRED = {"sweep": ("PARAM", "make sweep PARAM=max-num-seqs"),
             "stress": ("SHAPE", "make stress SHAPE=ramp (ramp, step, spike or soak)"),
             "combo": ("PARAMS or GRID", "make combo PARAMS=max-num-seqs,max-num-batched-tokens"),
             "bench": ("NAME", "make bench NAME=twin (make help lists them)")}
# Read by the container inventories from the environment (inventory/container.yml), not options.
_INVENTORY_VARS = ("VLLM_VENV", "LAB_ROOT")
_SWITCHES = {"--resume", "--spread", "--fit-only", "--baseline", "--live"}
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

    for name in _INVENTORY_VARS:
        var(name)  # refused here, with a sentence, when it holds a control character
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
        elif option == "name":
            if text.startswith("-"):
                raise UsageError(f"{name}={text!r} is not allowed: a benchmark's name, e.g. "
                                 f"{name}=twin (make help lists them)")
            argv.append(text)  # positional: checked against scripts/bench_*.py by the command
        elif option == "args":
            argv += _words(name, text)
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


# Values the Makefile gives variables left unset: a resume command leaves them out too.
_MAKE_DEFAULTS = {"SCENARIO": "default", "INVENTORY": "inventory/local.yml", "BACKEND": "twin",
                  "OUT": "reports"}
_NOT_RESUMED = {"RESUME", "EXPERIMENT", "DEADLINE"}


def _make_resume_command(target: str, env: Mapping[str, str]) -> Callable[..., str]:
    """The make command that resumes an experiment of ``make TARGET``: the variables it was given
    (but RESUME, EXPERIMENT and DEADLINE, and those ``changes`` replace, e.g. TRIALS left),
    then RESUME=1 EXPERIMENT=<id>, quoted for a shell."""
    names = [n for n, _ in _SCENARIO_VARS] + ["SET", "MODEL", "DURATION"] if target in _LAYERED else []
    names += [n for n, _ in MAKE_TARGETS.get(target, ()) if n not in names]

    def command(exp_id: str, **changes: object) -> str:
        words = [f"{n}={text}" for n in names if n not in _NOT_RESUMED and n not in changes
                 and (text := env.get(f"LAB_MAKE_{n}", "").strip()) and _MAKE_DEFAULTS.get(n) != text]
        words += [f"{n}={v}" for n, v in changes.items()]
        return shlex.join(["make", target, *words, "RESUME=1", f"EXPERIMENT={exp_id}"])
    return command


def _resume_command(argv: list[str]) -> Callable[..., str]:
    """The lab command line that resumes an experiment: this one without --deadline,
    --experiment, --resume (and the options ``changes`` replace, by make name), then
    --resume --experiment=<id>."""
    options = {name: option for vars_ in MAKE_TARGETS.values() for name, option in vars_}

    def command(exp_id: str, **changes: object) -> str:
        dropped = {"--resume", "--deadline", "--experiment", *(options[n] for n in changes)}
        words, skip = [], False
        for word in argv:
            if skip or word.partition("=")[0] in dropped:
                skip = not skip and word in dropped and word != "--resume"  # its value is the next word
                continue
            words.append(word)
        words += [f"{options[n]}={v}" for n, v in changes.items()]
        return shlex.join(["scripts/lab.py", *words, "--resume", f"--experiment={exp_id}"])
    return command


def _store_of(args: argparse.Namespace | None) -> Path:
    if args is None or not hasattr(args, "out"):
        return Path("reports/lab.db")
    return experiment.store_path(args.out, args.store)


def main(argv: list[str] | None = None) -> int:
    """Run one lab command; a bad input is one sentence on stderr and exit status 2, a long
    command stopped for its DEADLINE exits experiment.EXIT_DEADLINE (75), Ctrl-C 130.

    ``lab make TARGET`` takes its inputs from the LAB_MAKE_* variables the Makefile exports.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    names: dict[str, str] = {}
    args = None
    try:
        resume_command = None
        if argv[:1] == ["make"]:
            argv, names = make_argv(argv[1] if len(argv) > 1 else "", os.environ)
            resume_command = _make_resume_command(argv[0], os.environ)
        args = build_parser().parse_args(argv)
        args.resume_command = resume_command or _resume_command(argv)
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
