"""Where a point is measured: a live server (real vLLM or the twin, through the playbooks and
Locust), or the twin's offline predictor. Plans see one interface, ``Backend``.

A live backend keeps one server per host and restarts it only when the serve flags change, so a
sweep over a load parameter (``load.shape.level``) reuses the running server. It tells the
``RunHooks`` it was given (the command's progress) which phase the run in flight is in and its
live figures; nobody listens by default.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from vllm_lab import audit, serving, shutdown
from vllm_lab.failures import request_failures
from vllm_lab.prediction import (
    energy_series,
    engine_steps,
    modelled_energy,
    predicted_arrivals,
    predicted_requests,
    prediction_samples,
)
from vllm_lab.run_summary import RunSummary
from vllm_lab.scenarios import Scenario, ScenarioError
from vllm_lab.store import RunStatus
from vllm_lab.summary import summarize, unsteady_reason
from vllm_lab.traffic import host_cpu
from vllm_lab.traffic.runner import TrafficError

log = logging.getLogger(__name__)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the machine's fault, not the run's

# How a failed start is recorded, by its cause.
START_STATUS = {"oom": RunStatus.OOM, "refused-flag": RunStatus.FAILED_START,
                "start-timeout": RunStatus.TIMEOUT, "crashed": RunStatus.CRASHED,
                "unreachable": RunStatus.UNREACHABLE, "refused-config": RunStatus.FAILED_START}


@dataclass
class Measurement:
    """What one run produced, ready for the store."""

    status: RunStatus
    started: float
    ended: float
    host: str = ""
    error: str = ""
    summary: RunSummary = field(default_factory=RunSummary)
    samples: pd.DataFrame | None = None
    server_metrics: pd.DataFrame | None = None

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)
        self.summary = RunSummary.of(self.summary)  # the figures summarize computed will do


class RunHooks(Protocol):
    """Who hears of the run in flight on this thread: its phases and its live figures."""

    def phase(self, name: str, **info: Any) -> None:
        """The run enters a phase: ``starting`` a server, ``measuring`` the window, ..."""

    def figures(self, **figures: Any) -> None:
        """Live figures of the run (requests, tok_s, errors), or its Locust web UI's ``web_url``."""


class QuietHooks:
    """Hooks nobody listens to: a backend built without a command's progress."""

    def phase(self, name: str, **info: Any) -> None:
        """Nothing to tell."""

    def figures(self, **figures: Any) -> None:
        """Nothing to show."""


QUIET = QuietHooks()


class Backend(Protocol):
    """Measures points; ``name`` is recorded with each run."""

    name: str

    def measure(self, scenario: Scenario, host: str | None, workdir: Path) -> Measurement: ...

    def close(self, host: str | None) -> None: ...


def _served_model(scenario: Scenario) -> str:
    return str(scenario.serve.get("served-model-name") or scenario.serve["model"])


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


# The most of a reply _post reads: a warm-up's 8 tokens are well under 1 KiB. A server that ignores
# max_tokens and never ends its reply would otherwise hold the read, and the sweep, forever (the
# timeout bounds each read, and such a server never stops sending).
_REPLY_CAP = 16 * 1024


def _post(url: str, body: dict | None, api_key: str | None, timeout: float = 120.0) -> int:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read(_REPLY_CAP)
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        # HTTPException: a reply cut off mid-body (IncompleteRead) or a garbled status line, a
        # server's fault like no answer at all; it must not end the command.
        return 0


def _evidence(log_tail: str) -> str:
    """The log line that says why a start failed (an out-of-memory line, an error line), else the last."""
    oom = serving.oom_line(log_tail)  # the root cause; a traceback's last line only says "failed"
    if oom:
        return oom[:300]
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error:" in ln:
            return ln[-300:]
    return lines[-1][-300:] if lines else "no log"


class LiveBackend:
    """Real vLLM or the twin on the inventory's hosts, driven by Locust."""

    # A remote load generator's cores are not known here; it runs nothing but the load.
    REMOTE_CORES = 16

    def __init__(self, name: str, inventory: Path, api_key: str | None = None,
                 processes: int | None = None, experiment: str = "", live_host: str | None = None,
                 hooks: RunHooks = QUIET):
        self.name = name  # "twin" | "vllm"
        self.hooks = hooks  # the command's progress: the phase and figures of the run in flight
        self.inventory = inventory
        self.experiment = experiment  # named in the lock on each instance this process holds
        self.api_key = api_key
        self.processes = processes  # Locust processes per load-generator host; None: sized per run
        self._running: dict[str | None, tuple[str, serving.Instance]] = {}
        self._starting: set[str | None] = set()
        self._workers: list | None = None  # the inventory's remote load generators, read once
        self.live_host = live_host  # LIVE=1: Locust's web UI on this address for each run
        self.stops_s = 0.0  # seconds this backend spent stopping servers (analysis.host_time)
        # Instances claimed (provisioning claims them all) and not yet given back by a stop of
        # every host: given back at exit, whatever ended the command.
        self.holding = False
        shutdown.on_exit(self.close_all)

    # -- server lifecycle ----------------------------------------------------------------------
    def _ensure_server(self, scenario: Scenario, host: str | None) -> serving.Instance:
        """The host's server for these serve flags (and, for the twin, the GPU it simulates):
        reused when they match and it is healthy, replaced by the serve playbook alone when they
        changed, stopped first when it no longer answers."""
        # A twin started for one GPU (its environment) simulates that GPU: another is a restart.
        simulated = scenario.hardware.model_dump(mode="json") if self.name == "twin" else None
        key = json.dumps([scenario.serve, simulated], sort_keys=True, default=str)
        current = self._running.get(host)
        healthy = bool(current) and _get(current[1].url + "/health") == 200
        if healthy and current[0] == key:
            return current[1]
        if healthy:
            # serve.yml replaces it (the role stops a server whose config changed, waits for its
            # GPUs, starts it again) under the lock this process keeps: no stop playbook first.
            self._starting.add(host)  # before it leaves _running: an interrupt still stops it
            del self._running[host]
        else:
            if current:
                self.hooks.phase("stopping the last server")
            self._stop(host, release=False)  # a restart keeps the instance's lock: no one takes it between
        # Marked before the start returns: an interrupt during a start must still stop the server.
        self._starting.add(host)
        self.hooks.phase("starting")
        instances = serving.start(
            scenario.serve, inventory=self.inventory, backend=self.name, limit=host,
            experiment=self.experiment,
            twin_profile=scenario.hardware.twin_profile if self.name == "twin" else None,
            extra_vars={"vllm_health_timeout_s": int(scenario.run.start_timeout_s),
                        # /reset_prefix_cache between runs is a dev-mode endpoint in vLLM (0.26
                        # too): asked for only when the runs reset the cache; the role keeps it
                        # off an address other hosts reach unless the inventory allows it.
                        "vllm_dev_mode": bool(scenario.run.clean),
                        # The twin simulates the scenario's GPU.
                        "vllm_environment": scenario.hardware.environment()},
            timeout=scenario.run.start_timeout_s + 120)
        instance = instances[0]
        self._running[host] = (key, instance)
        self._starting.discard(host)
        self._warm_up(scenario, instance)
        return instance

    def _warm_up(self, scenario: Scenario, instance: serving.Instance) -> None:
        """Send a few short requests and discard them: first-call costs stay out of the data."""
        body = {"model": _served_model(scenario), "prompt": "warm up " * 16, "max_tokens": 8,
                "ignore_eos": True}
        for _ in range(scenario.run.warmup_requests):
            _post(instance.url + "/v1/completions", body, self._api_key(scenario, instance))

    def _warm_up_runs(self, scenario: Scenario, instance: serving.Instance, workdir: Path) -> None:
        """``run.warmup_runs`` runs of the scenario's own load on a server just started, each
        taken as a run is and discarded: what a start leaves slow lasts longer than a few
        requests (vllm bench serve's --num-warmups sends its own requests at its concurrency too)."""
        for i in range(scenario.run.warmup_runs):
            self.hooks.phase(f"warm-up run {i + 1} of {scenario.run.warmup_runs} (discarded)")
            m = self.measure_on(scenario, instance, workdir / f"warm-up-{i + 1}")
            log.info("%s: warm-up run %d after the start, discarded: %s, %.0f output tok/s",
                     instance.url, i + 1, m.status, m.summary.get("output_throughput") or 0.0)

    def _api_key(self, scenario: Scenario, instance: serving.Instance) -> str | None:
        """The key the server got, from wherever it got it: the role's (scenario serve.api-key,
        inventory or vault vllm_api_key, the control node's VLLM_API_KEY), else the scenario's,
        else this lab's environment (a server the lab did not start)."""
        return instance.api_key or scenario.serve.get("api-key") or self.api_key or None

    def _load_generators(self) -> list | None:
        """The loadgen group's remote hosts (a Locust worker each, a master here); None: all local."""
        if self._workers is None:
            from vllm_lab.traffic.runner import loadgen_workers
            try:
                self._workers = [w for w in loadgen_workers(self.inventory) if not w.local]
            except RuntimeError:  # no loadgen group: the load runs here
                self._workers = []
            if self._workers:
                log.info("load from %s", ", ".join(w.name for w in self._workers))
        return self._workers or None

    def close(self, host: str | None) -> None:
        """Stop the host's server if this backend started one, and give its instances back."""
        self._stop(host, release=True)

    def close_all(self) -> None:
        """Stop every server this backend still runs and give the instances back (at exit: a
        command that ended by an error, or by a signal, leaves no server behind)."""
        for host in {*self._running, *self._starting}:
            self.close(host)
        if self.holding:
            self.holding = False
            serving.stop(self.inventory, experiment=self.experiment, release=True)

    def _stop(self, host: str | None, release: bool) -> None:
        started = self._running.pop(host, None) is not None
        if started or host in self._starting:
            self._starting.discard(host)
            began = time.time()
            with shutdown.shielded():  # a signal now waits until the server is stopped
                serving.stop(self.inventory, limit=host, experiment=self.experiment,
                             release=release)
            self.stops_s += time.time() - began
            if release and host is None:
                self.holding = False  # every host's instances are given back

    # -- one run -------------------------------------------------------------------------------
    def measure(self, scenario: Scenario, host: str | None, workdir: Path) -> Measurement:
        """Start (or reuse) the server, run the load, summarize and audit it against the server.

        A run whose failed requests (timeouts aside) pass ``load.failed_requests_threshold`` is
        ``failed-requests``, its error naming the dominant failure and what to do about it. A
        client-limited run (the load generator's own lag or CPU, or its figures against vLLM's
        /metrics) is run once more with twice the Locust processes; if it is still limited it is
        recorded as ``client-limited``. Both are kept out of every comparison.
        """
        started = time.time()
        before = self._running.get(host)
        try:
            instance = self._ensure_server(scenario, host)
        except serving.ServeError as e:
            self._running.pop(host, None)
            # Still marked as starting: the next start or close() stops whatever is left (a start
            # interrupted by Ctrl-C, a server still loading when the wait gave up).
            ended = time.time()
            return self._with_prediction(scenario, Measurement(
                status=START_STATUS.get(e.cause, RunStatus.FAILED_START), started=started, ended=ended,
                host=e.host or host or "", error=f"{e.cause}: {_evidence(e.log_tail)}\n{e.log_tail[-2000:]}",
                summary=RunSummary(server_start_s=ended - started)))
        # What came before the run on a server started for it: the host time a report accounts
        # for as starts and warm-up (analysis.host_time), not as the lab's own.
        before_run = {}
        if self._running.get(host) is not before:
            warm = time.time()
            self._warm_up_runs(scenario, instance, workdir)
            before_run = {"server_start_s": warm - started, "warmup_runs_s": time.time() - warm}
        m = self.measure_on(scenario, instance, workdir)
        m.summary.update(before_run)
        if m.status == RunStatus.CRASHED:
            self._running.pop(host, None)
        return self._with_prediction(scenario, m)

    def _with_prediction(self, scenario: Scenario, m: Measurement) -> Measurement:
        """On real vLLM, record what the twin predicts for the same scenario beside the run, so a
        report compares them from the store alone (a later twin does not change an old page)."""
        if self.name == "vllm":
            try:
                m.summary.twin_prediction = twin_prediction(scenario)
            except Exception as e:  # noqa: BLE001  a measured run is never lost to its prediction
                log.warning("the twin could not predict %s: %s", scenario.name, e)
                m.summary.twin_prediction = {"backend": PredictBackend.name, "predicted": False,
                                             "profile": scenario.hardware.twin_profile,
                                             "status": "failed-start", "error": str(e), "summary": {}}
        return m

    def measure_on(self, scenario: Scenario, instance: serving.Instance, workdir: Path) -> Measurement:
        """Run the scenario's load on a running instance (sized, audited, re-run once if limited).

        A load generator that fails (Locust killed or hung, a workload file it cannot read, a
        load-generator host gone) measured nothing of the server: the run is ``loadgen-failed``
        with that cause, not the server's failure (a search does not count it against the flags),
        so the plan goes on and a resume measures it again. A full disk is not a
        run's fault: it ends the command (OSError, exit 74).
        """
        started = time.time()
        try:
            return self._measure_load(scenario, instance, workdir, started)
        except (TrafficError, OSError) as e:
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise
            log.warning("%s: the load generator failed: %s", instance.url, e)
            cause = e if isinstance(e, TrafficError) else f"{type(e).__name__}: {e}"
            return Measurement(status=RunStatus.LOADGEN_FAILED, started=started,
                               ended=time.time(), host=instance.host,
                               error=f"load generator failed: {cause}"[:4000])

    def _measure_load(self, scenario: Scenario, instance: serving.Instance, workdir: Path,
                      started: float) -> Measurement:
        workers = self._load_generators()
        procs = self.processes or self._plan(scenario, workers)
        result, figures = self._run(scenario, instance, workdir, workers, procs)
        summary = RunSummary.of(figures)
        failures = request_failures(result.samples)
        failed = failures.rate > scenario.load.failed_requests_threshold
        limited = _client_limited(result, summary)
        more = min(2 * procs, self._cores(workers))
        # A run whose requests were refused measured nothing: more processes would not help.
        if limited and not failed and self.processes is None and more > procs:
            log.info("client-limited with %d Locust processes (%s): running again with %d",
                     procs, limited, more)
            result, figures = self._run(scenario, instance, workdir, workers, more)
            summary = RunSummary.of(figures, loadgen_rerun_of=procs)
            failures = request_failures(result.samples)
            failed = failures.rate > scenario.load.failed_requests_threshold
            limited = _client_limited(result, summary)
        ended = time.time()
        summary.update(failures.as_summary())
        status, error = RunStatus.OK, ""
        if _get(instance.url + "/health") != 200:
            status, error = RunStatus.CRASHED, "the server stopped answering /health during the run"
        elif failed:
            status = RunStatus.FAILED_REQUESTS
            error = (f"{failures.message()} (threshold "
                     f"{scenario.load.failed_requests_threshold:.0%}: load.failed_requests_threshold)")
        elif limited:
            status = RunStatus.CLIENT_LIMITED
            error = f"the load generator could not keep up ({limited}): these figures describe the client"
        elif missing := _unaudited(summary):
            status, error = RunStatus.UNAUDITED, missing
        elif unsteady := unsteady_reason(summary, scenario.load):
            status, error = RunStatus.UNSTEADY, f"the run did not hold its load: {unsteady}"
        return Measurement(status=status, started=started, ended=ended, host=instance.host,
                           error=error, summary=summary, samples=result.samples,
                           server_metrics=result.server_metrics)

    def _cores(self, workers: list | None) -> int:
        import os

        return self.REMOTE_CORES if workers else max(1, os.cpu_count() or 1)

    def _plan(self, scenario: Scenario, workers: list | None) -> int:
        from vllm_lab.traffic.sizing import plan_processes

        return plan_processes(scenario.load, scenario.workload, hosts=len(workers or []) or 1,
                              cores=self._cores(workers))

    def _run(self, scenario: Scenario, instance: serving.Instance, workdir: Path,
             workers: list | None, processes: int):
        """One load run on the instance: the result and its summary, server audit included."""
        from vllm_lab.traffic import run_load  # Locust's gevent patching stays out of plain imports

        api_key = self._api_key(scenario, instance)
        reset = None
        if scenario.run.clean:
            reset = _post(instance.url + "/reset_prefix_cache", None, api_key) == 200
            if not reset:
                log.warning("%s: /reset_prefix_cache did not answer 200 (a server without "
                            "VLLM_SERVER_DEV_MODE): this run starts with the last run's cache",
                            instance.url)
        self.hooks.phase("measuring", window_s=scenario.load.stop.duration_s)
        throttled = host_cpu.throttled_s()
        result = run_load(instance.url, _served_model(scenario), scenario.workload, scenario.load,
                          workdir, seed=scenario.run.seed, api_key=api_key,
                          processes=processes, workers_hosts=workers,
                          on_progress=self.hooks.figures, web_host=self.live_host)
        result.server_metrics = own_gpus(result.server_metrics, instance.gpus)
        summary = summarize(result.samples, scenario.slo, server_metrics=result.server_metrics,
                            load=scenario.load)
        view = audit.server_view(result.server_metrics)
        check = audit.audit(result.samples, view)
        summary.update(view.as_summary() if view else {})
        summary.update(check.as_summary() if check else {})
        summary.update(schedule_lag_p99_s=result.schedule_lag_p99_s,
                       loop_lag_p99_s=result.loop_lag_p99_s,
                       client_cpu_max=result.cpu_fraction_max,
                       loadgen_processes=processes, loadgen_hosts=len(workers or []) or 1)
        summary.update(_host_cpu(throttled, float(summary.get("send_span_s") or 0.0)))
        if reset is not None:
            summary["prefix_cache_reset"] = reset
        return result, summary


def _host_cpu(throttled_before: float | None, span_s: float) -> dict[str, float]:
    """The load generator's host's cores (and the physical cores among them), and the seconds its
    CPU quota stalled it over the run (where the kernel counts them)."""
    out = {"client_host_cpus": host_cpu.cpus()}
    physical = host_cpu.physical_cores()
    if physical is not None:
        out["client_host_physical_cores"] = float(physical)
    after = host_cpu.throttled_s()
    if throttled_before is not None and after is not None:
        stalled = out["client_host_throttled_s"] = max(0.0, after - throttled_before)
        if span_s and stalled > host_cpu.THROTTLED_SHARE_NOTED * span_s:
            log.warning("the host's CPU quota (%g cores) stalled this run for %.1f s of its %.0f s "
                        "of sending: its figures are the host's limit as much as the "
                        "configuration's", out["client_host_cpus"], stalled, span_s)
    return out


def _client_limited(result, summary: RunSummary) -> str:
    """Why the client could not keep up ("" when it could): its own lag and CPU, or the audit."""
    why = []
    if result.client_overloaded:
        why.append(f"client lag p99 {max(result.schedule_lag_p99_s, result.loop_lag_p99_s) * 1e3:.1f} ms, "
                   f"busiest process at {result.cpu_fraction_max:.0%} CPU")
    if summary.audit_client_limited:
        why.append(summary.audit_reason)
    return "; ".join(why)


def _unaudited(summary: RunSummary) -> str:
    """Why vLLM's /metrics gave no account of a live run ("" when they did): without it the
    client's figures cannot be checked against the server's, and a wedged server that answered
    nothing reads like a quiet one."""
    if summary.server_requests is None:
        return ("vLLM's /metrics gave no account of the run (no two scrapes of its request "
                "counters): its figures cannot be checked against the server's")
    if not summary.server_generation_tokens and (summary.output_throughput or 0) > 0:
        return ("vLLM's /metrics counted no generated token while the client read "
                f"{summary.output_throughput:.0f} tok/s: its figures cannot be checked against "
                "the server's")
    return ""


def own_gpus(metrics: pd.DataFrame | None, gpus: str) -> pd.DataFrame | None:
    """The series without nvidia-smi's and NVML's rows for GPUs the instance does not use (several
    servers share a host, one GPU each: a run must not count its neighbour's utilization)."""
    if metrics is None or metrics.empty or not gpus.strip():
        return metrics
    mine = {g.strip() for g in gpus.split(",") if g.strip()}

    def keep(labels: str) -> bool:
        parsed = json.loads(labels) if labels else {}
        return parsed.get("source") not in ("nvidia-smi", "nvml") or str(parsed.get("gpu")) in mine

    return metrics[metrics["labels"].map(keep)].reset_index(drop=True)


class PredictBackend:
    """The twin's offline predictor: the same engine on a virtual clock, no server, no Locust.

    A run takes seconds instead of minutes, so it pre-screens a search before GPU hours are spent.
    It runs the load as a live run does: a closed loop's users draw from one pool of the run's
    requests (``load.stop.max_requests``, else ``users x REQUESTS_PER_USER``); an open loop
    follows the live run's own arrival schedule (`traffic.arrivals.planned_arrivals`: the same
    times for the same seed, shapes included); both are read over the same steady window.
    """

    name = "predict"
    REQUESTS_PER_USER = 8
    MAX_REQUESTS = 1_000_000  # a few minutes of simulation; more is a typo, not a run

    def __init__(self, band: bool = False):
        # band: where the twin has vLLM's API server near its limit, predict the run once more at
        # that limit (``ttft_p50_api_limit``): what a user reads; autotune's ranking probes skip it.
        self.band = band

    @classmethod
    def check(cls, scenario: Scenario) -> int:
        """The requests the scenario's run predicts, or ScenarioError when there are too many."""
        load = scenario.load
        if load.mode == "replay":
            count = len(predicted_arrivals(scenario).times)
        elif load.stop.max_requests is not None:
            count = load.stop.max_requests
        elif load.mode == "closed":
            count = int(load.shape.level) * cls.REQUESTS_PER_USER
        else:
            peak = load.shape.level * (load.shape.spike_factor if load.shape.kind == "spike" else 1)
            count = max(int(peak * load.stop.duration_s), 1)
        if count > cls.MAX_REQUESTS:
            raise ScenarioError(f"load.shape.level={load.shape.level:g}: the predictor would simulate "
                                f"{count:,} requests, more than its {cls.MAX_REQUESTS:,}; lower the "
                                f"level (SET=load.shape.level=...) or the duration")
        cls._check_inputs(scenario)
        return count

    @staticmethod
    def _check_inputs(scenario: Scenario) -> None:
        """What the predictor needs beyond the load: a model shape it knows, and requests it can
        draw (lengths, or a trace); ScenarioError, one sentence, otherwise."""
        from vllm_lab.models import load_model_shape

        w = scenario.workload
        if w.source != "trace" and None in w.lengths():
            raise ScenarioError(f"workload.source {w.source}: the predictor draws requests from "
                                f"length distributions, which this workload has none of; give "
                                f"workload.input and workload.output, or measure it live "
                                f"(BACKEND=twin)")
        try:
            load_model_shape(str(scenario.serve["model"]))
        except ValueError as e:
            raise ScenarioError(f"serve.model: {e}; the predictor needs a model shape") from None

    def measure(self, scenario: Scenario, host: str | None, workdir: Path) -> Measurement:
        """Predict the run the scenario describes."""
        from vllm_lab.models import load_model_shape
        from vllm_lab.twin.engine import EngineStartError
        from vllm_lab.twin.frontend import LIMIT_CPU
        from vllm_lab.twin.predictor import predict
        from vllm_lab.twin.profile import load_profile, on_hardware

        started = time.time()
        count = self.check(scenario)
        arrivals = predicted_arrivals(scenario)
        if getattr(arrivals, "times", None) is not None:
            count = len(arrivals.times)
        requests = predicted_requests(scenario, count)
        try:
            profile = load_profile(scenario.hardware.twin_profile)
        except ValueError as e:  # a profile file that is missing or wrong: the scenario's to fix
            raise ScenarioError(f"hardware.twin_profile: {e}") from None
        model = load_model_shape(str(scenario.serve["model"]))
        try:
            profile = on_hardware(profile, scenario.hardware)
            prediction = predict(scenario.serve, profile, model, requests, arrivals,
                                 seed=scenario.run.seed)
        except EngineStartError as e:
            return Measurement(status=START_STATUS.get(e.cause, "failed-start"), started=started,
                               ended=time.time(), host="predictor", error=f"{e.cause}: {e}")
        samples = prediction_samples(prediction.requests)
        summary = summarize(samples, scenario.slo, load=scenario.load,
                            server_metrics=energy_series(prediction))
        if self.band and prediction.api_server_cpu >= LIMIT_CPU:
            summary["ttft_p50_api_limit"] = self._at_api_limit(scenario, profile, model, requests,
                                                               arrivals)
        summary.update(itl_p50=prediction.itl["p50"], itl_p90=prediction.itl["p90"],
                       itl_p99=prediction.itl["p99"], kv_usage_mean=prediction.kv_usage_mean,
                       kv_usage_max=prediction.kv_usage_peak,
                       preemptions=float(prediction.num_preemptions),
                       gpu_util_mean=prediction.gpu_utilization * 100,
                       kv_cache_tokens=prediction.kv_cache_tokens,
                       server_api_cpu=prediction.api_server_cpu, **engine_steps(prediction))
        summary.update(modelled_energy(prediction, summary))
        unsteady = unsteady_reason(summary, scenario.load)
        return Measurement(status=RunStatus.UNSTEADY if unsteady else RunStatus.OK, started=started,
                           ended=time.time(), host="predictor", summary=summary, samples=samples,
                           error=f"the run did not hold its load: {unsteady}" if unsteady else "")

    @staticmethod
    def _at_api_limit(scenario: Scenario, profile, model, requests, arrivals) -> float | None:
        """The run's TTFT p50 were vLLM's API server at its own limit (``twin.profile.at_api_limit``),
        read as the run's own is."""
        from vllm_lab.twin.predictor import predict
        from vllm_lab.twin.profile import at_api_limit

        limit = predict(scenario.serve, at_api_limit(profile), model, requests, arrivals,
                        seed=scenario.run.seed)
        return summarize(prediction_samples(limit.requests), scenario.slo,
                         load=scenario.load).get("ttft_p50")

    def close(self, host: str | None) -> None:
        """Nothing runs between predictions."""


def twin_prediction(scenario: Scenario) -> dict[str, Any]:
    """The twin predictor's run of ``scenario``, as recorded beside a measured run: its status,
    error and summary, and which twin profile (name and a hash of its text) made it."""
    from vllm_lab.twin.profile import load_profile

    name = scenario.hardware.twin_profile
    record: dict[str, Any] = {"backend": PredictBackend.name, "profile": name, "profile_version": "",
                              "predicted": True}
    try:
        profile = load_profile(name)
        record["profile_version"] = hashlib.sha256(profile.to_yaml().encode()).hexdigest()[:12]
        record["profile_fitted_at"] = profile.provenance.fitted_at
        m = PredictBackend(band=True).measure(scenario, None, Path("."))
    except (ValueError, OSError, ScenarioError) as e:  # an unknown model shape or profile: said so
        return {**record, "predicted": False, "status": "failed-start", "error": str(e), "summary": {}}
    return {**record, "status": m.status, "error": m.error, "summary": m.summary.record()}
