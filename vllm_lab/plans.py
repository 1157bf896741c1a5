"""The tuning method's plans: which runs to take, and taking them into the store.

A plan is a list of ``Point``s (a resolved scenario, the values it varies, a repeat index). The
runner groups points by serve flags so a server starts once per serve value, records each run
when it ends (failures included, as data with their cause), skips runs a resumed experiment already
has, spreads serve groups over the inventory's hosts, and stops every server on Ctrl-C.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from vllm_lab import flags as flagcat
from vllm_lab import outdir
from vllm_lab.backends import START_STATUS, Backend, Measurement
from vllm_lab.inputs import shown
from vllm_lab.lint import hardware_refusal, value_problem
from vllm_lab.models import DTYPE_BYTES, load_model_shape
from vllm_lab.scenarios import Scenario, ScenarioError, deep_merge, parse_override
from vllm_lab.store import RETRIED_ON_RESUME, RunRecord, RunStatus, Store, run_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    """One run to take: the scenario as it will run, the values it varies, and its repeat index."""

    scenario: Scenario
    values: dict[str, Any]
    repeat: int = 0

    @cached_property
    def key(self) -> str:
        """The run's identity in the store (hashed once: resume, work folders and records ask)."""
        return run_identity(self.scenario.to_record(), self.repeat)

    @cached_property
    def serve_key(self) -> str:
        """Points with the same serve flags share one server start."""
        return json.dumps(self.scenario.serve, sort_keys=True, default=str)


# -- what a parameter is, and the values to try -------------------------------------------------

def is_serve_flag(param: str) -> bool:
    """A vLLM flag (restart needed) rather than a scenario path like load.shape.level or workload."""
    return "." not in param and param not in Scenario.model_fields


def apply_value(scenario: Scenario, param: str, value: Any, variable: str = "PARAM") -> Scenario:
    """The scenario with ``param`` set: a serve flag, or a dotted path (load.shape.level);
    ``variable``: the make variable the value came from, which an error sentence names."""
    if is_serve_flag(param):
        return scenario.with_serve(**{param: value})
    data = deep_merge(scenario.to_record(), parse_override(f"{param}={json.dumps(value)}"))
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:  # pydantic's many lines, said in one sentence
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        given = (f"PARAM={param} with value {shown(value, param)}" if variable == "PARAM"
                 else f"{variable}: {param}={shown(value, param)}")
        raise ScenarioError(f"{given}: not a valid scenario value ({where}: {first['msg']})") from None


def check_param(param: str, scenario: Scenario, variable: str = "PARAM") -> str:
    """``param`` if a run can vary it: a flag vLLM knows at the scenario's version, or a scenario
    key (load.shape.level); else ScenarioError. Without this the predictor, which ignores flags
    it does not model, would "measure" an unknown flag as identical figures."""
    name = param.removeprefix("serve.")
    if any(flagcat.is_secret(part) for part in param.split(".")):
        # Its values would be on the command line, in the plan's meta and in every label.
        raise ScenarioError(f"{variable}={param}: a secret is not swept; give it once in the "
                            f"scenario file, VLLM_API_KEY in the environment, or vllm_api_key "
                            f"in the inventory's ansible-vault")
    if not is_serve_flag(name):
        if param.split(".")[0] not in Scenario.model_fields:
            raise ScenarioError(f"{variable}={param}: not a vLLM flag nor a scenario key; write a "
                                f"flag (max-num-seqs) or a dotted key (load.shape.level)")
        return param
    change = flagcat.changes_for(scenario.vllm_version).get(name)
    if change:  # every value would fail the start, or read alike
        raise ScenarioError(f"{variable}={param}: {change.problem(scenario.vllm_version)}")
    known = flagcat.real_vllm_flag_names() or set(flagcat.FLAGS)
    if name in known:
        return param
    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise ScenarioError(f"{variable}={param}: not a flag of vLLM {scenario.vllm_version}{hint}; "
                        f"make lint lists what a scenario may set")


def check_modelled(param: str, backend: str, variable: str = "PARAM") -> None:
    """ScenarioError when ``backend`` does not model flag ``param``: it would read every value
    the same, and name a best among equal figures (the flags catalog's ``twin_models``)."""
    why = flagcat.unmodelled(param.removeprefix("serve."), backend)
    if why:
        raise ScenarioError(f"{variable}={param}: BACKEND={backend} does not model it ({why}), so "
                            f"every value would read the same; measure it on real vLLM "
                            f"(BACKEND=vllm INVENTORY=...)")


def parse_values(param: str, text: str, variable: str = "VALUES") -> list[Any]:
    """VALUES="8,16,32" for PARAM, typed as the flag's catalog entry says; ``variable``: the name
    the user gave them by (LEVELS for a stress test's), which an error sentence says."""
    flag = flagcat.FLAGS.get(param)
    out = []
    for raw in (t.strip() for t in text.split(",") if t.strip()):
        kind = flag.kind if flag else ("int" if raw.lstrip("+-").isdigit() else "float")
        try:
            if kind == "int":
                out.append(int(raw))
            elif kind == "float":
                out.append(float(raw))
            elif kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(raw)
                out.append(raw.lower() in ("true", "1", "yes"))
            else:
                out.append(raw)
        except ValueError:
            allowed = flag.describe_range() if flag else "a number"
            raise ScenarioError(f"{variable}: {shown(raw, param)} is not a value of {param} "
                                f"({allowed})") from None
        # A value vLLM's parser refuses is the user's to fix now, not a failed start to record.
        problem = flag and value_problem(flag, out[-1])
        if problem:
            raise ScenarioError(f"{variable}: {problem} ({param})")
    if not out:
        raise ScenarioError(f"{variable} is empty; give comma-separated values, e.g. "
                            f"{variable}=8,16,32")
    return out


def _weights_share(scenario: Scenario) -> float:
    """Share of one GPU's memory the model's weights take (0 when the model is unknown)."""
    try:
        shape = load_model_shape(str(scenario.serve["model"]))
    except (ValueError, OSError, KeyError):
        return 0.0
    dtype = scenario.serve.get("dtype", "auto")
    dtype = shape.torch_dtype if dtype == "auto" else dtype
    tp = scenario.serve.get("tensor-parallel-size", 1)
    return shape.num_params * DTYPE_BYTES.get(dtype, 2) / tp / (scenario.hardware.memory_gib * 1024**3)


def reference_value(param: str, scenario: Scenario) -> Any:
    """The value a sweep of ``param`` is compared with: the scenario's own, else vLLM's default on
    the scenario's GPU (None: a scenario key, or a flag whose default depends on the model)."""
    if not is_serve_flag(param) or param not in flagcat.FLAGS:
        return None
    if param in scenario.serve:
        return scenario.serve[param]
    hw = scenario.hardware
    return flagcat.engine_defaults(hw.memory_gib, hw.name, names=[param])[param]


def reference_point(scenario: Scenario, params: Sequence[str]) -> dict[str, Any] | None:
    """The point of vLLM's defaults (the scenario's own flags) among ``params``; None when a
    parameter has no such value (a load level, max-model-len)."""
    values = {p: reference_value(p, scenario) for p in params}
    return None if any(v is None for v in values.values()) else values


def kv_sequences(scenario: Scenario) -> int | None:
    """How many sequences of the workload's mean length (prompt and output) the KV cache holds on
    this GPU with this model, at vLLM's memory share; None when the model or lengths are unknown."""
    try:
        shape = load_model_shape(str(scenario.serve["model"]))
    except (ValueError, OSError, KeyError):
        return None
    lin, lout = scenario.workload.lengths()
    if lin is None or lout is None:
        return None
    util = float(scenario.serve.get("gpu-memory-utilization", flagcat.default("gpu-memory-utilization")))
    free = (util - _weights_share(scenario)) * scenario.hardware.memory_gib * 1024**3
    per_sequence = shape.kv_bytes_per_token(2) * (lin.mean + lout.mean)
    return max(int(free / per_sequence), 1) if free > 0 else 1


def _seqs_ladder(scenario: Scenario, default: int) -> list[int]:
    """max-num-seqs where it binds: a batch cap matters only below the sequences the load keeps in
    flight (a closed loop's users) and the KV cache can hold, so the ladder is a quarter, a half
    and all of that limit, and vLLM's default, the reference (above the limit every value runs
    the same batch)."""
    limit = min(v for v in (default, kv_sequences(scenario),
                            int(scenario.load.shape.level) if scenario.load.mode == "closed" else None)
                if v)
    low = [v for v in (limit // 4, limit // 2, limit) if v >= 8] or [min(8, default)]
    return sorted({*low, default})


def default_values(param: str, scenario: Scenario) -> list[Any]:
    """A ladder for ``param`` fitted to the hardware preset, the model and the load, with the
    reference (``reference_value``: vLLM's default on this GPU) always on it."""
    hw = scenario.hardware
    defaults = flagcat.engine_defaults(hw.memory_gib, hw.name)
    seqs = scenario.serve.get("max-num-seqs", defaults["max-num-seqs"])
    ladders: dict[str, Callable[[], list[Any]]] = {
        "max-num-seqs": lambda: _seqs_ladder(scenario, seqs),
        # vLLM refuses a token budget below max-num-seqs: the ladder starts there.
        "max-num-batched-tokens": lambda: [v for v in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
                                           if v >= seqs][:6],
        "gpu-memory-utilization": lambda: _memory_ladder(scenario),
        "block-size": lambda: [16, 32, 64, 128],
        "max-model-len": lambda: _length_ladder(scenario),
        "enforce-eager": lambda: [False, True],
        "dtype": lambda: ["bfloat16", "float16", "float32"],
        "kv-cache-dtype": lambda: ["auto", "fp8"],
        "enable-prefix-caching": lambda: [True, False],
        "tensor-parallel-size": lambda: [n for n in (1, 2, 4, 8) if n <= hw.gpu_count],
        "long-prefill-token-threshold": lambda: [0, 256, 1024, 4096],
        "async-scheduling": lambda: [False, True],
        "scheduling-policy": lambda: ["fcfs", "priority"],
        "kv-offloading-size": lambda: [4.0, 16.0, 64.0],
        "load.shape.level": lambda: [1, 4, 16, 64, 128, 256],
    }
    if param not in ladders:
        known = ", ".join(ladders)
        raise ScenarioError(f"PARAM {param!r} has no default ladder; give VALUES=a,b,c "
                            f"(ladders exist for: {known})")
    values, reference = ladders[param](), reference_value(param, scenario)
    if reference is None or reference in values:
        return values
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in [*values, reference])
    return sorted([*values, reference]) if numeric else [reference, *values]


def _memory_ladder(scenario: Scenario) -> list[float]:
    # Start just above what the weights need, so the lowest point still starts.
    floor = _weights_share(scenario) + 0.05
    return [v for v in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95) if v >= floor] or [0.9, 0.95]


def _length_ladder(scenario: Scenario) -> list[int]:
    try:
        longest = load_model_shape(str(scenario.serve["model"])).max_position_embeddings
    except (ValueError, OSError, KeyError):
        longest = 32768
    return [v for v in (2048, 4096, 8192, 16384, 32768, 131072) if v <= longest]


# Runs one plan may hold: far past any real experiment (a week of 60 s runs), so REPEATS=10**9 or
# a GRID of three 1000-value ladders is one sentence before a list of a billion points is built.
MAX_RUNS = 10_000


def check_size(runs: int, what: str) -> None:
    """ScenarioError when a plan of ``runs`` runs (``what`` says how it was asked for) is too big."""
    if runs > MAX_RUNS:
        raise ScenarioError(f"{what}: {runs:,} runs, more than a plan may hold ({MAX_RUNS:,}); "
                            f"ask for fewer values or repeats")


def baseline_points(scenario: Scenario, repeats: int = 3) -> list[Point]:
    """vLLM's defaults on the scenario's traffic, repeated."""
    check_size(repeats, f"REPEATS={repeats}")
    return [Point(scenario, {}, r) for r in range(repeats)]


def sweep_points(scenario: Scenario, param: str, values: Sequence[Any], repeats: int = 1) -> list[Point]:
    """One flag (or load parameter) over ``values``, each repeated; serve values grouped together."""
    check_size(len(values) * repeats, f"{len(values)} values of {param}, {repeats} repeat(s) each")
    return [Point(apply_value(scenario, param, v), {param: v}, r)
            for v in values for r in range(repeats)]


def sweep_plan(scenario: Scenario, param: str, values_text: str | None,
               repeats: int = 1) -> tuple[list[Any], list[Point]]:
    """A sweep's values and points in one pass: ``param`` checked, VALUES typed (else the
    hardware's ladder), vLLM's default (``reference_value``) among them, each value's scenario
    resolved once per repeat."""
    check_param(param, scenario)
    values = parse_values(param, values_text) if values_text else default_values(param, scenario)
    reference = reference_value(param, scenario)
    if reference is not None and reference not in values:
        # vLLM's defaults are every sweep's reference: each point's effect is read against them.
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in [*values, reference])
        values = sorted([*values, reference]) if numeric else [reference, *values]
    return values, sweep_points(scenario, param, values, repeats)


def grid_points(scenario: Scenario, grid: dict[str, Sequence[Any]], repeats: int = 1) -> list[Point]:
    """Every combination of several parameters' values."""
    check_size(math.prod(len(v) for v in grid.values()) * repeats,
               f"a grid of {' x '.join(str(len(v)) for v in grid.values())} values, "
               f"{repeats} repeat(s) each")
    points = [Point(scenario, {}, 0)]
    for param, values in grid.items():
        points = [Point(apply_value(p.scenario, param, v), {**p.values, param: v}, 0)
                  for p in points for v in values]
    return [Point(p.scenario, p.values, r) for p in points for r in range(repeats)]


# -- taking the runs ---------------------------------------------------------------------------

def group_by_server(points: Sequence[Point]) -> list[list[Point]]:
    """Consecutive runs per serve flags, in first-seen order: one server start per group."""
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(p.serve_key, []).append(p)
    return list(groups.values())


# A server start costs about as much as this many runs (real vLLM: ~75 s against ~20 s runs).
START_COST_RUNS = 4


def deal(groups: Sequence[list[Point]], hosts: Sequence[str | None]) -> dict[str | None, list[list[Point]]]:
    """Serve groups to hosts, each to the least loaded so far (a start plus its runs), in plan order."""
    shares: dict[str | None, list[list[Point]]] = {h: [] for h in hosts}
    load = dict.fromkeys(hosts, 0)
    for group in groups:
        host = min(hosts, key=lambda h: load[h])  # ties go to the first host
        shares[host].append(group)
        load[host] += START_COST_RUNS + len(group)
    return shares


@dataclass
class Plan:
    """An experiment to take: its id, its step, its points and where its work files go."""

    experiment_id: str
    step: str
    points: list[Point]
    meta: dict[str, Any]


class PlanHooks(Protocol):
    """Who hears of a plan's runs (the command's progress): the plan, each run's start and end."""

    def begin(self, points: Sequence[Point], todo: Sequence[Point], groups: int, hosts: int = 1) -> None:
        """The plan's points, those this call takes, its server starts and busy hosts."""

    def point_started(self, values: dict[str, Any], repeat: int, host: str | None = None) -> None:
        """A run begins on ``host``."""

    def point_done(self, values: dict[str, Any], repeat: int, status: str, summary: dict[str, Any],
                   error: str = "", host: str | None = None) -> None:
        """A run ended, recorded with its status."""


def execute(plan: Plan, backend: Backend, store_path: Path, workdir: Path,
            hosts: Sequence[str | None] = (None,),
            on_run: Callable[[Point, Measurement], None] | None = None,
            progress: PlanHooks | None = None) -> dict[str, int]:
    """Take every point not yet in the store; return counts by status (the runs this call took).

    ``progress`` hears of each run's start and end (point i of N, run j of k, its figures).

    Serve groups are dealt to ``hosts`` round-robin and each host works through its share in its
    own thread; every run is committed as it ends, so Ctrl-C loses only the runs in flight.
    """
    outdir.inside(workdir.parent, workdir)  # OUT/.work: refused when it is a link out of OUT
    check_inputs(plan.points)
    todo, failed_before = _todo(plan, store_path)
    groups = group_by_server(todo)
    shares = deal(groups, hosts)
    busy = [h for h in hosts if shares[h]]
    if progress:
        progress.begin(plan.points, todo, len(groups), len(busy))
    prune_work(workdir)
    taking = Taking(plan, backend, store_path, workdir, _refusals(todo), failed_before, on_run, progress)
    if len(busy) <= 1:
        # One host: work in this thread, so Ctrl-C lands inside the run and its cleanup runs.
        for h in busy:
            taking.work(h, shares[h])
    else:
        _in_threads(taking, {h: shares[h] for h in busy})
    _remove_work(taking.recorded, workdir / plan.experiment_id)
    return taking.counts


_CHECKED: set[str] = set()  # workloads this process has built once: a search's trials reuse one


def check_inputs(points: Sequence[Point]) -> None:
    """Every distinct workload of the points built once (its file's records, its tokenizer, its
    trace) before anything is recorded or started: a file the load cannot be made of is one
    sentence (ScenarioError), not a plan of runs whose load generators all fail alike."""
    from vllm_lab.traffic.workloads import check_workload  # Locust stays out of plain imports

    for point in points:
        key = point.scenario.workload.model_dump_json() + point.scenario.load.model_dump_json()
        if key in _CHECKED:
            continue
        try:
            check_workload(point.scenario.workload, point.scenario.load)
        except ValueError as e:  # WorkloadError, TraceError, InputError: one sentence each
            raise ScenarioError(str(e)) from None
        _CHECKED.add(key)


def _todo(plan: Plan, store_path: Path) -> tuple[list[Point], dict[tuple[str, str], Measurement]]:
    """The plan's points not yet in the store (the experiment recorded first, for resume), and per
    server the start failure a recorded repeat of it met that the same flags would meet again: a
    resume records its other repeats as that failure instead of starting it (minutes on a GPU)."""
    with Store(store_path) as store:
        store.create_experiment(plan.experiment_id, plan.step, plan.points[0].scenario.name, plan.meta)
        done = store.finished_keys(plan.experiment_id)
        failed = {} if len(done) == 0 else _failed_starts(plan, store)
    todo = [p for p in plan.points if p.key not in done]
    if len(todo) < len(plan.points):
        log.info("resuming %s: %d of %d runs already recorded", plan.experiment_id,
                 len(plan.points) - len(todo), len(plan.points))
    return todo, failed


def _failed_starts(plan: Plan, store: Store) -> dict[tuple[str, str], Measurement]:
    """Per server of the plan, its first recorded start failure of a determined kind (OOM, refused)."""
    runs = store.runs(plan.experiment_id)
    runs = runs[runs["status"].isin([str(s) for s in DETERMINED_START_FAILURES])]
    by_key = {p.key: p for p in plan.points}
    failed: dict[tuple[str, str], Measurement] = {}
    for r in runs.itertuples():
        if r.run_key in by_key:
            failed.setdefault(_server(by_key[r.run_key]), Measurement(
                status=RunStatus(r.status), started=r.started, ended=r.ended, host=r.host or "",
                error=r.error))
    return failed


def _refusals(todo: Sequence[Point]) -> dict[tuple[str, str], Any]:
    """Per server (flags on a GPU), why the hardware refuses it before launch, or None: one check
    per server, not per repeat, since they refuse alike."""
    refusals = {}
    for p in todo:
        if _server(p) not in refusals:
            refusals[_server(p)] = hardware_refusal(p.scenario)
    return refusals


class Taking:
    """The runs one ``execute`` takes: each measured (or refused before launch), recorded as it
    ends and counted; ``stop`` ends every host's share after its run in flight."""

    def __init__(self, plan: Plan, backend: Backend, store_path: Path, workdir: Path,
                 refusals: dict, failed_starts: dict[tuple[str, str], Measurement],
                 on_run: Callable[[Point, Measurement], None] | None, progress: PlanHooks | None):
        self.plan, self.backend, self.store_path, self.workdir = plan, backend, store_path, workdir
        self.refusals, self.on_run, self.progress = refusals, on_run, progress
        self.counts: dict[str, int] = {}
        self.recorded: list[Path] = []
        # Per server, its first start failure that the same flags would meet again (recorded by
        # an earlier call, or met in this one).
        self.failed_starts = dict(failed_starts)
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def work(self, host: str | None, groups: Sequence[list[Point]]) -> None:
        """Take a host's share of serve groups, then stop its server."""
        try:
            with Store(self.store_path) as store:  # one SQLite connection per thread
                for point in (p for group in groups for p in group):
                    if self.stop.is_set() or not self.take(point, host, store):
                        return
        finally:
            self.backend.close(host)

    def take(self, point: Point, host: str | None, store: Store) -> bool:
        """Measure one point and record it; False when the plan was stopped during its run."""
        if self.progress:
            self.progress.point_started(point.values, point.repeat, host)
        refusal = self.refusals[_server(point)]
        # An interrupted attempt's folder is reused: nothing in it may be a link out of OUT.
        folder = outdir.no_links_within(self.workdir,
                                        self.workdir / self.plan.experiment_id / point.key)
        m = (Measurement(status=RunStatus.FAILED_START, started=time.time(), ended=time.time(),
                         host=host or "", error=f"refused before launch: {refusal.message}")
             if refusal else self._failed_again(point, host) or self.backend.measure(point.scenario, host, folder))
        if self.stop.is_set():
            return False  # interrupted mid-run: its figures are not a measurement
        if m.status in DETERMINED_START_FAILURES:
            self.failed_starts.setdefault(_server(point), m)
        store.record_run(_record(self.plan, point, self.backend, m), m.samples, m.server_metrics)
        with self.lock:
            self.counts[str(m.status)] = self.counts.get(str(m.status), 0) + 1  # plain words when printed
            self.recorded.append(folder)
        if self.progress:
            self.progress.point_done(point.values, point.repeat, m.status, m.summary, m.error, host)
        if self.on_run:
            self.on_run(point, m)
        return True

    def _failed_again(self, point: Point, host: str | None) -> Measurement | None:
        """A repeat of a server whose flags already failed to start for memory or were refused:
        recorded as that failure, not started again (a start costs minutes on a GPU, and the same
        flags on the same GPU fail alike)."""
        first = self.failed_starts.get(_server(point))
        if first is None:
            return None
        why = first.error.splitlines()[0] if first.error else str(first.status)
        return Measurement(status=first.status, started=time.time(), ended=time.time(), host=host or "",
                           error=f"not started again: the same server failed to start before ({why})")


def _in_threads(taking: Taking, shares: dict[str | None, list[list[Point]]]) -> None:
    """Each host's share in its own thread; Ctrl-C stops them all, their runs in flight unrecorded."""
    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        futures = [pool.submit(taking.work, h, groups) for h, groups in shares.items()]
        try:
            for f in futures:
                while not f.done():
                    time.sleep(0.2)  # wake for Ctrl-C: a blocking result() would not
                f.result()
        except KeyboardInterrupt:
            taking.stop.set()
            for h in shares:
                taking.backend.close(h)  # the runs in flight fail fast and are not recorded
            raise


# Start failures that the same flags on the same GPU repeat (out of memory, a flag refused): the
# ones a resume does not retry either. A start that timed out or crashed may be the machine's
# moment, and is tried again.
DETERMINED_START_FAILURES = tuple(s for s in dict.fromkeys(START_STATUS.values()) if s not in RETRIED_ON_RESUME)


def _server(point: Point) -> tuple[str, str]:
    return point.serve_key, point.scenario.hardware.model_dump_json()


# Work folders (Locust's files, logs) of runs that an interrupted command left behind are kept
# this long for a look, then pruned; a finished command removes its recorded runs' own at once.
WORK_KEEP_S = 7 * 24 * 3600


def _remove_work(recorded: Sequence[Path], experiment_work: Path) -> None:
    """Remove the work folders of runs now in the store, and the experiment's folder when empty."""
    for folder in recorded:
        outdir.remove_tree(experiment_work, folder)
    try:
        experiment_work.rmdir()
    except OSError:
        pass  # not empty (an interrupted run's files) or never made (the predictor)


def prune_work(workdir: Path, keep_s: float = WORK_KEEP_S) -> None:
    """Remove experiment work folders under ``workdir`` (OUT/.work) untouched for ``keep_s``
    seconds; OutsideOut when ``workdir`` is a link out of OUT, and a link in it is left alone."""
    outdir.inside(workdir.parent, workdir)
    if not workdir.is_dir():
        return
    cutoff = time.time() - keep_s
    for folder in workdir.iterdir():
        try:
            if not folder.is_symlink() and folder.is_dir() and folder.stat().st_mtime < cutoff:
                outdir.remove_tree(workdir, folder)
        except OSError:
            continue


def _record(plan: Plan, point: Point, backend: Backend, m: Measurement) -> RunRecord:
    s = point.scenario
    return RunRecord(
        experiment_id=plan.experiment_id, run_key=point.key, step=plan.step, scenario_name=s.name,
        scenario=s.to_record(), status=m.status, started=m.started, ended=m.ended,
        point=point.values, repeat=point.repeat, host=m.host, gpu_model=s.hardware.name,
        gpu_count=int(s.serve.get("tensor-parallel-size", 1)), vllm_version=s.vllm_version,
        backend=backend.name, error=m.error, summary=m.summary)

