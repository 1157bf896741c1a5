"""The one way a long command stops before its end: the deadline or Ctrl-C, its servers stopped,
what it finished kept in the store, one sentence with the command that resumes it, and the exit
status (``EXIT_DEADLINE`` for the deadline, 130 for Ctrl-C).

A command takes its runs inside ``take``: it builds the backend for the command's progress, arms
the watchdog, and on a stop asks the command for its ``Account`` (what was done, what is left),
says it, and raises ``Stopped``; ``stoppable`` turns that into the command's exit status. A later
round of the same command (a ramp's refinement, a search's confirmation) is never started after a
stop, since the stop leaves the command.
"""

from __future__ import annotations

import functools
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from vllm_lab import shutdown
from vllm_lab.backends import Backend
from vllm_lab.commands.backend import guarded_backend
from vllm_lab.commands.settings import Settings
from vllm_lab.deadline import EXIT_DEADLINE, Deadline, DeadlineGuard, DeadlineReached, Watchdog
from vllm_lab.progress import Progress, tracking
from vllm_lab.store import Store, StoreError

EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
T = TypeVar("T")


class Stopped(Exception):
    """A command stopped before its end, after saying so; ``code`` is its exit status."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class Account:
    """What a stopped command had done, for its sentence: ``done`` ("3 of 4 runs done, 1 left"),
    what else it ``kept``, and the make variables its resume changes (``TRIALS`` left)."""

    done: str
    kept: str = ""
    changes: dict[str, object] = field(default_factory=dict)


def stoppable(command: Callable[..., int]) -> Callable[..., int]:
    """A long command whose stop ends it with the stop's exit status."""
    @functools.wraps(command)
    def run(*args, **kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except Stopped as stop:
            return stop.code
    return run


@contextmanager
def watched(deadline: Deadline | None, backend: Backend) -> Iterator[Watchdog]:
    """The block a long command takes its runs in: a Watchdog armed for the deadline (disarmed
    once a DeadlineGuard stops, and the lab then stopping: no signal cuts its servers' stop
    short), and the Ctrl-C the watchdog sends raised as DeadlineReached; a Ctrl-C, SIGTERM or
    SIGHUP of the user's stays a KeyboardInterrupt."""
    watch = Watchdog(deadline, getattr(backend, "margin", 0.0))
    if isinstance(backend, DeadlineGuard):
        def stop() -> None:
            watch.disarm()
            shutdown.begin_stop()
        backend.on_stop = stop
    # The try holds the with: a signal the watchdog sent just as the block ended lands while
    # its exit disarms it, and is the deadline too, not the user's Ctrl-C.
    try:
        with watch:
            try:
                yield watch
            except Exception as error:  # a stop a library wrapped is the stop again
                stop = shutdown.stop_inside(error)
                if stop is None:
                    raise
                raise stop from error
    except KeyboardInterrupt:
        if not watch.fired.is_set():
            raise
        raise DeadlineReached("") from None


def take(settings: Settings, exp_id: str, shown: Progress, work: Callable[[Backend], T],
         account: Callable[[], Account]) -> T:
    """``work(backend)``'s result, its runs taken on the experiment's backend within the deadline;
    on the deadline, Ctrl-C, SIGTERM or SIGHUP, the command's ``account()`` said in one sentence,
    then ``Stopped``. The progress is finished however it ends (provisioning included), so the
    heartbeat never says "running" for a command that is gone."""
    began = time.time()
    try:
        with tracking(shown):
            backend = guarded_backend(settings, exp_id, shown)
            provisioned = time.time()
            try:
                with watched(settings.deadline, backend):
                    return work(backend)
            finally:
                keep_host_time(settings, exp_id, backend, began, provisioned)
    except DeadlineReached as reached:
        why = f" ({reached.why})" if reached.why else ""
        _say(f"stopped for DEADLINE={settings.deadline}{why}", settings, exp_id, account())
        raise Stopped(EXIT_DEADLINE) from None
    except KeyboardInterrupt as stop:
        _say(shutdown.stop_words(stop), settings, exp_id, account())
        raise Stopped(shutdown.exit_code(stop)) from None


def _say(why: str, settings: Settings, exp_id: str, done: Account) -> None:
    """One line on stderr: why it stopped, what was done, and the command that resumes."""
    servers = ", servers stopped" if settings.backend != "predict" else ""
    kept = f"; {done.kept}" if done.kept else ""
    print(f"lab: {why}: {done.done}{servers}{kept}; resume with: "
          f"{settings.resume_with(exp_id, **done.changes)}", file=sys.stderr)


def keep_host_time(settings: Settings, exp_id: str, backend: Backend, began: float,
                   provisioned: float) -> None:
    """Add this command's span on its hosts to the experiment's meta (``host_time``): when it
    began, how long provisioning took, when its last server had stopped and how long its stops
    took. With the runs' own parts it tells where the hosts' time went (``analysis.host_time``).
    The predictor has no hosts; an experiment that recorded no run has nothing to account for."""
    if settings.backend == "predict":
        return
    inner = getattr(backend, "backend", backend)  # a DeadlineGuard's backend
    span = {"began": began, "provisioned_s": provisioned - began, "ended": time.time(),
            "stops_s": float(getattr(inner, "stops_s", 0.0))}
    try:
        with Store(settings.store_path) as store:
            kept = store.experiment(exp_id)["meta"].get("host_time") or []
            store.update_meta(exp_id, host_time=[*kept, span])
    except StoreError:
        pass  # no run recorded, so no experiment: nothing spent on it to account for
    except sqlite3.Error as e:  # the runs are kept; only this account of their time is not
        print(f"lab: {settings.store_path}: this command's host time was not kept: {e}",
              file=sys.stderr)
