"""GPU_MINUTES: the wall minutes of the measuring backend, server starts counted.

A backend is measured through ``MeteredBackend``, which splits its time into server starts (and
stops) and measurement and keeps a candidate's server up between the rounds of its staircase.
``Budget`` holds what the candidates spent (recorded, and the one in flight) against GPU_MINUTES
and estimates what a start, a run and a stop will cost; the estimates follow what the backend
really took, so one that was too low is corrected after one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_lab.analysis.autotune import Spend
from vllm_lab.backends import Backend, Measurement
from vllm_lab.scenarios import Scenario


@dataclass(frozen=True)
class Measuring:
    """How a backend measures a candidate: top-k, staircase, and the cost estimates of the budget."""

    top: int
    step_s: float  # seconds per staircase level
    fractions: tuple[float, ...]  # of the predicted SLO capacity
    refine: int  # extra levels inside the SLO bracket, budget permitting
    start_s: float  # a server start (and stop), until one is observed
    run_overhead_s: float  # per run beyond its duration: Locust start, drain, audit


MEASURING = {
    "predict": Measuring(top=3, step_s=30, fractions=(0.7, 0.85, 1.0, 1.15, 1.3), refine=2,
                         start_s=0, run_overhead_s=1),
    # The twin on a small machine: short levels, few candidates, so a run takes minutes.
    # A twin level costs its duration plus about a minute more on 2 busy cores (Locust's start,
    # the drain of long answers, the audit): two levels and one refinement each.
    "twin": Measuring(top=2, step_s=15, fractions=(0.7, 1.0), refine=1, start_s=30,
                      run_overhead_s=45),
    # A real vLLM start (weights, compile, CUDA graphs) is one to two minutes.
    "vllm": Measuring(top=3, step_s=60, fractions=(0.7, 0.85, 1.0, 1.15, 1.3), refine=2,
                      start_s=120, run_overhead_s=15),
}


def measuring(backend: str) -> Measuring:
    """How ``backend`` measures a candidate (a backend not listed: as real vLLM)."""
    return MEASURING.get(backend, MEASURING["vllm"])


class MeteredBackend:
    """A backend whose wall time is split into server starts (and stops) and measurement, and whose
    server stays up between the rounds of one candidate's staircase (``release`` stops it)."""

    def __init__(self, inner: Backend):
        self.inner, self.name = inner, inner.name
        self.start_s = self.measure_s = 0.0
        self.runs = 0
        self.calls: list[tuple[float, float]] = []  # (wall, run) of each measure
        self.stops: list[float] = []

    def measure(self, scenario: Scenario, host: str | None, workdir: Path) -> Measurement:
        """Measure through the inner backend; time before the run began is start time."""
        t0 = time.time()
        m = self.inner.measure(scenario, host, workdir)
        wall = time.time() - t0
        # A run with samples sent load (client-limited ones too); one without never got a server.
        sent = m.samples is not None and len(m.samples) > 0
        run = min(max(m.ended - m.started, 0.0), wall) if sent else 0.0
        self.measure_s += run
        self.start_s += wall - run  # the server's start, warm-up, or a failed attempt
        self.runs += 1
        self.calls.append((wall, run))
        return m

    def close(self, host: str | None) -> None:
        """Kept up: the next round of the same candidate reuses the server."""

    def release(self, host: str | None = None) -> None:
        """Stop the server now; its stop counts as start time."""
        t0 = time.time()
        self.inner.close(host)
        self.stops.append(time.time() - t0)
        self.start_s += self.stops[-1]

    def taken(self) -> Spend:
        """Everything measured through this backend so far."""
        return Spend(self.start_s, self.measure_s, self.runs)


class Budget:
    """GPU_MINUTES as seconds of the measuring backend: the candidates' recorded ``spend`` plus
    what the one in flight has taken, and the estimated cost of a start, a run and a stop."""

    def __init__(self, minutes: float, how: Measuring, step_s: float, spend: dict[str, Spend],
                 backend: Backend):
        self.seconds = minutes * 60
        self.spend = spend
        self.metered = MeteredBackend(backend)
        self.live = backend.name != "predict"
        self.step_s = step_s
        self.start_est, self.run_wall = how.start_s, step_s + how.run_overhead_s
        self.stop_est = how.start_s / 4  # a server's stop, kept in reserve until one is observed
        self._mark = Spend()  # the meter when the candidate in flight began
        self._first_call = 0

    def spent(self) -> float:
        """Seconds spent: every candidate's recorded spend and the one in flight's so far."""
        recorded = sum(v.start_s + v.measure_s for v in self.spend.values())
        now = self.metered.taken()
        return recorded + now.start_s + now.measure_s - self._mark.start_s - self._mark.measure_s

    def left(self) -> float:
        """Seconds of GPU_MINUTES left."""
        return max(self.seconds - self.spent(), 0.0)

    def cost(self, runs: int) -> float:
        """What a candidate with ``runs`` levels still to take is expected to cost (a start too)."""
        return self.start_est + runs * self.run_wall if runs else 0.0

    def begin(self) -> None:
        """A candidate starts: what it takes is counted from here."""
        self._mark = self.metered.taken()
        self._first_call = len(self.metered.calls)

    def ran(self) -> bool:
        """Whether the candidate in flight has taken a run (its first was admitted on its estimate)."""
        return self.metered.runs > self._mark.runs

    def fits_a_run(self) -> bool:
        """Whether the next run and a server's stop still fit."""
        return self.spent() + self.next_run() + self.stop_est <= self.seconds

    def next_run(self) -> float:
        """The slowest run of this candidate so far (the first one's run part: its wall paid the
        start), else the estimate: conservative, so the budget is not overrun."""
        calls = self.metered.calls[self._first_call:]
        seen = [calls[0][1]] + [wall for wall, _ in calls[1:]] if calls else []
        return max([self.run_wall, *seen])

    def end(self, name: str, save: Callable[[dict[str, Spend]], None]) -> Spend:
        """Stop the candidate's server and add what it took to its spend, saved even when the stop
        itself is cut short (the deadline, Ctrl-C): the minutes were spent."""
        try:
            self.metered.release()
        finally:
            now = self.metered.taken()
            used = Spend(now.start_s - self._mark.start_s, now.measure_s - self._mark.measure_s,
                         now.runs - self._mark.runs)
            self.spend[name] = self.spend.get(name, Spend()) + used
            self._mark = now
            save(self.spend)
        return used

    def learn(self) -> None:
        """The estimates from the candidate just measured: the first call of a candidate paid its
        server's start, the stop came at its end."""
        calls = self.metered.calls[self._first_call:]
        if not calls or not self.live:
            return
        self.start_est = calls[0][0] - calls[0][1] + self.metered.stops[-1]
        self.stop_est = self.metered.stops[-1]
        later = [wall for wall, _ in calls[1:]] or [calls[0][1]]
        self.run_wall = max(sum(later) / len(later), self.step_s)
