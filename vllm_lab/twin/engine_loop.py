"""The engine loop: steps the simulated engine on an ideal timeline and hands each step's tokens
to the requests waiting on it.

Each step starts where the last one ended (or when a request arrives at an idle engine) and its
outputs are released on the real clock at step start + modelled duration. When the host cannot keep
up, the release is late (the lag is measured and exported) and the timeline does not drift.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm_lab.twin.engine import EngineRequest
from vllm_lab.twin.frontend import Frontend
from vllm_lab.twin.metrics import TwinMetrics

GROUND_TRUTH_KEEP = 200_000
SPIN_S = 0.001  # the last stretch before a release is waited by yielding, not by a timer


@dataclass
class _Req:
    """One request's state between the engine loop and its HTTP handler."""

    rid: str
    arrival: float
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    eos_after: int | None
    engine_arrival: float = 0.0  # arrival + the profile's frontend latency (HTTP, tokenize)
    priority: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[int] = field(default_factory=list)
    n_out: int = 0
    num_cached: int = 0
    finished: bool = False
    finish_reason: str | None = None
    sched_plan: float | None = None
    queue_s: float | None = None
    first_plan: float | None = None
    last_plan: float | None = None
    first_sent: float | None = None
    last_sent: float | None = None
    events: int = 0
    coalesced: int = 0


def _queue_s(r: _Req, scheduled: float) -> float:
    """vLLM's queue time: from when the engine core took the request in (between steps) to when it
    was first scheduled, as the engine stamped it; ``scheduled`` when it has no stamp."""
    return r.queue_s if r.queue_s is not None else scheduled - r.engine_arrival


class EngineLoop:
    """Steps the engine on the ideal timeline and hands each step's outputs to the requests."""

    def __init__(self, engine: Any, metrics: TwinMetrics, flags: dict | None = None):
        self.engine = engine
        self.metrics = metrics
        self.frontend = metrics.frontend = Frontend.of(engine.profile.coefficients, flags or {})
        # Steps whose tokens the modelled API server has not streamed yet: (due, result, start).
        self.streaming: deque[tuple[float, Any, float]] = deque()
        self.streamed = asyncio.Event()
        self.reqs: dict[str, _Req] = {}
        self.arrivals: deque[_Req] = deque()
        self.clock = 0.0
        self.wake = asyncio.Event()
        self.lags: deque[float] = deque(maxlen=GROUND_TRUTH_KEEP)
        self.truth: deque[dict] = deque(maxlen=GROUND_TRUTH_KEEP)
        self.steps = 0
        self._deferred: tuple[list, float, float] | None = None  # a step's outputs not handed out yet

    def submit(self, req: _Req) -> None:
        """Queue a request; the engine sees it once its clock reaches the arrival time."""
        self.reqs[req.rid] = req
        self.arrivals.append(req)
        self.wake.set()

    def abort(self, req: _Req) -> None:
        """The client went away: drop the request from the engine."""
        if req.finished:
            return
        req.finished = True
        req.finish_reason = "abort"
        if req in self.arrivals:
            self.arrivals.remove(req)
        else:
            self.engine.abort_request(req.rid)
        self.reqs.pop(req.rid, None)
        self.metrics.request_success["abort"].inc()

    def _admit(self) -> None:
        eng = self.engine
        while self.arrivals and self.arrivals[0].engine_arrival <= self.clock:
            r = self.arrivals.popleft()
            try:
                eng.add_request(EngineRequest(
                    request_id=r.rid, prompt_token_ids=r.prompt_ids, max_tokens=r.max_tokens,
                    min_tokens=r.min_tokens, ignore_eos=r.ignore_eos, eos_after=r.eos_after,
                    arrival_time=r.engine_arrival, priority=r.priority))
            except ValueError:  # the engine refused it (a duplicate id): end it as vLLM would
                r.finished = True
                r.finish_reason = "error"
                self.reqs.pop(r.rid, None)
                r.event.set()

    async def run(self) -> None:
        """The engine loop; runs until cancelled."""
        perf = time.perf_counter
        eng = self.engine
        while True:
            if not eng.has_unfinished_requests():
                if not self.arrivals:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                # An idle engine starts its next step when the request arrives.
                self.clock = max(self.clock, self.arrivals[0].engine_arrival)
            self._admit()
            start = self.clock
            result = eng.step(start)
            duration = result.duration_s
            if duration <= 0 and not result.outputs:
                duration = 0.0005  # nothing schedulable: wait a little for the world to change
            end = start + duration
            delay = end - perf()
            # Timers fire up to ~1 ms late (epoll/libuv resolution): sleep to just short of the
            # release, then yield to I/O until it is due. Always yield at least once, so
            # handlers can write even when the host is behind.
            if delay > SPIN_S:
                await asyncio.sleep(delay - SPIN_S)
            await asyncio.sleep(0)
            while perf() < end:
                await asyncio.sleep(0)
            lag = perf() - end
            self.clock = end
            tokens = sum(len(o.new_token_ids) for o in result.outputs)
            due = self.frontend.release(end, tokens)
            if due <= end and not self.streaming:
                self._release(result, start, end)
            else:
                self.streaming.append((due, result, start))
                self.streamed.set()
            self.steps += 1
            self.lags.append(lag)
            scheduled = getattr(result, "num_scheduled_tokens", None)
            if scheduled is None:
                scheduled = sum(len(o.new_token_ids) for o in result.outputs)
            self.metrics.observe_step(scheduled, max(0.0, lag))
            # Let the woken handlers write before the next step is computed: otherwise every
            # token waits for the engine's own CPU time and reaches clients late.
            await asyncio.sleep(0)

    async def stream(self) -> None:
        """Release steps the modelled API server is still streaming, each when it is due."""
        perf = time.perf_counter
        while True:
            if not self.streaming:
                self.streamed.clear()
                await self.streamed.wait()
                continue
            due, result, start = self.streaming[0]
            if due - perf() > SPIN_S:
                await asyncio.sleep(due - perf() - SPIN_S)
            while perf() < due:
                await asyncio.sleep(0)
            self.streaming.popleft()
            self._release(result, start, due)

    def _release(self, result: Any, start: float, end: float) -> None:
        # An earlier step's deferred part goes first: each request's tokens stay in order.
        self._release_deferred()
        outputs = result.outputs
        # Requests getting their first token are handed out first, and their handlers write
        # before the rest of the step is handed out: TTFT is the figure most sensitive to the
        # order in which the server works after a step. All of a step's tokens are due at once.
        firsts = [o for o in outputs if o.new_token_ids and (r := self.reqs.get(o.request_id))
                  and r.first_plan is None]
        if not firsts or len(firsts) == len(outputs):
            self._hand_out(outputs, start, end)
            return
        first_ids = {o.request_id for o in firsts}
        self._hand_out(firsts, start, end)
        self._deferred = ([o for o in outputs if o.request_id not in first_ids], start, end)
        # Queued after the woken handlers: they run (and write) before it.
        asyncio.get_running_loop().call_soon(self._release_deferred)

    def _release_deferred(self) -> None:
        if self._deferred is not None:
            outputs, start, end = self._deferred
            self._deferred = None
            self._hand_out(outputs, start, end)

    def _hand_out(self, outputs: list, start: float, end: float) -> None:
        """Give a step's outputs to their requests and wake their handlers."""
        m = self.metrics
        for out in outputs:
            r = self.reqs.get(out.request_id)
            if r is None:
                continue
            if r.sched_plan is None:
                sched = getattr(out, "scheduled_s", None)
                r.sched_plan = sched if sched is not None else start
                r.queue_s = getattr(out, "queue_time_s", None)
            if out.num_cached_tokens:
                r.num_cached = out.num_cached_tokens
            if out.new_token_ids:
                if r.first_plan is None:
                    r.first_plan = end
                    m.ttft.observe(end - r.arrival)
                else:
                    m.itl.observe(end - r.last_plan)
                r.last_plan = end
                r.pending.extend(out.new_token_ids)
                r.n_out += len(out.new_token_ids)
            if out.finished:
                r.finished = True
                r.finish_reason = out.finish_reason or "length"
                self.reqs.pop(r.rid, None)
                self._finish(r)
            r.event.set()

    def _finish(self, r: _Req) -> None:
        first = r.first_plan if r.first_plan is not None else r.last_plan or r.arrival
        last = r.last_plan if r.last_plan is not None else first
        sched = r.sched_plan if r.sched_plan is not None else r.arrival
        self.metrics.observe_finished(
            r.finish_reason, e2e_s=last - r.arrival, queue_s=_queue_s(r, sched),
            prefill_s=first - sched, decode_s=last - first, num_prompt=len(r.prompt_ids),
            num_cached=r.num_cached, num_generated=r.n_out)

    def record_truth(self, r: _Req) -> None:
        """Keep one finished request's ideal times next to when its bytes really went out."""
        if r.first_plan is None:
            return
        tpot = (r.last_plan - r.first_plan) / (r.n_out - 1) if r.n_out > 1 else None
        self.truth.append({
            "id": r.rid, "arrival_s": r.arrival, "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": r.n_out, "finish_reason": r.finish_reason,
            "ttft_s": r.first_plan - r.arrival, "tpot_s": tpot, "e2e_s": r.last_plan - r.arrival,
            "queue_s": _queue_s(r, r.sched_plan or r.engine_arrival),
            "first_token_late_s": (r.first_sent - r.first_plan) if r.first_sent else None,
            "last_token_late_s": (r.last_sent - r.last_plan) if r.last_sent else None,
            "sse_events": r.events, "coalesced_tokens": r.coalesced})
