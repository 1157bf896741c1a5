"""Python's garbage collections, CPU, memory and threads of one server process, a line a second.

Made to ask whether vLLM's API server pauses for its collections longer the more it has served
(the twin's reference README: "Which state a run settles in"). Python imports a file named
``sitecustomize`` from its path at start-up, so this one is picked up by every Python process
started with this folder on ``PYTHONPATH``; it does nothing unless ``LAB_GC_PROBE`` names a folder,
and then only in a process whose command line matches ``LAB_GC_PROBE_MATCH`` (a regular
expression, default ``(^|\\s)serve(\\s|$)``: ``vllm serve``'s API server, not the lab's client,
Ansible or Locust). On a GPU host with vLLM installed:

    export PYTHONPATH=$LAB/scripts/gc_probe:$PYTHONPATH LAB_GC_PROBE=$RESULTS/gc
    python scripts/bench_client_parity.py start ...   # the playbooks pass their environment on

(or the same two variables in front of ``vllm serve``; or copy this file into a folder already
first on the server's Python path, and set only ``LAB_GC_PROBE``). Per probed process it appends,
once a second, to ``$LAB_GC_PROBE/gc-<pid>.csv``: the time, the process's RSS and CPU seconds,
whether the collector is on, ``gc.get_count()``, the frozen objects, and per generation the
collections, their seconds, the longest pause in that second and the objects they freed (all but
the longest pause counted from the start). Every ``LAB_GC_PROBE_THREADS_S`` seconds (default 10;
0: never) the threads whose CPU seconds moved go to ``threads-<pid>.csv`` (thread id, name, CPU
seconds since the thread started). The first line of each file is a ``#`` comment with the command
line and the collector's thresholds.

Its cost: a callback that adds to a few counters at each collection's start and stop (no file
write per collection), and one thread that wakes once a second to write a line. Reading every
thread's /proc entry is what costs: with ``LAB_GC_PROBE_THREADS_S=1`` the probe's thread used
0.055-0.06 of a core beside vLLM 0.26's API server (73 threads) on an H200 host whose kernel is
gVisor (``traffic-2026-12-05``); sampling the threads from outside (the parity script's
``CpuSampler``) takes nothing from the process.

``LAB_GC_PROBE_GC`` changes the probed process's collector, for a run that makes it cheap: ``off``
(``gc.disable()``; vLLM's own ``gc.collect()`` calls still run) or ``A,B,C`` (``gc.set_threshold``).
A child the process forks (vLLM's engine core) gets Python's defaults back and is not probed.

The event loop's lag: every ``LAB_GC_PROBE_LOOP_MS`` milliseconds (default 20; 0: never) the
probe's second thread hands the process's asyncio loop (the newest one its main thread runs: the
API server's, or that of each run of ``vllm bench serve`` called in one process) a callback and
times how long the callback waits before the loop runs it: what every task made ready then waited,
a request's admission or a stream's next write. Each line adds the callbacks timed in that second,
their mean and their longest wait (``loop_n``, ``loop_mean_ms``, ``loop_max_ms``; empty before the
loop runs). The loop is found by wrapping ``asyncio``'s ``_set_running_loop``, which asyncio's
loops and uvloop's call when they start (uvloop keeps the function it found at its import: this
file runs before). The default probe matches ``vllm bench serve``'s command line too
(``scripts/reference_runs.sh loop`` also matches the parity script, which calls the bench in
itself); the lab's own client runs on gevent, not asyncio, and is not timed so. Its cost, on an
idle loop of this lab's 2-core test machine: 0.017 of a core at 20 ms (10 s: 0.36-0.38 s of CPU
against 0.20 s unprobed), 0.024 at 10 ms.
"""

from __future__ import annotations

import os

_FOLDER = os.environ.get("LAB_GC_PROBE", "")
# Imported only where the probe runs (_start): in the processes it leaves alone this file adds
# nothing, not even an early `threading` before Locust's gevent patches it.
gc = re = threading = time = _PAUSE = None


def _cmdline() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class _Probe:
    """Counters the collector's callback updates and the thread that writes them out."""

    GENS = (0, 1, 2)

    def __init__(self, folder: str, cmd: str):
        self.pid = os.getpid()
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]   # the longest pause since the last line
        self.collected = [0, 0, 0]
        self.started = 0.0
        self.lock = threading.Lock()     # held while a line is written, and across a fork
        self.tick = os.sysconf("SC_CLK_TCK")
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.threads: dict[int, float] = {}
        self.threads_every = float(os.environ.get("LAB_GC_PROBE_THREADS_S", "10"))
        self.threads_last = 0.0
        os.makedirs(folder, exist_ok=True)
        # Open for the process's life, line-buffered: one write a second, nothing per collection.
        path = os.path.join(folder, f"{{}}-{self.pid}.csv")
        self.gc_file = open(path.format("gc"), "a", buffering=1)  # noqa: SIM115
        self.th_file = open(path.format("threads"), "a", buffering=1)  # noqa: SIM115
        head = f"# pid {self.pid}: {cmd[:300]!r}; thresholds {gc.get_threshold()}\n"
        self.gc_file.write(head + "ts,rss_bytes,cpu_s,enabled,count0,count1,count2,frozen,"
                           + ",".join(f"{k}{g}" for k in ("n", "s", "max", "collected")
                                      for g in self.GENS) + ",loop_n,loop_mean_ms,loop_max_ms\n")
        self.th_file.write(head + "ts,tid,name,cpu_s\n")
        self.loop = None                 # the event loop the main thread runs, once it runs one
        self.lags: list[float] = []      # seconds each timed callback waited, since the last line

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        g = info.get("generation", 0)
        d = time.perf_counter() - self.started
        self.count[g] += 1
        self.seconds[g] += d
        self.longest[g] = max(self.longest[g], d)
        self.collected[g] += info.get("collected", 0)

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _thread_lines(self, now: float) -> str:
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / self.tick   # utime, stime
            t = int(tid)
            if self.threads.get(t) != cpu:
                self.threads[t] = cpu
                name = names.get(t, comm).replace(",", ";")
                out.append(f"{now:.2f},{t},{name},{cpu:.2f}\n")
        return "".join(out)

    def line(self) -> None:
        now = time.time()
        times = os.times()
        longest, self.longest = self.longest, [0.0, 0.0, 0.0]
        row = [f"{now:.2f}", str(self._rss()), f"{times.user + times.system:.2f}",
               str(int(gc.isenabled())), *map(str, gc.get_count()), str(gc.get_freeze_count()),
               *map(str, self.count), *(f"{s:.6f}" for s in self.seconds),
               *(f"{s:.6f}" for s in longest), *map(str, self.collected), *self._lag_cells()]
        self.gc_file.write(",".join(row) + "\n")
        if self.threads_every > 0 and now - self.threads_last >= self.threads_every - 0.5:
            self.threads_last = now
            self.th_file.write(self._thread_lines(now))

    def _lag_cells(self) -> list[str]:
        lags, self.lags = self.lags, []
        if not lags:
            return ["", "", ""] if self.loop is None else ["0", "", ""]
        return [str(len(lags)), f"{1e3 * sum(lags) / len(lags):.3f}", f"{1e3 * max(lags):.3f}"]

    def found(self, loop) -> None:
        """``asyncio._set_running_loop``'s wrapper reports each loop a thread starts running: the
        main thread's newest is timed (a process that calls ``asyncio.run`` once a run starts a
        loop a run)."""
        if loop is not None and threading.current_thread() is threading.main_thread():
            self.loop = loop

    def _landed(self, sent: float) -> None:
        self.lags.append(time.perf_counter() - sent)

    def sample_loop(self, every: float) -> None:
        """Hand the loop a callback every ``every`` seconds; ``_landed`` times its wait."""
        while True:
            _PAUSE(every)
            loop = self.loop
            if loop is None:
                continue
            try:
                loop.call_soon_threadsafe(self._landed, time.perf_counter())
            except RuntimeError:  # the loop closed: wait for the next one the main thread runs
                if self.loop is loop:
                    self.loop = None

    def run(self) -> None:
        while True:
            _PAUSE(1.0)
            with self.lock:
                try:
                    self.line()
                except Exception as e:  # noqa: BLE001 - a probe must never take its process down
                    self._note(f"# a line failed: {e!r}\n")

    def _note(self, text: str) -> None:
        try:
            self.gc_file.write(text)
        except OSError:  # a full disk: the lines stop, the process goes on
            return


def _configure(setting: str) -> None:
    if setting == "off":
        gc.disable()
    elif setting:
        gc.set_threshold(*(int(x) for x in setting.split(",")))


def _start() -> None:
    global gc, re, threading, time, _PAUSE
    import re
    import sys

    cmd = _cmdline()
    if not re.search(os.environ.get("LAB_GC_PROBE_MATCH", r"(^|\s)serve(\s|$)"), cmd):
        return
    if getattr(sys, "_lab_gc_probe", False):  # two copies on the path: the first one probes
        return
    sys._lab_gc_probe = True
    import gc
    import threading
    import time

    _PAUSE = time.sleep  # the real one, whatever patches time later
    _configure(os.environ.get("LAB_GC_PROBE_GC", ""))
    probe = _Probe(_FOLDER, cmd)
    gc.callbacks.append(probe.callback)

    def in_child() -> None:  # a forked child (vLLM's engine core) runs with Python's defaults
        probe.lock.release()
        if probe.callback in gc.callbacks:
            gc.callbacks.remove(probe.callback)
        gc.set_threshold(700, 10, 10)
        gc.enable()

    os.register_at_fork(before=probe.lock.acquire, after_in_parent=probe.lock.release,
                        after_in_child=in_child)
    threading.Thread(target=probe.run, name="lab-gc-probe", daemon=True).start()
    every = float(os.environ.get("LAB_GC_PROBE_LOOP_MS", "20")) / 1e3
    if every > 0:
        _watch_loops(probe)
        threading.Thread(target=probe.sample_loop, args=(every,), name="lab-loop-probe",
                         daemon=True).start()


def _watch_loops(probe: _Probe) -> None:
    """Wrap asyncio's ``_set_running_loop`` (both names it has) so the probe learns the loop."""
    import asyncio
    import asyncio.events

    original = asyncio.events._set_running_loop

    def set_running_loop(loop):
        probe.found(loop)
        return original(loop)

    asyncio.events._set_running_loop = set_running_loop
    asyncio._set_running_loop = set_running_loop


def _chain() -> None:
    """Import the sitecustomize this file hides (a distribution's own), if there is one."""
    import importlib
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    mine = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - as Python itself reports a failing sitecustomize
        print(f"Error in sitecustomize (chained by the GC probe): {e!r}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


_chain()
if _FOLDER:
    try:
        _start()
    except Exception as e:  # noqa: BLE001 - a probe must never stop its process from starting
        import sys

        print(f"LAB_GC_PROBE: not started: {e!r}", file=sys.stderr)
