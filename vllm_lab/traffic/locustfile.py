"""The Locust user for OpenAI-compatible streaming: exact per-chunk timing and raw samples.

Started by `runner.run_load` (which sets VLLM_LAB_TRAFFIC_CONFIG to a JSON file). Locust's own
response time stops at the headers when streaming, so each request is timed by hand with
time.perf_counter(): TTFT to the first non-empty content, every gap after it, E2E to the end of
the stream. Locust's request event gets E2E (for its UI and CSV); the raw, unrounded samples go
to one JSONL file per worker process.

The load is one load, however many processes and hosts carry it, as `vllm bench serve` carries
it from one list in one process:
- a closed loop draws from one request pool (`Pool`): whichever user is free takes the next
  request index, until none is left, so N users keep N requests in flight until fewer than N
  remain (with a quota per user, users with short requests finished first and the run drained
  for half its length on variable lengths);
- an open loop follows one arrival schedule (`arrivals.planned_arrivals`), dealt out to processes;
- every user and the schedule start together, once all users are spawned (`GO`), and across
  processes at one wall-clock instant their master names (`lab_go`), not each at the moment
  it hears that spawning is complete.
Across processes the pool is the Locust master's: a worker asks it for each index over Locust's
own master-worker messages (`lab_take` / `lab_ticket`), and reports each finished request
(`lab_end`) so the master ends a counted run the moment its last request ends.
"""

from __future__ import annotations

import csv
import inspect
import itertools
import json
import math
import multiprocessing
import os
import socket
import sys
import time
import urllib.request
from collections import deque
from functools import cached_property
from pathlib import Path

import gevent
import numpy as np
from gevent.event import AsyncResult, Event
from gevent.queue import Empty, Queue
from locust import FastHttpUser, LoadTestShape, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV
from locust.user.users import LOCUST_STATE_STOPPING

from vllm_lab.traffic import locust_waits
from vllm_lab.traffic.arrivals import (
    InFlightMeter,
    dealt,
    lag_summary,
    planned_arrivals,
    process_cpu_s,
)
from vllm_lab.traffic.shapes import level_at, saturated, stop_reason, waiting_requests
from vllm_lab.traffic.spec import Load, Workload
from vllm_lab.traffic.sse import Stream, failure
from vllm_lab.traffic.workloads import WorkloadGenerator

_CFG = json.loads(Path(os.environ["VLLM_LAB_TRAFFIC_CONFIG"]).read_text())
locust_waits.shorten()
LOAD = Load.model_validate(_CFG["load"])
WORKLOAD = Workload.model_validate(_CFG["workload"])
OUT = Path(_CFG["out_dir"])
# The server's API key: in the environment (runner.API_KEY_ENV) of a local process, in the 0600
# config copy of a remote worker.
_API_KEY = os.environ.get("VLLM_LAB_API_KEY") or _CFG.get("api_key")

# Requests built before the run, per process: a closed loop's first wave, the first four seconds
# of an open loop's share of the arrivals; at most this many.
PREBUILT_MAX = 2048

# (perf_counter time, ttft_s) of recent successful requests, fed by the user (local runner) or by
# worker reports (master); the shape reads it for the saturation stop.
TTFT_FEED: deque = deque(maxlen=200_000)

# Set at the run's start, once every user of the run is spawned: users and the arrival schedule
# start together, as the tasks of vllm bench serve do, instead of trickling in at the spawn rate.
GO = Event()


class Pool:
    """The run's one request pool: request indices in order, for whichever closed-loop user is
    free first, up to the run's request count (``limit``; None: unbounded), and the count of
    requests (conversations) that have ended.

    Its two counters live in shared memory made before Locust forks its ``--processes``, so the
    processes of one host take from it with no round trip (a lock held for a microsecond).
    Workers Locust did not fork (other hosts, or ``locust --worker`` processes) reach their
    master's over Locust's messages instead (`MasterPool`, `WorkerPool`).
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self._n = multiprocessing.RawArray("q", 2)  # taken, ended
        self._lock = multiprocessing.Lock()

    @property
    def ended(self) -> int:
        """Requests of the run that have ended so far."""
        return int(self._n[1])

    def draw(self, n: int = 1) -> list[int]:
        """Up to ``n`` next indices (fewer, or none, once the pool is empty)."""
        with self._lock:
            first = int(self._n[0])
            k = n if self.limit is None else max(0, min(n, self.limit - first))
            self._n[0] = first + k
        return list(range(first, first + k))

    def take(self) -> int | None:
        """The next request index for a free user, or None when none is left."""
        got = self.draw()
        return got[0] if got else None

    def end(self, n: int = 1) -> None:
        """``n`` requests (all turns of a conversation each) have ended, however they ended."""
        with self._lock:
            self._n[1] += n


class MasterPool(Pool):
    """The pool on a master: its workers' users take from it and report each end to it."""

    def __init__(self, runner: MasterRunner, limit: int | None):
        super().__init__(limit)
        self.runner = runner
        runner.register_message("lab_take", self._on_take)
        runner.register_message("lab_end", self._on_end)

    def _on_take(self, environment, msg, **_kw) -> None:
        got = self.draw(int(msg.data["n"]))
        self.runner.send_message("lab_ticket", {"id": msg.data["id"], "i": got}, client_id=msg.node_id)

    def _on_end(self, environment, msg, **_kw) -> None:
        Pool.end(self, int(msg.data["n"]))


class WorkerPool(Pool):
    """A worker's window on its master's pool.

    The users that ask in the same turn of the event loop (the whole first wave at GO) go in one
    message, so a thousand users do not wait for a thousand round trips before their first send.
    """

    def __init__(self, runner: WorkerRunner, timeout_s: float):
        super().__init__(None)
        self.runner, self.timeout_s = runner, timeout_s
        self._asking: list[AsyncResult] = []
        self._pending: dict[int, list[AsyncResult]] = {}
        self._seq = 0
        runner.register_message("lab_ticket", self._on_ticket)

    def take(self) -> int | None:
        r = AsyncResult()
        self._asking.append(r)
        if len(self._asking) == 1:
            gevent.spawn(self._ask)  # runs once this turn's other users have asked too
        try:
            return r.get(timeout=self.timeout_s)
        except gevent.Timeout:
            return None  # the master is gone: the run is over

    def _ask(self) -> None:
        batch, self._asking = self._asking, []
        self._seq += 1
        self._pending[self._seq] = batch
        self.runner.send_message("lab_take", {"id": self._seq, "n": len(batch)})

    def _on_ticket(self, environment, msg, **_kw) -> None:
        got = msg.data["i"]
        for k, r in enumerate(self._pending.pop(msg.data["id"], [])):
            r.set(got[k] if k < len(got) else None)

    def end(self, n: int = 1) -> None:
        self.runner.send_message("lab_end", {"n": n})


# Made at import, which Locust does before it forks: its forked processes share this one.
POOL: Pool = Pool(LOAD.stop.max_requests)


def _share(runner) -> int:
    """This process's share of the schedule (``arrivals.dealt``): the lowest free one among the
    processes Locust forked on this host, from the first share the lab dealt the host
    (runner.FIRST_SHARE_ENV); 0 for a single process.

    A process claims its share by creating the share's file in the run's fresh samples folder,
    an exclusive create being atomic across processes with no message to depend on. (A counter
    in memory shared by the forked processes handed two of them the same share, once in CI.)
    Shares are named as dealt, not from 0, so two worker hosts on one machine, whose processes
    write into one folder, claim their own. The files' names start with a dot: no reader of the
    samples, nor a remote host's copy back, takes them."""
    if not isinstance(runner, WorkerRunner):
        return 0
    share = int(os.environ.get("VLLM_LAB_FIRST_SHARE", "0"))
    while True:
        try:
            os.close(os.open(OUT / "samples" / f".share-{share}",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return share
        except FileExistsError:
            share += 1


@events.init.add_listener
def _on_init(environment, **_kw):
    global POOL
    runner = environment.runner
    if not _CFG.get("shared_pool", True):  # workers of their own: the master keeps the pool
        if isinstance(runner, MasterRunner):
            POOL = MasterPool(runner, LOAD.stop.max_requests)
        elif isinstance(runner, WorkerRunner):
            POOL = WorkerPool(runner, LOAD.request_timeout_s)


# How far ahead of its message a master sets the shared start: the workers' event loops may be
# busy (a prompt being built, a stream being read), and a start that reaches one of them late
# would shift its share of the schedule (23 ms was seen on a loaded host when each process
# started at the moment it heard).
GO_LEAD_S = 0.5

# The run's start, in Unix time: the instant a master named (kept by it and by every worker), or
# when a run of one process had every user up. A run's duration and shape count from it.
_GO_WALL: float | None = None
# This process's runner (Locust's spawning_complete event does not carry it).
_RUNNER = None


@events.init.add_listener
def _on_init_go(environment, **_kw):
    global _RUNNER
    _RUNNER = environment.runner
    if isinstance(_RUNNER, WorkerRunner):
        _RUNNER.register_message("lab_go", _on_go_message)


@events.spawning_complete.add_listener
def _on_spawned(**_kw):
    global _GO_WALL
    runner = _RUNNER
    if isinstance(runner, MasterRunner):
        # One start for every process, on every host: a wall-clock instant a little ahead (the
        # same one again when a staircase's later level spawns).
        _GO_WALL = _GO_WALL or time.time() + GO_LEAD_S
        runner.send_message("lab_go", {"wall": _GO_WALL})
    elif not isinstance(runner, WorkerRunner):  # a run of one process starts when its users are up
        _go_at(time.time())
    # A worker ignores Locust's own spawning_complete: it starts at its master's instant.


def run_time(locust_run_time: float) -> float:
    """Seconds of the run so far, from its start (``_GO_WALL``): the users wait for it, so the
    half second a master gives its workers to hear of it is no part of the duration. Locust's
    own run time until a start is known."""
    return locust_run_time if _GO_WALL is None else max(0.0, time.time() - _GO_WALL)


def _on_go_message(environment, msg, **_kw) -> None:
    _go_at(float(msg.data["wall"]))


def _go_at(wall: float) -> None:
    """Anchor the schedule at the Unix time ``wall`` and release the users then."""
    global _GO_WALL
    if GO.is_set() or _GO_WALL is not None:
        return  # a staircase's later levels spawn too: the run starts once
    _GO_WALL = wall
    if STATE is not None:
        STATE.anchor(wall)


# Users per second Locust spawns: all of a run's at once (they wait for GO before their first send).
SPAWN_RATE = 10_000


def _schedule_length(cap: int = 10_000_000) -> int | None:
    """An open loop's arrivals in all (the schedule every process deals from), None past ``cap``."""
    n = sum(1 for _ in itertools.islice(planned_arrivals(LOAD, _CFG["seed"], WORKLOAD), cap + 1))
    return n if n <= cap else None


# How often Locust's shape worker calls tick() (locust.runners: about once a second).
TICK_S = 1.0


class LabShape(LoadTestShape):
    """Drives users from the run's `Load` and stops on the first stop condition that holds."""

    load = LOAD
    base_url = _CFG["base_url"].rstrip("/")
    out_dir = OUT

    def __init__(self):
        super().__init__()
        self._queue: deque = deque(maxlen=10_000)
        self._last_scrape = 0.0
        self.stop_reason: str | None = None

    @cached_property
    def scheduled(self) -> int | None:
        """An open loop's arrivals in all, counted on the first tick: only the process that ticks
        (the master, or a run of one process) needs it, and a worker's start must not wait on it."""
        return _schedule_length() if LOAD.open_loop else None

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        (self.out_dir / "stop_reason.json").write_text(json.dumps({"reason": reason}))

    def _e2e_stats(self):
        entries = [e for (name, method), e in self.runner.stats.entries.items() if method == "POST"]
        n = sum(e.num_requests for e in entries)
        return n, sum(e.num_failures for e in entries)

    def _check_saturation(self) -> bool:
        now = time.perf_counter()
        if now - self._last_scrape >= 2.0:
            self._last_scrape = now
            try:
                with urllib.request.urlopen(self.base_url + "/metrics", timeout=1.5) as r:
                    self._queue.append((now, waiting_requests(r.read().decode())))
            except OSError:
                pass
        win = self.load.stop.saturation_window_s
        recent = [(t, v) for t, v in TTFT_FEED if t >= now - win]
        q = [(t, v) for t, v in self._queue if t >= now - win]
        if not recent or not q:
            return False
        tt, tv = np.array(recent).T
        qt, qv = np.array(q).T
        return saturated(tt, tv, qt, qv)

    def tick(self):
        """Return (users, spawn rate) for now, or None once a stop condition holds."""
        load = self.load
        t = run_time(self.get_run_time())
        stop = load.stop
        if 0 < stop.duration_s - t < TICK_S:
            # Locust asks the shape once a second, from before the users start: without this
            # nap a run went on sending up to a second past its duration (a whole one on one
            # process, half of one where a master gives its workers half a second to start).
            gevent.sleep(stop.duration_s - t)
            t = run_time(self.get_run_time())
        # A counted run ends when its last request has ended, which the pool hears at once (the
        # workers' statistics reach a master only every few seconds).
        reason = stop_reason(stop, t, *self._e2e_stats(), finished=POOL.ended, scheduled=self.scheduled)
        if reason is None and stop.saturation and self._check_saturation():
            reason = "saturation"
        if reason:
            self._stop(reason)
        if self.stop_reason:
            return None
        # Spawned at once: the users wait for GO, so they start together however many there are.
        if load.open_loop:
            # Users are in-flight slots; the arrival schedule carries the shape.
            return load.max_in_flight, SPAWN_RATE
        return max(1, math.ceil(level_at(load.shape, t))), SPAWN_RATE


class ClassifiedError(Exception):
    """A failed request, named by its error class (Locust's failure table groups by it)."""


class _Process:
    """Per-process state: identity, the workload, the sample file, lag meters and the arrivals."""

    def __init__(self, runner):
        self.index = _share(runner)
        self.count = int(_CFG.get("num_workers", 1))
        # A remote worker is named after its inventory host, so its samples say where they came from.
        self.host = _CFG.get("worker_host") or socket.gethostname()
        self.name = f"{self.host}-{os.getpid()}"
        self.gen = WorkloadGenerator(WORKLOAD, _CFG["seed"], LOAD)
        # Shared prefixes, file records and their token counts are built here, before the anchors
        # below: the first request must not pay for them (in an open loop it would hold up the
        # dispatcher).
        self.gen.prepare(upto=LOAD.stop.max_requests)
        # The first requests are built now, before the run: built in the loop they would trickle
        # out one by one instead of together (vllm bench serve builds every prompt first), and
        # stall the loop while streams are being read.
        self.prepared = {i: self.gen.request(i) for i in self._first_indices()}
        # Locust's stop calls inspect.stack() for a debug line; the first call in a process indexes
        # every module's file and reads each frame's source (45-85 ms): it froze the loop at the
        # end of every run, the last request in flight, and a short run's few in-flight heartbeats
        # read that one stall as their lag p99 (overloaded). Made here, the stop's takes 0.3 ms.
        inspect.stack()
        (OUT / "samples").mkdir(parents=True, exist_ok=True)
        # Open for the whole run, closed in close().
        self.file = open(OUT / "samples" / f"{self.name}.jsonl", "a", buffering=1 << 16)  # noqa: SIM115
        self.loop_lags: list[float] = []
        self.sched_lags: list[float] = []
        self.ttft_outbox: list[float] = []
        self.queue: Queue = Queue()
        # Wall-clock anchor: timestamps comparable across workers, differences as exact as
        # perf_counter.
        self.wall0, self.pc0 = time.time(), time.perf_counter()
        self.go_pc: float | None = None  # the shared start on this clock: the schedule's zero
        self.cpu0 = process_cpu_s()
        # Loop lag and CPU fraction count only while a request is in flight (see InFlightMeter).
        self.meter = InFlightMeter()
        self.greenlets = [gevent.spawn(self._heartbeat)]
        if LOAD.open_loop:
            self.greenlets.append(gevent.spawn(self._dispatch))

    def _first_indices(self) -> list[int]:
        """The requests this process may send first: a closed loop's whole first wave (any user
        of any process may take any of it from the pool), an open loop's share of the first four
        seconds of arrivals; at most PREBUILT_MAX, never past the run's request count."""
        if LOAD.open_loop:
            first = []
            for k, t in dealt(planned_arrivals(LOAD, _CFG["seed"], WORKLOAD), self.index, self.count):
                if t > 4.0 or len(first) >= PREBUILT_MAX:
                    break
                first.append(k)
            return first
        n = math.ceil(LOAD.shape.level)
        if LOAD.stop.max_requests is not None:
            n = min(n, LOAD.stop.max_requests)
        return list(range(min(n, PREBUILT_MAX)))

    def anchor(self, wall: float) -> None:
        """Set the schedule's zero at the Unix time ``wall`` and release the users at it."""
        self.go_pc = self.pc0 + (wall - self.wall0)
        gevent.spawn_later(max(0.0, self.go_pc - time.perf_counter()), GO.set)

    def wall(self, pc: float) -> float:
        """Convert a perf_counter reading to Unix time."""
        return self.wall0 + (pc - self.pc0)

    def _heartbeat(self) -> None:
        # The oversleep of a short sleep is the event loop's lag: what every chunk timing suffers.
        last_flush = time.perf_counter()
        while True:
            t = time.perf_counter()
            busy0 = self.meter.busy_time(t)
            gevent.sleep(0.005)
            now = time.perf_counter()
            lag = self.meter.loop_lag(t, now, busy0, 0.005)
            if lag is not None:
                self.loop_lags.append(lag)
            if now - last_flush > 1.0:
                self.file.flush()
                last_flush = now

    def _dispatch(self) -> None:
        # Send times come from the run's one schedule alone, never from responses (open loop):
        # this process sends every count-th of its arrivals, from the moment every user is up.
        GO.wait()
        t0 = self.go_pc
        for index, ts in dealt(planned_arrivals(LOAD, _CFG["seed"], WORKLOAD), self.index, self.count):
            deadline = t0 + ts
            delay = deadline - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            lag = max(0.0, time.perf_counter() - deadline)
            self.sched_lags.append(lag)
            self.queue.put((index, deadline, lag))

    def write(self, row: dict) -> None:
        """Append one raw sample."""
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Stop the helpers, flush the samples and write this worker's lag summary."""
        wall = time.perf_counter() - self.pc0
        for g in self.greenlets:
            g.kill(block=False)
        self.file.flush()
        self.file.close()
        summary = {
            "worker": self.name,
            "host": self.host,
            "python": sys.executable,
            "index": self.index,
            "loop_lag": lag_summary(self.loop_lags),
            "sched_lag": lag_summary(self.sched_lags),
            # The overload signal: CPU per wall second while requests were in flight.
            "cpu_fraction": self.meter.cpu_fraction(),
            # For diagnosis only: over the whole run, prompt building between requests included.
            "cpu_fraction_total": (process_cpu_s() - self.cpu0) / wall if wall > 0 else 0.0,
            "in_flight_s": self.meter.busy_time(),
            "wall_s": wall,
            # The anchor maps this worker's *_ts columns back to its perf_counter clock.
            "wall0": self.wall0,
            "perf0": self.pc0,
            "queued_at_stop": self.queue.qsize(),
        }
        (OUT / "samples" / f"{self.name}.summary.json").write_text(json.dumps(summary))


STATE: _Process | None = None


@events.test_start.add_listener
def _on_start(environment, **_kw):
    global STATE
    if not isinstance(environment.runner, MasterRunner) and STATE is None:
        STATE = _Process(environment.runner)
        if _GO_WALL is not None and not GO.is_set():
            STATE.anchor(_GO_WALL)


@events.test_stopping.add_listener
def _on_stopping(environment, **_kw):
    if isinstance(environment.runner, WorkerRunner):
        # The statistics so far, the moment the stop arrives: a master that quits waits only half
        # a second for its workers' last reports, and the graceful stop below can take that long
        # by itself (a user napping on an empty pool), so Locust's own report at the end came too
        # late on a busy host. Locust's table is for its UI; the lab counts the raw samples.
        environment.runner._send_stats()


@events.test_stop.add_listener
def _on_stop(environment, **_kw):
    global STATE
    if isinstance(environment.runner, WorkerRunner):
        # The requests that ended during the graceful stop, ahead of the "stopped" reply.
        environment.runner._send_stats()
    if STATE is not None:
        STATE.close()
        STATE = None


@events.report_to_master.add_listener
def _report(client_id, data, **_kw):
    # Recent TTFTs travel to the master, whose shape watches them for the saturation stop.
    if STATE is not None and STATE.ttft_outbox:
        data["lab_ttft"], STATE.ttft_outbox = STATE.ttft_outbox, []


ENVIRONMENT = None  # this process's Locust environment, for the tables written at its exit


@events.init.add_listener
def _keep_environment(environment, **_kw):
    global ENVIRONMENT
    ENVIRONMENT = environment


@events.quit.add_listener
def _write_final_tables(**_kw):
    # Locust rewrites its CSV tables once a second and only closes them at exit, so the last
    # statistics (a master's, from its workers' final reports at stop) can miss them: write each
    # table once more, whole, in place of the one its writer still holds open.
    env = ENVIRONMENT
    prefix = getattr(getattr(env, "parsed_options", None), "csv_prefix", None)
    if not prefix or isinstance(env.runner, WorkerRunner):
        return
    tables = StatsCSV(env, PERCENTILES_TO_REPORT)
    for name, write in (("stats", tables.requests_csv), ("failures", tables.failures_csv),
                        ("exceptions", tables.exceptions_csv)):
        path = Path(f"{prefix}_{name}.csv")
        tmp = path.with_name(path.name + ".final")
        with open(tmp, "w", newline="") as f:
            write(csv.writer(f))
        os.replace(tmp, path)


@events.worker_report.add_listener
def _collect(client_id, data, **_kw):
    now = time.perf_counter()
    TTFT_FEED.extend((now, v) for v in data.get("lab_ttft", ()))


class LLMUser(FastHttpUser):
    """One OpenAI-API user: a closed-loop client, or an in-flight slot of the open loop."""

    host = _CFG["base_url"]
    wait_time = constant(0)
    network_timeout = LOAD.request_timeout_s
    connection_timeout = LOAD.request_timeout_s
    default_headers = {"Authorization": f"Bearer {_API_KEY}"} if _API_KEY else None
    # When this user's last request ended: how long its kept-alive connection has idled.
    _last_end: float | None = None

    @task
    def one(self) -> None:
        """Run one request (or conversation) when its time comes."""
        st = STATE
        if st is None or not GO.wait(timeout=0.2):
            return  # not every user is up yet: the run has not started
        if LOAD.open_loop:
            index, scheduled, sched_lag = self._next_arrival(st)
        else:
            scheduled = time.perf_counter() + LOAD.think_time_s
            if LOAD.think_time_s:
                gevent.sleep(LOAD.think_time_s)
            index = POOL.take()
            if index is None:
                gevent.sleep(0.5)  # the pool is empty; the shape ends the run once all have ended
                return
            sched_lag = max(0.0, time.perf_counter() - scheduled)
        spec = st.prepared.pop(index, None) or st.gen.request(index)
        history: list = []
        try:
            for turn in range(len(spec.turns)):
                row, reply = self._request(st, spec, turn, history, scheduled, sched_lag)
                if row["status"] != "ok":
                    break
                history += [{"role": "user", "content": spec.turns[turn].text},
                            {"role": "assistant", "content": reply}]
                if turn + 1 < len(spec.turns):
                    if LOAD.think_time_s:
                        gevent.sleep(LOAD.think_time_s)
                    scheduled, sched_lag = time.perf_counter(), 0.0
        finally:
            POOL.end()

    def _next_arrival(self, st):
        """Wait for the dispatcher's next arrival, but leave at once when the run stops.

        The graceful stop lets in-flight requests finish (--stop-timeout); a slot that is only
        waiting for work must not hold the run open until that timeout.
        """
        while True:
            try:
                return st.queue.get(timeout=0.2)
            except Empty:
                if self._state == LOCUST_STATE_STOPPING:
                    raise StopUser() from None

    def _request(self, st, spec, turn, history, scheduled, sched_lag):
        path, body = st.gen.body(spec, _CFG["model"], turn, history)
        rid = f"{st.name}-{spec.index}-{turn}"
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                   "X-Request-Id": rid}
        if self.client.auth_header:
            headers["Authorization"] = self.client.auth_header
        row = {
            "request_id": rid, "index": spec.index, "turn": turn,
            "worker": st.name, "user": id(self) % 1_000_000, "api": WORKLOAD.api,
            "target_prompt_tokens": spec.turns[turn].prompt_tokens,
            "target_output_tokens": spec.turns[turn].max_tokens, "priority": spec.priority,
            "http_status": 0, "error": "", "error_detail": "", "itl_s": [], "chunks": 0,
        }
        payload = json.dumps(body)
        self._drop_idle_connection()
        st.meter.begin()
        stream = Stream(time.perf_counter(), max_tokens=spec.turns[turn].max_tokens)
        error = detail = ""
        try:
            resp = self.client.client.urlopen(
                self.client._build_url(path), method="POST", payload=payload, headers=headers
            )
            row["http_status"] = resp.status_code
            stream.read(resp._response)
        except Exception as e:  # noqa: BLE001 - every failure is classified, none escapes
            error, row["http_status"] = failure(e, stream.ttft, row["http_status"])
            detail = f"{type(e).__name__}: {e}"[:300]
        finally:
            end = self._last_end = time.perf_counter()
            st.meter.end()
        row["chunks"] = stream.chunks
        error, detail = stream.verdict(error, detail)
        self._record(st, row, stream, end, scheduled, sched_lag, error, detail)
        self.environment.events.request.fire(
            request_type="POST", name=path, response_time=(end - stream.start) * 1000,
            response_length=stream.chunks, exception=ClassifiedError(error) if error else None,
            context={"ttft_s": stream.ttft},
        )
        return row, "".join(stream.reply)

    def _drop_idle_connection(self) -> None:
        """Close this user's kept-alive connection once it has idled past ``idle_connection_s``,
        so the request goes out on a fresh one.

        The server closes a connection that idles for its keep-alive timeout (vLLM's: 5 s). A
        request sent on it in that instant reaches a closing socket and dies unread: no byte
        back, HTTPConnectionClosed, a failed request the server never saw (one in about 1,000 on
        the H200's open-loop levels: enough to break an SLO capacity's level). geventhttpclient
        checks a pooled socket only for a close already received, and rightly retries no POST;
        so the client keeps its own idle limit below the server's, as HTTP clients with an idle
        timeout do.
        """
        if self._last_end is not None and (
                time.perf_counter() - self._last_end > LOAD.idle_connection_s):
            self.client.client.close()  # the next request opens a new client and connection

    def _record(self, st, row, stream: Stream, end, scheduled, sched_lag, error, detail):
        """The request's sample row, written; its TTFT handed to the shape's feed."""
        start, ttft, usage = stream.start, stream.ttft, stream.usage
        e2e = end - start
        n_out = usage.get("completion_tokens") if usage else None
        out = n_out if n_out is not None else stream.chunks
        row.update(
            scheduled_ts=st.wall(scheduled), start_ts=st.wall(start),
            send_lag_s=max(0.0, start - scheduled), sched_lag_s=sched_lag,
            ttft_s=ttft, e2e_s=e2e, itl_s=stream.itl,
            tpot_s=(e2e - ttft) / (out - 1) if ttft is not None and out and out > 1 else None,
            prompt_tokens=usage.get("prompt_tokens"), output_tokens=out,
            status="error" if error else "ok", error=error, error_detail=detail,
        )
        st.write(row)
        if ttft is not None and not error:
            if isinstance(self.environment.runner, WorkerRunner):
                st.ttft_outbox.append(ttft)
            else:
                TTFT_FEED.append((end, ttft))
