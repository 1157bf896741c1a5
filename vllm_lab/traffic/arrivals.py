"""Arrival processes: open-loop schedules (Poisson, gamma) and the client's own lag measurement.

An open loop decides send times in advance from the arrival process alone, never from response
times; the gap between a scheduled time and the moment the client managed to act on it is the
client's schedule lag, the signal that the load generator (not the server) fell behind.

A run has one schedule (`planned_arrivals`), drawn from its seed: every Locust process, on every
load-generator host, draws the same one and sends its share (`dealt`: the k-th arrival goes to
process k mod P), so the union of their sends is exactly the planned process. Split into P
independent streams at 1/P of the rate, each with its own quota, the sends thinned out as the
quotas ran out (on an H200 host, 14 streams asked for 30 req/s sent 24). The predictor replays
the same schedule.
"""

from __future__ import annotations

import itertools
import resource
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from vllm_lab.traffic import traces
from vllm_lab.traffic.shapes import level_at
from vllm_lab.traffic.spec import Load, Workload


def interarrival_gaps(
    rng: np.random.Generator, rate: float, n: int, arrival: str = "poisson", burstiness: float = 1.0
) -> np.ndarray:
    """Draw n gaps (s) at `rate` req/s: exponential, or gamma(shape=burstiness) as vLLM does."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if arrival == "poisson":
        return rng.exponential(1.0 / rate, n)
    if arrival == "gamma":
        # Same parameterisation as `vllm bench serve --burstiness`: mean 1/rate, CV 1/sqrt(k).
        return rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    raise ValueError(f"arrival must be 'poisson' or 'gamma', got {arrival!r}")


def schedule(
    rng: np.random.Generator,
    rate_at: Callable[[float], float],
    arrival: str = "poisson",
    burstiness: float = 1.0,
    until: float = float("inf"),
) -> Iterator[float]:
    """Yield send times (s from start) whose rate follows rate_at(t), which may change with time."""
    t = 0.0
    while t < until:
        rate = rate_at(t)
        if rate <= 0:
            # A shape at zero sends nothing; look again shortly.
            t += 0.05
            continue
        t += float(interarrival_gaps(rng, rate, 1, arrival, burstiness)[0])
        if t < until:
            yield t


# Gaps drawn per call when a constant rate's schedule is generated lazily (a duration, no count).
_CHUNK = 4096


def planned_arrivals(load: Load, seed: int, workload: Workload | None = None) -> Iterator[float]:
    """The run's one arrival schedule: send times in seconds from its start, in order.

    The k-th time is request k's. A constant rate with a request count draws exactly that many
    gaps and scales them so the last arrival falls at count / rate, as `vllm bench serve` does
    (the realised rate is then the planned one, not 1-2% off by chance); a duration ends the
    schedule there. A shape that moves (ramp, step, spike) draws each gap at the rate of its
    moment. A replay sends each of the trace's requests at its own time (``workload``, source
    trace: `traces.replay_times`). Deterministic: the same (load, seed) gives the same times in
    every process.
    """
    count, until = load.stop.max_requests, load.stop.duration_s
    if load.mode == "replay":
        if workload is None or workload.source != "trace":
            raise ValueError("load.mode replay needs workload.source trace")
        times = traces.replay_times(traces.trace_requests(workload, load), load.replay)
        yield from itertools.islice((t for t in times if t < until), count)
        return
    rng = np.random.default_rng([int(seed), 2])
    if load.shape.kind in ("constant", "soak"):
        rate = load.shape.level
        if count is not None:
            times = np.cumsum(interarrival_gaps(rng, rate, count, load.arrival, load.burstiness))
            times *= (count / rate) / times[-1]
            yield from (float(t) for t in times if t < until)
            return
        last = 0.0
        while True:
            times = last + np.cumsum(interarrival_gaps(rng, rate, _CHUNK, load.arrival,
                                                       load.burstiness))
            yield from (float(t) for t in times[times < until])
            if times[-1] >= until:
                return
            last = float(times[-1])
    moving = schedule(rng, lambda x: level_at(load.shape, x), load.arrival, load.burstiness, until)
    yield from itertools.islice(moving, count)


def dealt(times: Iterable[float], index: int, count: int) -> Iterator[tuple[int, float]]:
    """Process ``index`` of ``count``'s share of a schedule: (k, t) for every k-th arrival with
    k mod count == index (k is the request's index in the run)."""
    for k, t in enumerate(times):
        if k % count == index:
            yield k, t


def lag_summary(lags: list[float] | np.ndarray) -> dict[str, float]:
    """Return count, p50, p99 and max of lag values in seconds (zeros for none)."""
    a = np.asarray(lags, dtype=float)
    if a.size == 0:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {
        "n": int(a.size),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def process_cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class InFlightMeter:
    """Wall and CPU time of a load-generator process, counted only while a request is in flight.

    The client-side overload signals (a starved event loop, a full core) matter because a busy
    client reads chunks late and so reports TTFT and ITL that are not the server's. Only time with
    a request in flight can be mismeasured that way. CPU spent while nothing is in flight (one
    closed-loop user building and tokenizing its next 8192-token prompt, setup before the first
    request) delays the next send, which the closed loop takes as part of the user's cycle and the
    open loop's schedule lag measures; it cannot distort a single measured timestamp, so it is
    not counted as overload. Clocks are injectable for tests.
    """

    def __init__(self, cpu: Callable[[], float] = process_cpu_s,
                 clock: Callable[[], float] = time.perf_counter):
        self._cpu, self._clock = cpu, clock
        self.in_flight = 0
        self.busy_wall_s = 0.0
        self.busy_cpu_s = 0.0
        self._wall0 = self._cpu0 = 0.0

    def begin(self) -> None:
        """A request goes out (call after its body is built, right before sending)."""
        if self.in_flight == 0:
            self._wall0, self._cpu0 = self._clock(), self._cpu()
        self.in_flight += 1

    def end(self) -> None:
        """A request is done (its stream read to the end, or failed)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self.busy_wall_s += self._clock() - self._wall0
            self.busy_cpu_s += self._cpu() - self._cpu0

    def busy_time(self, now: float | None = None) -> float:
        """Wall seconds with at least one request in flight, up to `now` (a clock reading)."""
        if self.in_flight == 0:
            return self.busy_wall_s
        return self.busy_wall_s + (self._clock() if now is None else now) - self._wall0

    def cpu_fraction(self) -> float:
        """CPU seconds per wall second over the in-flight time (0 when nothing was ever in flight)."""
        wall, cpu = self.busy_wall_s, self.busy_cpu_s
        if self.in_flight:
            wall += self._clock() - self._wall0
            cpu += self._cpu() - self._cpu0
        return cpu / wall if wall > 0 else 0.0

    def loop_lag(self, t0: float, t1: float, busy0: float, slept_s: float) -> float | None:
        """The event loop's lag over a heartbeat that asked to sleep `slept_s` from t0 to t1.

        busy0 is busy_time(t0). Only the in-flight part of the interval counts: None when nothing
        was in flight at all (no sample: idle time neither raises nor dilutes the lag).
        """
        busy = self.busy_time(t1) - busy0
        if busy <= 0:
            return None
        return max(0.0, min(busy, t1 - t0) - slept_s)


def client_overloaded(
    schedule_lag_p99_s: float, loop_lag_p99_s: float, cpu_fraction: float, max_lag_s: float
) -> bool:
    """Whether the generator could not keep up: late sends, a starved event loop or a full core.

    The loop lag and the CPU fraction are those of the in-flight time (`InFlightMeter`): CPU the
    client spends between requests, e.g. building long prompts, is not overload.
    """
    return (
        schedule_lag_p99_s > max_lag_s
        or loop_lag_p99_s > max_lag_s
        # A process on a full core cannot time chunks to the millisecond any more.
        or cpu_fraction > 0.95
    )
