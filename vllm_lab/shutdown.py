"""How the lab ends when it is told to: SIGTERM (a job scheduler), SIGHUP (a closed terminal) and
Ctrl-C all end a command the way Ctrl-C always did, its servers and Locust processes stopped.

- The first signal is raised in the main thread where the command is (``KeyboardInterrupt`` for
  SIGINT, ``Terminated``, a KeyboardInterrupt too, for SIGTERM and SIGHUP), so every path that
  stops on Ctrl-C (a run's Locust group, the servers, the instance locks, the heartbeat) stops on
  them too.
- From then on the lab is stopping: a second signal (two Ctrl-C a second apart) is noted, not
  raised, so it cannot cut the servers' stop short; a SIGTERM after the SIGTERM raised is the
  same stop passed on again (make's copy), not noted. A signal that comes while the lab stops a
  server between two points (``shielded``) waits until that stop is done.
- At exit, whatever a live backend still runs (a command that ended by an error) is stopped by
  the callbacks given to ``on_exit``.

``handling()`` is the block a command runs in (``cli.main``).

A SIGINT or SIGHUP the lab inherited ignored (``nohup``, a script's ``&``) stays ignored.
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where a Ctrl-C would be; ``code`` is the shell's status for it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.code = 128 + signum
        super().__init__(self.name)


class _State:
    active = False          # inside handling(): a command is running
    stopping = False        # a stop signal was raised (or the process is exiting)
    shield_depth = 0        # main-thread blocks no signal may cut short
    pending: int | None = None  # a signal that came inside such a block
    noted = False           # the "still stopping" line was said
    installed = False
    raised: int | None = None  # the signal raised


_state = _State()
_exit_callbacks: list[Callable[[], Callable[[], None] | None]] = []


def exit_code(stop: KeyboardInterrupt) -> int:
    """The shell's status for a command ended by ``stop``: 130 for Ctrl-C, 128+n for signal n."""
    return stop.code if isinstance(stop, Terminated) else 128 + signal.SIGINT


def _raise(signum: int) -> None:
    _state.stopping = True
    _state.raised = signum
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def on_signal(signum: int, frame) -> None:
    """The handler of every stop signal: the first raised, later ones noted (see the module);
    outside a command's block (a test calling a command's function) every one is raised."""
    if _state.active and (_state.stopping or _state.shield_depth):
        if _echo(signum):
            return
        if not _state.stopping and _state.pending is None:
            _state.pending = signum
        if not _state.noted:
            _state.noted = True
            print(f"lab: {signal.Signals(signum).name}: stopping the servers first; the lab ends "
                  f"once they are stopped", file=sys.stderr, flush=True)
        return
    _raise(signum)


def stop_words(stop: KeyboardInterrupt) -> str:
    """How a stop is said: "stopped by SIGTERM" (or SIGHUP), "interrupted" for Ctrl-C."""
    return f"stopped by {stop.name}" if isinstance(stop, Terminated) else "interrupted"


def stop_inside(error: BaseException) -> KeyboardInterrupt | None:
    """The stop a library turned into an error of its own, or None.

    A signal is raised in whatever Python code the main thread runs, also code that a compiled
    library called back into: pydantic's serializers catch the KeyboardInterrupt or Terminated
    raised there and raise ``PydanticSerializationError: ... Terminated: SIGTERM`` instead, which
    no ``except KeyboardInterrupt`` meets (a SIGTERM during a sweep ended as an internal error).
    """
    if _state.raised is None or isinstance(error, KeyboardInterrupt):
        return None
    signum = _state.raised
    stop = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
    return stop if f"{type(stop).__name__}:" in str(error) else None


def _echo(signum: int) -> bool:
    """Whether ``signum`` is a copy of the SIGTERM already raised, not a second stop to note.

    SIGTERM comes from programs, and they signal a whole process group: make passes it on to its
    children, who got it as members of that group already (a job scheduler, scripts/lab-make).
    How late that copy comes is no sign of it: make in the idle CPU class beside busy processes
    passed it on over 30 s later (a CI run of 2026-12-06). A person's second Ctrl-C or a closed
    terminal's SIGHUP is still noted; a program's second SIGTERM reads no line either way, and
    is never raised."""
    return signum == signal.SIGTERM and _state.raised == signum


@contextmanager
def handling() -> Iterator[None]:
    """One command's block: SIGINT, SIGTERM and SIGHUP taken as stops (an inherited ignore kept),
    the handlers before it given back at its end (a test runs many commands in one process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.stopping, _state.pending, _state.noted, _state.shield_depth = False, None, False, 0
    _state.raised = None
    before = {}
    for signum in SIGNALS:
        if signum != signal.SIGTERM and signal.getsignal(signum) is signal.SIG_IGN:
            continue
        before[signum] = signal.signal(signum, on_signal)
    if not _state.installed:
        _state.installed = True
        atexit.register(_at_exit)
    _state.active = True
    try:
        yield
    finally:
        _state.active = False
        for signum, handler in before.items():
            signal.signal(signum, handler)


def begin_stop() -> None:
    """The lab is stopping for a reason of its own (its deadline): no signal cuts the stop short."""
    _state.stopping = True


@contextmanager
def shielded() -> Iterator[None]:
    """A block no signal cuts short (stopping a server): a signal that comes meanwhile is raised
    when the block ends. In other threads (a host's share under SPREAD) it does nothing: signals
    are only ever raised in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.shield_depth += 1
    try:
        yield
    finally:
        _state.shield_depth -= 1
        pending, _state.pending = _state.pending, None
        if not _state.shield_depth and pending is not None and not _state.stopping:
            _raise(pending)


def on_exit(callback: Callable[[], None]) -> None:
    """Call ``callback`` (a bound method: kept by a weak reference) when the process exits."""
    ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else (lambda: callback)
    _exit_callbacks.append(ref)


def _at_exit() -> None:
    _state.active = _state.stopping = True  # nothing cuts these stops short either
    for ref in reversed(_exit_callbacks):
        callback = ref()
        if callback is not None:
            try:
                callback()
            except Exception as e:  # noqa: BLE001  one failed stop must not skip the others
                print(f"lab: at exit: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    _exit_callbacks.clear()
