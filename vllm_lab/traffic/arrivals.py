"""Arrival processes: open-loop schedules (Poisson, gamma) and the client's own lag measurement.

An open loop decides send times in advance from the arrival process alone, never from response
times; the gap between a scheduled time and the moment the client managed to act on it is the
client's schedule lag, the signal that the load generator (not the server) fell behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np


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


def client_overloaded(
    schedule_lag_p99_s: float, loop_lag_p99_s: float, cpu_fraction: float, max_lag_s: float
) -> bool:
    """Whether the generator could not keep up: late sends, a starved event loop or a full core."""
    return (
        schedule_lag_p99_s > max_lag_s
        or loop_lag_p99_s > max_lag_s
        # A process on a full core cannot time chunks to the millisecond any more.
        or cpu_fraction > 0.95
    )
