"""Load shapes (constant, ramp, step, spike, soak) and stop conditions, as plain functions.

The shape's level is users for a closed loop and requests/s for an open loop; for an open loop the
Locust users are only in-flight slots and the arrival schedule follows `level_at` instead.
`locustfile.LabShape` (Locust's LoadTestShape) calls these; this module does not import Locust, so
importing it does not monkey-patch the process with gevent.
"""

from __future__ import annotations

import re

import numpy as np

from vllm_lab.traffic.spec import Shape, Stop


def level_at(shape: Shape, t: float) -> float:
    """Return the load level (users or requests/s) the shape asks for t seconds into the run."""
    if shape.kind in ("constant", "soak"):
        return shape.level
    if shape.kind == "ramp":
        return shape.start_level + (shape.level - shape.start_level) * min(1.0, t / shape.ramp_s)
    if shape.kind == "step":
        k = min(shape.steps - 1, int(t // shape.step_s))
        frac = 1.0 if shape.steps == 1 else k / (shape.steps - 1)
        return shape.start_level + (shape.level - shape.start_level) * frac
    # spike: a base of level / factor, and the full level for spike_s seconds.
    in_spike = shape.spike_at_s <= t < shape.spike_at_s + shape.spike_s
    return shape.level if in_spike else shape.level / shape.spike_factor


def saturated(
    ttft_t: np.ndarray, ttft: np.ndarray, queue_t: np.ndarray, queue: np.ndarray
) -> bool:
    """Whether TTFT and the server's waiting queue both keep growing over the given window."""
    if len(ttft) < 10 or len(queue) < 3:
        return False
    half = (ttft_t.min() + ttft_t.max()) / 2
    early, late = ttft[ttft_t < half], ttft[ttft_t >= half]
    if len(early) < 3 or len(late) < 3:
        return False
    e, lt = float(np.median(early)), float(np.median(late))
    ttft_growing = lt > 1.5 * e and lt - e > 0.05
    slope = np.polyfit(queue_t - queue_t[0], queue, 1)[0] if np.ptp(queue_t) > 0 else 0.0
    queue_growing = slope > 0 and queue[-1] > max(1.0, 1.5 * queue[0])
    return bool(ttft_growing and queue_growing)


def waiting_requests(metrics_text: str) -> float:
    """Sum vllm:num_requests_waiting over all series of a Prometheus text page."""
    total = 0.0
    for m in re.finditer(r"^vllm:num_requests_waiting(?:\{[^}]*\})?\s+(\S+)", metrics_text, re.MULTILINE):
        total += float(m.group(1))
    return total


def stop_reason(stop: Stop, t: float, requests: int, failures: int,
                finished: int | None = None, scheduled: int | None = None) -> str | None:
    """Return which of duration, request count, the end of the schedule and error rate ends the
    run now, or None.

    ``requests`` and ``failures`` are the HTTP requests so far (each turn of a conversation
    counts); ``finished``, when known, the requests (conversations) of the run that have ended,
    which the request count is judged on; ``scheduled``, an open loop's arrivals in all: once
    each has ended there is nothing left to send or to wait for (a trace shorter than the
    duration ends the run with it).
    """
    if t >= stop.duration_s:
        return "duration"
    done = requests if finished is None else finished
    if stop.max_requests is not None and done >= stop.max_requests:
        return "max_requests"
    if scheduled is not None and finished is not None and finished >= scheduled:
        return "schedule"
    if (
        stop.max_error_rate is not None
        and requests >= stop.min_requests_for_error_rate
        and failures / requests > stop.max_error_rate
    ):
        return "error_rate"
    return None
