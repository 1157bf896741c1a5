"""The Locust user for OpenAI-compatible streaming: exact per-chunk timing and raw samples.

Started by `runner.run_load` (which sets VLLM_LAB_TRAFFIC_CONFIG to a JSON file). Locust's own
response time stops at the headers when streaming, so each request is timed by hand with
time.perf_counter(): TTFT to the first non-empty content, every gap after it, E2E to the end of
the stream. Locust's request event gets E2E (for its UI and CSV); the raw, unrounded samples go
to one JSONL file per worker process.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path

import gevent
import numpy as np
from gevent.queue import Empty, Queue
from locust import FastHttpUser, LoadTestShape, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner
from locust.user.users import LOCUST_STATE_STOPPING

from vllm_lab.traffic.arrivals import InFlightMeter, lag_summary, process_cpu_s, schedule
from vllm_lab.traffic.shapes import level_at, saturated, stop_reason, waiting_requests
from vllm_lab.traffic.spec import Load, Workload
from vllm_lab.traffic.workloads import WorkloadGenerator

_CFG = json.loads(Path(os.environ["VLLM_LAB_TRAFFIC_CONFIG"]).read_text())
LOAD = Load.model_validate(_CFG["load"])
WORKLOAD = Workload.model_validate(_CFG["workload"])
OUT = Path(_CFG["out_dir"])
# The server's API key: in the environment (runner.API_KEY_ENV) of a local process, in the 0600
# config copy of a remote worker.
_API_KEY = os.environ.get("VLLM_LAB_API_KEY") or _CFG.get("api_key")

# Requests built before the run, per process: two rounds of its users, at most this many.
PREBUILT_MAX = 2048

# (perf_counter time, ttft_s) of recent successful requests, fed by the user (local runner) or by
# worker reports (master); the shape reads it for the saturation stop.
TTFT_FEED: deque = deque(maxlen=200_000)


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
        t = self.get_run_time()
        stop = load.stop
        reason = stop_reason(stop, t, *self._e2e_stats())
        if reason is None and stop.saturation and self._check_saturation():
            reason = "saturation"
        if reason:
            self._stop(reason)
        if self.stop_reason:
            return None
        if load.mode == "open":
            # Users are in-flight slots; the arrival schedule carries the shape.
            return load.max_in_flight, 10_000
        return max(1, math.ceil(level_at(load.shape, t))), 1_000


class ClassifiedError(Exception):
    """A failed request, named by its error class (Locust's failure table groups by it)."""


class _Process:
    """Per-process state: identity, the workload, the sample file, lag meters and the arrivals."""

    def __init__(self, runner):
        self.index = getattr(runner, "worker_index", 0) if isinstance(runner, WorkerRunner) else 0
        self.count = int(_CFG.get("num_workers", 1))
        # A remote worker is named after its inventory host, so its samples say where they came from.
        self.host = _CFG.get("worker_host") or socket.gethostname()
        self.name = f"{self.host}-{os.getpid()}"
        self.gen = WorkloadGenerator(WORKLOAD, _CFG["seed"])
        # Shared prefixes and file records are built here, before the anchors below: the first
        # request must not pay for them (in an open loop it would hold up the dispatcher).
        self.gen.prepare()
        # The first requests are built now, before the run: each costs milliseconds of tokenizer
        # work, and built in the loop they would trickle out one by one instead of together (vllm
        # bench serve builds every prompt first), and stall the loop while streams are being read.
        self.prepared = {i: self.gen.request(i) for i in self._first_indices()}
        (OUT / "samples").mkdir(parents=True, exist_ok=True)
        # Open for the whole run, closed in close().
        self.file = open(OUT / "samples" / f"{self.name}.jsonl", "a", buffering=1 << 16)  # noqa: SIM115
        self.next_k = 0
        self.loop_lags: list[float] = []
        self.sched_lags: list[float] = []
        self.ttft_outbox: list[float] = []
        self.queue: Queue = Queue()
        # Wall-clock anchor: timestamps comparable across workers, differences as exact as
        # perf_counter.
        self.wall0, self.pc0 = time.time(), time.perf_counter()
        self.cpu0 = process_cpu_s()
        # Loop lag and CPU fraction count only while a request is in flight (see InFlightMeter).
        self.meter = InFlightMeter()
        self.greenlets = [gevent.spawn(self._heartbeat)]
        if LOAD.mode == "open":
            self.greenlets.append(gevent.spawn(self._dispatch))

    def _first_indices(self) -> range:
        """This worker's first requests: two per user of a closed loop, the first four seconds of
        an open one's arrivals (and never more than its share of max_requests)."""
        first = LOAD.shape.level * (4 if LOAD.mode == "open" else 2)
        k = min(math.ceil(first / self.count) + 8, PREBUILT_MAX)
        if LOAD.stop.max_requests is not None and USER_QUOTA is None:
            k = min(k, math.ceil(LOAD.stop.max_requests / self.count))
        return range(self.index, self.index + self.count * k, self.count)

    def wall(self, pc: float) -> float:
        """Convert a perf_counter reading to Unix time."""
        return self.wall0 + (pc - self.pc0)

    def next_index(self) -> int:
        """Return the next global request index of this worker (strided across workers)."""
        i = self.index + self.count * self.next_k
        self.next_k += 1
        return i

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
        # Send times come from the arrival process alone, never from responses (open loop).
        rng = np.random.default_rng([int(_CFG["seed"]), 2, self.index])
        t0 = time.perf_counter()
        for ts in schedule(
            rng, lambda t: level_at(LOAD.shape, t) / self.count, LOAD.arrival, LOAD.burstiness
        ):
            deadline = t0 + ts
            delay = deadline - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            lag = max(0.0, time.perf_counter() - deadline)
            self.sched_lags.append(lag)
            index = self.next_index()
            if _past_limit(index):
                return
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


@events.test_stop.add_listener
def _on_stop(environment, **_kw):
    global STATE
    if STATE is not None:
        STATE.close()
        STATE = None


@events.report_to_master.add_listener
def _report(client_id, data, **_kw):
    # Recent TTFTs travel to the master, whose shape watches them for the saturation stop.
    if STATE is not None and STATE.ttft_outbox:
        data["lab_ttft"], STATE.ttft_outbox = STATE.ttft_outbox, []


@events.worker_report.add_listener
def _collect(client_id, data, **_kw):
    now = time.perf_counter()
    TTFT_FEED.extend((now, v) for v in data.get("lab_ttft", ()))


def _user_quota() -> int | None:
    """Requests per user when a constant closed loop's max_requests divides evenly by its users.

    Then every user sends exactly that many, as vllm bench serve's users do, and the last round
    is full. Split by index over the processes instead (86/85/85 requests for 22/21/21 users),
    one process is left with a lone request in a last round of its own, and the run ends one
    request later at a concurrency of one.
    """
    n, users = LOAD.stop.max_requests, LOAD.shape.level
    if LOAD.mode != "closed" or LOAD.shape.kind != "constant" or n is None or users != int(users):
        return None
    return n // int(users) if n % int(users) == 0 else None


USER_QUOTA = _user_quota()


def _past_limit(index: int) -> bool:
    # Indices are strided across workers, so index < max_requests is exactly the first
    # max_requests requests of the sequence, whichever worker sends them.
    return LOAD.stop.max_requests is not None and index >= LOAD.stop.max_requests


def _error_class(exc: BaseException) -> str:
    name = type(exc).__name__.lower()
    if isinstance(exc, (TimeoutError, socket.timeout, gevent.Timeout)) or "timeout" in name:
        return "timeout"
    return "broken_stream"


class LLMUser(FastHttpUser):
    """One OpenAI-API user: a closed-loop client, or an in-flight slot of the open loop."""

    host = _CFG["base_url"]
    wait_time = constant(0)
    network_timeout = LOAD.request_timeout_s
    connection_timeout = LOAD.request_timeout_s
    default_headers = {"Authorization": f"Bearer {_API_KEY}"} if _API_KEY else None
    sent = 0  # closed loop with a per-user quota: requests this user has sent

    @task
    def one(self) -> None:
        """Run one request (or conversation) when its time comes."""
        st = STATE
        if st is None:
            gevent.sleep(0.01)
            return
        if LOAD.mode == "open":
            index, scheduled, sched_lag = self._next_arrival(st)
        else:
            scheduled = time.perf_counter() + LOAD.think_time_s
            if LOAD.think_time_s:
                gevent.sleep(LOAD.think_time_s)
            if USER_QUOTA is not None:
                if self.sent >= USER_QUOTA:
                    gevent.sleep(0.5)  # this user's share is sent; the shape ends the run
                    return
                self.sent += 1
            index, sched_lag = st.next_index(), max(0.0, time.perf_counter() - scheduled)
            if USER_QUOTA is None and _past_limit(index):
                gevent.sleep(0.5)  # this worker's share is sent; the shape ends the run
                return
        spec = st.prepared.pop(index, None) or st.gen.request(index)
        history: list = []
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
            "target_output_tokens": spec.turns[turn].max_tokens,
            "http_status": 0, "error": "", "error_detail": "", "itl_s": [], "chunks": 0,
        }
        payload = json.dumps(body)
        st.meter.begin()
        start = time.perf_counter()
        ttft, itl, last, reply, usage, done, error = None, [], start, [], {}, False, ""
        detail = ""
        try:
            resp = self.client.client.urlopen(
                self.client._build_url(path), method="POST", payload=payload, headers=headers
            )
            row["http_status"] = resp.status_code
            raw = resp._response
            # readline returns as soon as one SSE line is in; read(n) would wait for n bytes.
            while True:
                line = raw.readline(b"\n")
                if not line:
                    break
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                choices = obj.get("choices")
                if not choices:
                    continue
                c = choices[0]
                # A chunk carries a token when it has text, even "": a token can decode to nothing
                # yet (dummy weights, a partial UTF-8 sequence). Chat's first chunk only names
                # the role, and an empty chunk that only says why the stream ends, carry none.
                delta = c.get("delta") or {}
                text = c.get("text") if "text" in c else delta.get("content")
                if text is not None and "role" not in delta and (text or not c.get("finish_reason")):
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    row["chunks"] += 1
                    reply.append(text)
        except Exception as e:  # noqa: BLE001 - every failure is classified, none escapes
            code = getattr(e, "code", None) or getattr(getattr(e, "response", None), "status_code", 0)
            if isinstance(code, int) and code >= 400:
                error, row["http_status"] = "http_error", code
            elif ttft is None and not row["http_status"] and not isinstance(e, TimeoutError) \
                    and "timeout" not in type(e).__name__.lower():
                error = "http_error"  # never connected or no status line: a transport failure
            else:
                error = _error_class(e)
            detail = f"{type(e).__name__}: {e}"[:300]
        finally:
            end = time.perf_counter()
            st.meter.end()
        if not error and not done:
            error, detail = "broken_stream", "stream ended without [DONE]"
        n_out = usage.get("completion_tokens") if usage else None
        if not error and (row["chunks"] == 0 or n_out == 0):
            error = "empty_output"
        e2e = end - start
        out = n_out if n_out is not None else row["chunks"]
        row.update(
            scheduled_ts=st.wall(scheduled), start_ts=st.wall(start),
            send_lag_s=max(0.0, start - scheduled), sched_lag_s=sched_lag,
            ttft_s=ttft, e2e_s=e2e, itl_s=itl,
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
        self.environment.events.request.fire(
            request_type="POST", name=path, response_time=e2e * 1000, response_length=row["chunks"],
            exception=ClassifiedError(error) if error else None, context={"ttft_s": ttft},
        )
        return row, "".join(reply)
