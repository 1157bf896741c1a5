"""Locust's fixed waits around a run of several processes, shortened (Locust 2.x, headless).

A run of more than one Locust process (`--processes`, or workers on other hosts) paid about 2.5 s
that no request needed, measured on the twin with 2 processes: 2.6 s from the call to the first
request against 0.9 s with one, and 1.5 s from the last reply to the exit against 0.3 s:
- the master looks for its workers once a second (``locust.main``'s ``start_automatic_run``),
  though forked workers are ready within 0.2 s;
- ``MasterRunner.quit`` waits half a second for the workers' last reports, and a headless run with
  a shape calls it three times on the way out (the shape's end, the end of the run, the shutdown).

On an H200 host, where runs of 32 users and more take two processes or more, this was most of the
lab's own time per run (3.0-3.7 s against 1.4-2.0 s with one). The lab reads its raw samples, not
Locust's tables, and its workers send their statistics at the stop themselves (the locustfile's
``_on_stopping``), so one half-second wait is kept and the repeats are dropped.
"""

from __future__ import annotations

import time
from typing import Any

# How often the master looks for its workers instead of every second.
WORKER_POLL_S = 0.02


class _PolledTime:
    """``locust.main``'s view of the time module: its one-second wait for workers polls."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        # The only sleep of exactly 1 s in locust.main is that wait (the others: 0.1 s, and
        # --autoquit, which the lab sets to 0); gevent's monkey-patching makes it cooperative.
        time.sleep(WORKER_POLL_S if seconds == 1 else seconds)


def shorten() -> None:
    """Patch the two waits in this process (the master's; harmless in a worker)."""
    import locust.main
    from locust.runners import MasterRunner

    if getattr(locust.main, "time", None) is time:
        locust.main.time = _PolledTime()
    if not getattr(MasterRunner.quit, "lab_once", False):
        MasterRunner.quit = _once(MasterRunner.quit)


def _once(quit_):
    def quit_once(self) -> None:
        if getattr(self, "_lab_quit", False):
            return
        self._lab_quit = True
        quit_(self)

    quit_once.lab_once = True
    return quit_once
