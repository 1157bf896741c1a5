"""The deadline a long command must stop by (a GPU reservation that ends), and how the lab keeps it.

``Deadline`` is the time, parsed from what the user wrote. ``Timing`` is what a server start and a
run take on each host, from the experiment's runs in the store (the plan's duration and start
timeout until one is measured). ``DeadlineGuard`` is a backend that starts no point whose expected
time would end past the deadline (``DeadlineReached``), less ``STOP_MARGIN_S`` kept for stopping
the servers. ``Watchdog`` interrupts a run that outlasts its estimate, as Ctrl-C does. The command
then exits ``EXIT_DEADLINE`` with the command that resumes it (``commands.stopping``).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Self

from vllm_lab import shutdown
from vllm_lab.backends import Backend, Measurement, PredictBackend
from vllm_lab.scenarios import Scenario, ScenarioError
from vllm_lab.store import LEFT_OUT, RunStatus, Store

# The exit status of a command stopped for its deadline (sysexits' EX_TEMPFAIL: try again later).
EXIT_DEADLINE = 75

_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
DEADLINE_RULE = ("write a time (2026-12-01T05:30, or 05:30 for today, local time) or a duration "
                 "from now (25m, 1h30m)")


# The furthest ahead a deadline may be.
MAX_AHEAD = timedelta(days=366)


class DeadlineError(ValueError):
    """A deadline the lab cannot take; the message is one sentence."""


@dataclass(frozen=True)
class Deadline:
    """The time (seconds since the epoch) the lab must have stopped by, and how it was written."""

    at: float
    text: str = ""
    clock: Callable[[], float] = field(default=time.time, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str, now: datetime | None = None) -> Deadline:
        """An ISO time (2026-12-01T05:30), HH:MM today (local time) or a duration (25m, 1h30m)."""
        now = now or datetime.now().astimezone()
        spec = text.strip()
        match = _DURATION.fullmatch(spec)
        if spec and match and any(match.groups()):
            h, m, s = (int(g or 0) for g in match.groups())
            if h * 3600 + m * 60 + s > MAX_AHEAD.total_seconds():  # before timedelta overflows
                raise DeadlineError(f"{text!r} is not a deadline: more than {MAX_AHEAD.days} days "
                                    f"ahead; {DEADLINE_RULE}")
            at = now + timedelta(hours=h, minutes=m, seconds=s)
        elif re.fullmatch(r"\d{1,2}:\d{2}", spec):
            hour, minute = (int(x) for x in spec.split(":"))
            if hour > 23 or minute > 59:
                raise DeadlineError(f"{text!r} is not a deadline: {DEADLINE_RULE}")
            at = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
        else:
            try:
                at = datetime.fromisoformat(spec)
                at = at.astimezone() if at.tzinfo is None else at  # a time without a zone is local
                ahead = at - now
            except (ValueError, OverflowError):  # OverflowError: a year 1 or 9999 in a zone
                raise DeadlineError(f"{text!r} is not a deadline: {DEADLINE_RULE}") from None
            if ahead > MAX_AHEAD:  # a timer cannot wait that long, and no reservation lasts so
                raise DeadlineError(f"{text!r} is not a deadline: more than {MAX_AHEAD.days} days "
                                    f"ahead (now {now:%Y-%m-%d %H:%M}); {DEADLINE_RULE}")
        if at <= now:
            raise DeadlineError(f"{text!r} is not a deadline: it is already past "
                                f"(now {now:%Y-%m-%d %H:%M}); {DEADLINE_RULE}")
        return cls(at.timestamp(), text)

    def left(self) -> float:
        """Seconds until the deadline (negative once past)."""
        return self.at - self.clock()

    def __str__(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.at))


class DeadlineReached(Exception):
    """The next point would end past the deadline: nothing more is started. ``why`` says what the
    point was expected to take against what was left ("" where a run was cut short instead)."""

    def __init__(self, host: str, why: str = ""):
        super().__init__(host)
        self.why = why


# A live backend stops its servers through a playbook after the last run: this much time is kept
# for it before the deadline; the predictor has nothing to stop.
STOP_MARGIN_S = 45.0
# Until a run of this experiment has been measured on a host, a live run is taken to last its
# load's duration plus this (warm-up, Locust's start, the last scrape) and a predicted one this.
RUN_OVERHEAD_S = 20.0
PREDICTED_RUN_S = 10.0
# Runs further apart than this on one host had a server start (or a resume) between them.
_SAME_SERVER_GAP_S = 5.0


@dataclass
class Timing:
    """What a server start and a run take on each host, from this experiment's recorded runs."""

    live: bool
    starts: dict[str, list[float]] = field(default_factory=dict)
    runs: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def from_store(cls, path: Path, experiment_id: str, backend: str) -> Timing:
        """The start and run times this experiment has recorded on each host (earlier runs included)."""
        timing = cls(live=backend != "predict")
        with Store(path) as store:
            # Its own runs and those of the experiments it is made of (autotune's candidates).
            runs = store.runs(experiment_id, family=True)
        runs = runs[runs["backend"] == backend] if not runs.empty else runs
        for host, rows in (runs.groupby("host") if not runs.empty else []):
            last_serve, last_end = None, None
            for row in rows.sort_values("started").itertuples():
                serve = json.loads(row.scenario_json).get("serve")
                started = timing.live and (serve != last_serve or last_end is None
                                           or row.started - last_end > _SAME_SERVER_GAP_S)
                timing.add(str(host), started, row.ended - row.started)
                last_serve, last_end = serve, row.ended
        return timing

    def add(self, host: str, started: bool, seconds: float) -> None:
        """Record one measured point: its seconds, and whether it started a server."""
        (self.starts if started else self.runs).setdefault(host, []).append(max(0.0, seconds))

    @staticmethod
    def _seen(table: dict[str, list[float]], host: str) -> list[float]:
        """The seconds ``table`` holds for ``host``, else for every host."""
        return table.get(host) or [v for values in table.values() for v in values]

    def start_measured(self, host: str) -> bool:
        """Whether a server start of this experiment was measured (on ``host``, else anywhere)."""
        return bool(self._seen(self.starts, host))

    def expected(self, host: str, scenario: Scenario, start: bool) -> float:
        """Seconds the next point on ``host`` is expected to take (the worst seen, else the plan's)."""
        runs = self._seen(self.runs, host)
        if not self.live:
            run_s = max(runs) if runs else PREDICTED_RUN_S
        elif scenario.load.stop.max_requests is not None:
            # Each request-bounded point sends its own number of requests (a calibration's 10 to
            # 1,024): the worst run seen says little of the next, so its own plan counts too.
            run_s = max([*runs, planned_run_s(scenario) + RUN_OVERHEAD_S])
        else:
            run_s = max(runs) if runs else planned_run_s(scenario) + RUN_OVERHEAD_S
        if not start:
            return run_s
        # A start measured here includes the runs discarded after it (run.warmup_runs).
        starts = [total - run_s for total in self._seen(self.starts, host)]
        start_s = max(starts) if starts else (scenario.run.start_timeout_s
                                              + scenario.run.warmup_runs * run_s)
        return max(0.0, start_s) + run_s


def planned_run_s(scenario: Scenario) -> float:
    """A live run's seconds of load before any was measured: its duration, or where it ends at a
    number of requests (``load.stop.max_requests``, the duration then only a cap), twice the
    twin's prediction of their send span and drain, at most the duration: the twin's profile may
    be of a faster host, and a run that outlasts its estimate is interrupted, not recorded."""
    window = scenario.load.stop.duration_s
    if scenario.load.stop.max_requests is None:
        return window
    try:
        predicted = PredictBackend().measure(scenario, None, Path(".")).summary.record()
    except (ValueError, OSError, ScenarioError):  # no profile or model shape to predict with: the cap
        return window
    span = (predicted.get("send_span_s") or 0.0) + (predicted.get("drain_s") or 0.0)
    return min(window, 2 * span) if span > 0 else window


class DeadlineGuard:
    """A backend that measures a point only when its start and run fit before the deadline."""

    def __init__(self, backend: Backend, deadline: Deadline, timing: Timing):
        self.backend, self.deadline, self.timing = backend, deadline, timing
        self.on_stop: Callable[[], None] = lambda: None  # the watchdog's disarm
        self.stopped = False  # a point was refused for the deadline
        self.name = backend.name
        self.margin = STOP_MARGIN_S if timing.live else 0.0
        self._serving: dict[str | None, str] = {}  # host -> serve flags of the server it runs

    def measure(self, scenario: Scenario, host: str | None, workdir: Path) -> Measurement:
        """The backend's measurement, or DeadlineReached when it would end past the deadline."""
        serve = json.dumps(scenario.serve, sort_keys=True, default=str)
        start = self.timing.live and self._serving.get(host) != serve
        where = host or ""
        need, left = self.timing.expected(where, scenario, start) + self.margin, self.deadline.left()
        if need > left:
            self.stopped = True
            self.on_stop()  # the servers' stop that follows must not be interrupted
            raise DeadlineReached(where, self._why(where, scenario, start, need, left))
        began = time.time()
        m = self.backend.measure(scenario, host, workdir)
        self.timing.add(where, start, time.time() - began)
        if m.status in (RunStatus.OK, *LEFT_OUT):  # it ended with its server up
            self._serving[host] = serve
        else:
            self._serving.pop(host, None)  # a failed start or a crash: the next point starts again
        return m

    def _why(self, host: str, scenario: Scenario, start: bool, need: float, left: float) -> str:
        """What the point was expected to take, and how, against the seconds left."""
        counted = ""
        if start and not self.timing.start_measured(host):
            counted = (f", its server's start counted as run.start_timeout_s="
                       f"{scenario.run.start_timeout_s:g} until one is measured in this experiment")
        elif start:
            counted = ", its server's start included"
        stop = " with the servers' stop" if self.margin else ""
        return (f"the next run needs about {need:.0f} s{stop}{counted}, and {max(0.0, left):.0f} s "
                f"were left")

    def close(self, host: str | None) -> None:
        """Stop the host's server (the backend's own close)."""
        self._serving.pop(host, None)
        self.backend.close(host)


class Watchdog:
    """Interrupts the main thread ``margin`` seconds before the deadline, so a run that outlasts
    its estimate is stopped like a Ctrl-C (not recorded, servers stopped). ``fired`` says it did;
    ``disarm()`` once the lab is stopping anyway: a signal then would cut the servers' stop short."""

    def __init__(self, deadline: Deadline | None, margin: float):
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._armed = deadline is not None
        self._timer = (threading.Timer(max(0.0, deadline.left() - margin), self._fire)
                       if deadline is not None else None)

    def _fire(self) -> None:
        with self._lock:
            if self._armed:
                self._armed = False
                self.fired.set()
                # A real SIGINT to the main thread: unlike _thread.interrupt_main() it also ends a
                # blocking wait (a subprocess, a sleep) there, as Ctrl-C does.
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def disarm(self) -> None:
        """Never fire from now on."""
        with self._lock:
            self._armed = False
        if self._timer:
            self._timer.cancel()

    def __enter__(self) -> Self:
        self._ignored = None
        if self._timer:
            # A lab started in the background (nohup, `make ... &` from a script) inherits SIGINT
            # ignored, and then the watchdog's signal would do nothing: take it as Ctrl-C again.
            if (threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
                self._ignored = signal.signal(signal.SIGINT, shutdown.on_signal)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.disarm()  # never after the watched block has ended (a report being built)
        if self._ignored is not None:
            signal.signal(signal.SIGINT, self._ignored)


