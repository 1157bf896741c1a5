"""Where a long command is: the experiment (point i of N, run j of k, elapsed, ETA) and the point
in flight (server starting against its expected time; measuring: window, requests, tok/s, errors).

On a terminal it is drawn with ``rich``; on a pipe, a file, CI, ``TERM=dumb`` or ``NO_COLOR`` it
is plain timestamped lines without escape codes, so logs stay greppable. Every change is also
written to a heartbeat file (``OUT/.work/status.json``, with the pid) that ``make status`` reads
from another shell. A command hands its ``Progress`` down: ``plans.execute`` tells it of each run
(``plans.PlanHooks``), a live backend of the run's phases and the traffic runner's live figures
(``backends.RunHooks``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllm_lab import outdir
from vllm_lab.inputs import InputError, read_text
from vllm_lab.run_summary import RunSummary
from vllm_lab.store import RunStatus

STATUS_FILE = "status.json"    # under OUT/.work: what the lab is doing now
TIMINGS_FILE = "timings.json"  # under OUT/.work: start and run times measured on this host
# Until this host has measured any: seconds per server start and per run beyond the window.
DEFAULT_START_S = {"twin": 15.0, "vllm": 90.0, "predict": 0.0}
DEFAULT_RUN_EXTRA_S = {"twin": 8.0, "vllm": 12.0, "predict": 1.0}
PLAIN_FIGURES_EVERY_S = 10.0   # plain mode: one line of live figures this often, not a flood


def fancy(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that wants escape codes (not a pipe, CI, dumb or NO_COLOR)."""
    env = os.environ
    if env.get("CI") or env.get("NO_COLOR") is not None or env.get("TERM", "") in ("dumb", ""):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def point_label(values: dict[str, Any]) -> str:
    """A point as a person writes it: ``max-num-seqs=8`` (``defaults`` when it varies nothing)."""
    if not values:
        return "defaults"

    def text(v: Any) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, float):
            return f"{v:g}"
        if isinstance(v, (dict, list)):
            return json.dumps(v, default=str)
        return str(v)
    return ", ".join(f"{k}={text(v)}" for k, v in values.items())


def duration(seconds: float | None) -> str:
    """Seconds as ``42 s``, ``3:05`` or ``1:02:03``."""
    if seconds is None:
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def outcome(status: str, summary: Mapping[str, Any], error: str = "") -> str:
    """A run's result in one line: its figures, or its status and the cause's first line."""
    if status != RunStatus.OK:
        cause = next((ln.strip() for ln in (error or "").splitlines() if ln.strip()), "")
        if cause.startswith(f"{status}:"):  # a start failure's cause already leads with it
            return cause[:170]
        return f"{status}: {cause[:160]}" if cause else status
    s = RunSummary.of(summary)
    return (f"{s.output_throughput or 0:.0f} tok/s, goodput {s.goodput or 0:.2f} req/s, "
            f"TTFT p50 {(s.ttft_p50 or 0) * 1000:.0f} ms, "
            f"TPOT p50 {(s.tpot_p50 or 0) * 1000:.1f} ms")


@dataclass
class _InFlight:
    """The point a host is on."""

    label: str
    index: int           # point i (1-based) of the plan's distinct points
    repeat: int          # run j (1-based) of k
    repeats: int
    since: float
    phase: str = "queued"
    phase_since: float = 0.0
    expected_s: float | None = None
    host: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    last_plain: float = 0.0


class Progress:
    """The progress of one experiment; a no-op sink when ``stream`` is None."""

    def __init__(self, step: str, experiment: str, backend: str, out: Path | None = None,
                 stream: TextIO | None = sys.stdout, window_s: float | None = None,
                 plain: bool | None = None, noun: str = "point"):
        self.step, self.experiment, self.backend, self.noun = step, experiment, backend, noun
        self.stream = stream
        self.out = Path(out) if out is not None else None
        self.work = Path(out) / outdir.WORK if out is not None else None
        self.plain = (not fancy(stream)) if plain is None and stream is not None else bool(plain)
        self.window_s = window_s
        self.started = time.time()
        self.lock = threading.RLock()
        self.total_runs = 0          # runs this command takes
        self.done_runs = 0
        self.points: list[str] = []  # distinct point labels in plan order
        self.repeats: dict[str, int] = {}
        self.groups_left = 0         # server starts still to come (live backends)
        self.hosts = 1
        # Keyed by thread: each host works through its share in its own thread, and a backend's
        # phases and the runner's figures are reported from the thread that runs the point.
        self.flight: dict[int, _InFlight] = {}
        self.start_times: list[float] = []
        self.run_times: list[float] = []
        self.results: list[tuple[str, str]] = []
        self.web_url = ""
        self._live = None
        self._last_beat = 0.0
        self._last_done = self.started
        self._learned = self._read_timings()
        self.unfolding = False  # expect() was called: begin() only adds to the plan
        self.part = ""  # the part of an unfolding plan in flight (autotune's candidate): named in labels
        self.stage = "preparing"  # provisioning, checking the plan: no run yet
        self._beat(force=True)

    # -- the plan ----------------------------------------------------------------------------
    def begin(self, points: Sequence[Any], todo: Sequence[Any], groups: int, hosts: int = 1) -> None:
        """The plan's points (for i/N and j/k) and what this command will take of them. After
        ``expect`` (a plan that unfolds in parts: tune's trials, autotune's levels) each part only
        adds its points and server starts to what was expected."""
        with self.lock:
            if self.unfolding:
                for p in points:
                    label = self._label(p.values)
                    if label not in self.repeats:
                        self.points.append(label)
                        self.repeats[label] = 0
                    self.repeats[label] += 1
                self.groups_left += groups if self.backend != "predict" else 0
                self.stage = "running"
                return
            for p in points:
                label = self._label(p.values)
                if label not in self.repeats:
                    self.points.append(label)
                self.repeats[label] = self.repeats.get(label, 0) + 1
            self.total_runs = len(todo)
            self.groups_left = groups if self.backend != "predict" else 0
            self.hosts = max(1, hosts)
            self.stage = "running"
            self._last_done = time.time()
            skipped = len(points) - len(todo)
            head = (f"{self.step}: experiment {self.experiment}, {len(self.points)} point(s), "
                    f"{len(points)} run(s), backend {self.backend}")
            if skipped:
                head += f"; {skipped} run(s) already recorded, {len(todo)} to take"
            self._line(head, stamp=False)
            if not self.plain and self.stream is not None:
                self._open_live()
            self._beat(force=True)

    def _label(self, values: dict[str, Any]) -> str:
        label = point_label(values)
        return f"{self.part} · {label}" if self.part else label

    def expect(self, total: int) -> None:
        """A plan that unfolds as it goes (tune's trials, autotune's levels): only its size is known."""
        with self.lock:
            self.unfolding = True
            self.total_runs = total
            self._last_done = time.time()
            if not self.plain and self.stream is not None:
                self._open_live()
            self._beat(force=True)

    def point_started(self, values: dict[str, Any], repeat: int, host: str | None = None) -> None:
        """A run begins on ``host``."""
        label = self._label(values)
        with self.lock:
            if label not in self.repeats:  # a trial: numbered as it comes
                self.points.append(label)
                self.repeats[label] = 1
            now = time.time()
            self.flight[threading.get_ident()] = _InFlight(
                label, self.points.index(label) + 1, repeat + 1, self.repeats[label], now, "running",
                now, host=host or "")
            self._beat(force=True)

    def phase(self, name: str, **info: Any) -> None:
        """The run in flight enters a phase: ``starting`` a server, ``measuring`` the window."""
        with self.lock:
            f = self.flight.get(threading.get_ident())
            if f is None:
                self.point_started({"trial": self.done_runs + 1} if self.noun == "trial" else {}, 0)
                f = self.flight[threading.get_ident()]
            now = time.time()
            if f.phase == "starting" and name != "starting":
                self.start_times.append(now - f.phase_since)
                self.groups_left = max(0, self.groups_left - 1)
            f.phase, f.phase_since, f.figures, f.last_plain = name, now, {}, now
            if name == "starting":
                f.expected_s = self._start_s()
                self._say(f, f"server starting (expected ~{duration(f.expected_s)})")
            elif name == "measuring":
                f.expected_s = info.get("window_s") or self.window_s
                self._say(f, "measuring" + (f" (window {duration(f.expected_s)})" if f.expected_s else ""))
            else:
                self._say(f, name)
            self._beat(force=True)

    def figures(self, **figures: Any) -> None:
        """Live figures of the run in flight (requests, tok_s, errors), or its web UI's ``web_url``."""
        with self.lock:
            f = self.flight.get(threading.get_ident())
            url = figures.pop("web_url", None)
            if url:
                self.web_url = url
                if self.plain:  # a terminal shows it in the live view
                    self._line(f"Locust web UI for the run in flight: {url}")
            if f is None or not figures:
                return
            f.figures = figures
            now = time.time()
            if self.plain and now - f.last_plain >= PLAIN_FIGURES_EVERY_S:
                f.last_plain = now
                self._say(f, f"measuring {duration(now - f.phase_since)}"
                          + (f" (window {duration(f.expected_s)})" if f.expected_s else "")
                          + f": {self._figures_text(f.figures)}")
            self._beat()

    def point_done(self, values: dict[str, Any], repeat: int, status: str, summary: dict[str, Any],
                   error: str = "", host: str | None = None) -> None:
        """A run ended: one line with its figures or its cause."""
        with self.lock:
            f = self.flight.pop(threading.get_ident(), None)
            now = time.time()
            if f is None:  # a run nobody announced (a predicted trial): it took since the last one
                label = self._label(values)
                f = _InFlight(label, (self.points.index(label) + 1) if label in self.points else 0,
                              repeat + 1, self.repeats.get(label, 1), self._last_done,
                              "running", self._last_done)
            if self.noun == "trial":  # a trial's values are known once it is done
                f.label = point_label({k: v for k, v in values.items() if k != "trial"})
                f.index = self.done_runs + 1
            if f.phase == "measuring" or (f.phase == "running" and self.backend == "predict"):
                self.run_times.append(now - f.phase_since)
            self.done_runs += 1
            self._last_done = now
            self.web_url = ""  # that run's Locust has quit
            text = outcome(status, summary, error)
            self.results.append((self._name(f), text))
            eta = self.eta()
            self._line(f"{self._name(f)}: {text}" + (f" · ETA {duration(eta)}" if eta else ""),
                       stamp=True, done=True)
            self._learn()
            self._beat(force=True)

    def finish(self, state: str = "finished") -> None:
        """The command ended (``finished`` or ``interrupted``): close the live view, beat once more."""
        with self.lock:
            if self._live is not None:
                self._live.stop()
                self._live = None
            self.flight.clear()
            self._beat(force=True, state=state)

    # -- estimates ---------------------------------------------------------------------------
    def _start_s(self) -> float:
        if self.start_times:
            return sum(self.start_times) / len(self.start_times)
        return self._learned.get("start_s", DEFAULT_START_S.get(self.backend, 30.0))

    def _run_s(self) -> float:
        if self.run_times:
            return sum(self.run_times) / len(self.run_times)
        if "run_s" in self._learned:
            return self._learned["run_s"]
        return (self.window_s or 0.0) + DEFAULT_RUN_EXTRA_S.get(self.backend, 10.0)

    def eta(self) -> float | None:
        """Seconds left: the starts and runs still to come at this host's measured pace."""
        left = self.total_runs - self.done_runs
        if left <= 0:
            return None
        now = time.time()
        total = self.groups_left * self._start_s() + left * self._run_s()
        for f in self.flight.values():  # what the runs in flight have already spent
            spent = now - f.phase_since
            total -= min(spent, self._start_s() if f.phase == "starting" else self._run_s())
        return max(0.0, total / self.hosts)

    def _read_timings(self) -> dict[str, float]:
        if self.work is None:
            return {}
        try:
            timings = json.loads(read_text(self.work / TIMINGS_FILE, what="timings file"))
            return {k: float(v) for k, v in dict(timings.get(self.backend, {})).items()
                    if math.isfinite(float(v)) and float(v) >= 0}
        except (ValueError, TypeError, AttributeError):  # InputError too: a pace not read costs an estimate
            return {}

    def _learn(self) -> None:
        """Keep this host's pace for the next command's first estimate."""
        if self.work is None or not (self.start_times or self.run_times):
            return
        path = self.work / TIMINGS_FILE
        try:
            known = json.loads(read_text(path, what="timings file"))
        except ValueError:  # InputError too: absent, a FIFO, too big
            known = {}
        if not isinstance(known, dict):
            known = {}
        mine = dict(self._learned)
        if self.start_times:
            mine["start_s"] = self._start_s()
        if self.run_times:
            mine["run_s"] = self._run_s()
        known[self.backend] = mine
        with contextlib.suppress(OSError, outdir.OutsideOut):  # a pace not kept costs an estimate
            _write_atomic(self.out, path, known)

    # -- output ------------------------------------------------------------------------------
    def _name(self, f: _InFlight) -> str:
        where = f"{self.noun} {f.index}/{len(self.points)}" if self.noun == "point" else \
            f"{self.noun} {f.index}/{self.total_runs}"
        runs = f" · run {f.repeat}/{f.repeats}" if f.repeats > 1 else ""
        label = "" if f.label.startswith("trial=") else f" {f.label}"
        return f"{where}{label}{runs}"

    @staticmethod
    def _figures_text(fig: dict[str, Any]) -> str:
        parts = []
        if "requests" in fig:
            parts.append(f"{fig['requests']} requests")
        if fig.get("tok_s") is not None:
            parts.append(f"{fig['tok_s']:.0f} tok/s")
        if "errors" in fig:
            parts.append(f"{fig['errors']} errors")
        return ", ".join(parts) or "no figures yet"

    def _say(self, f: _InFlight, what: str) -> None:
        if self.plain:
            self._line(f"{self._name(f)}: {what}")

    def _line(self, text: str, stamp: bool = True, done: bool = False) -> None:
        if self.stream is None:
            return
        if self._live is not None:
            self._live.console.print(("  " if done else "") + text, highlight=False, markup=False)
            return
        if not self.plain and not done and stamp:
            return
        prefix = time.strftime("%H:%M:%S ") if stamp and self.plain else ("  " if done else "")
        print(prefix + text, file=self.stream, flush=True)

    def _open_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        if self._live is None:
            console = Console(file=self.stream, highlight=False)
            self._live = Live(get_renderable=self._render, console=console, refresh_per_second=4,
                              transient=True)
            self._live.start()

    def _render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self.lock:
            now = time.time()
            head = Table.grid(padding=(0, 1))
            head.add_row(
                Text(f"{self.step} {self.experiment}", style="bold"),
                ProgressBar(total=max(1, self.total_runs), completed=self.done_runs, width=30),
                Text(f"{self.done_runs}/{self.total_runs} runs · elapsed {duration(now - self.started)}"
                     f" · ETA {duration(self.eta()) if self.total_runs > self.done_runs else '-'}"))
            lines: list[Any] = [head]
            for f in self.flight.values():
                spent = now - f.phase_since
                if f.phase == "measuring":
                    state = (f"measuring {duration(spent)}"
                             + (f" (window {duration(f.expected_s)})" if f.expected_s else "")
                             + f" · {self._figures_text(f.figures)}")
                else:
                    state = f"{f.phase} {duration(spent)}" + (
                        f" of ~{duration(f.expected_s)}" if f.expected_s else "")
                lines.append(Text(f"  {self._name(f)}: {state}", style="cyan"))
            if self.web_url:
                lines.append(Text(f"  Locust web UI: {self.web_url}"))
            return Group(*lines)

    def _beat(self, force: bool = False, state: str = "running") -> None:
        """Write the heartbeat file (at most every 2 s unless forced)."""
        now = time.time()
        if self.work is None or (not force and now - self._last_beat < 2.0):
            return
        self._last_beat = now
        body = {
            "pid": os.getpid(), "host": socket.gethostname(), "state": state, "step": self.step,
            "experiment": self.experiment, "backend": self.backend, "started": self.started,
            "updated": now, "runs_done": self.done_runs, "runs_total": self.total_runs,
            "points_total": len(self.points), "eta_s": self.eta(), "web_url": self.web_url,
            "stage": getattr(self, "stage", "running"),
            "in_flight": [{"host": f.host, "point": self._name(f), "phase": f.phase,
                           "phase_since": f.phase_since, "expected_s": f.expected_s,
                           "figures": f.figures} for f in self.flight.values()],
            "last": self.results[-1][0] + ": " + self.results[-1][1] if self.results else "",
        }
        with contextlib.suppress(OSError, outdir.OutsideOut):  # a full disk must not end the run
            _write_atomic(self.out, self.work / STATUS_FILE, body)


def _write_atomic(out: Path, path: Path, body: dict) -> None:
    """Write ``path`` (inside OUT, checked) whole or not at all."""
    outdir.make_folder(out, path.parent)
    tmp = outdir.inside(out, path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}"))
    try:
        tmp.write_text(json.dumps(body, default=str))
        tmp.replace(outdir.inside(out, path))  # a reader never sees half a file
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def tracking(progress: Progress) -> Iterator[Progress]:
    """The block a command reports its runs in: ``progress`` is finished on the way out, as
    ``finished`` or ``interrupted`` (a heartbeat that says how the command ended)."""
    state = "interrupted"
    try:
        yield progress
        state = "finished"
    finally:
        progress.finish(state)


# -- the closing table ---------------------------------------------------------------------------

def closing_table(results, stream: TextIO = sys.stdout, plain: bool | None = None) -> None:
    """A command's closing lines (``reports.console.Results``): its table, the best row marked,
    the statistic its figures are, and its page's headline."""
    if results is None:
        return
    table, best = results.table, results.best
    cols = [str(c) for c in table.columns]
    rows = [[str(v) for v in r] for r in table.itertuples(index=False)]
    marked = [i for i, r in enumerate(rows) if best is not None and r[0] == best]
    if (not fancy(stream)) if plain is None else plain:
        if cols:
            shown = [[r[0] + (" (best)" if i in marked else ""), *r[1:]] for i, r in enumerate(rows)]
            widths = [max(len(c), *(len(r[j]) for r in shown)) for j, c in enumerate(cols)]
            print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(), file=stream)
            for r in shown:
                print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip(), file=stream)
        if best is not None:
            print(f"best: {best}", file=stream)  # a line a script can grep for
    elif cols:
        from rich.console import Console
        from rich.table import Table

        out = Table(title="results", title_justify="left")
        for j, c in enumerate(cols):
            out.add_column(c, justify="left" if j == 0 or c in ("status", "verdict") else "right")
        for i, r in enumerate(rows):
            out.add_row(*r, style="bold green" if i in marked else None)
        Console(file=stream, highlight=False).print(out)
    if results.statistic and cols:
        print(f"figures: {results.statistic}", file=stream)
    print(results.headline, file=stream, flush=True)


# -- make status ---------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True


def describe_status(out: Path, newest: dict[str, Any] | None = None, now: float | None = None) -> str:
    """What the lab under ``out`` is doing now (or did last), from its heartbeat file and the store's
    newest experiment (``newest``: id, step, runs by status)."""
    now = time.time() if now is None else now
    path = Path(out) / ".work" / STATUS_FILE
    beat = None
    if os.path.lexists(path):
        try:
            beat = json.loads(read_text(path, what="status file"))
        except InputError as e:
            raise InputError(f"{e}; delete it and the next lab command under {out} writes it "
                             f"anew") from None
        except ValueError:
            beat = None
        if not isinstance(beat, dict):
            raise InputError(f"{path}: not the JSON record the lab writes (damaged or cut short); "
                             f"delete it and the next lab command under {out} writes it anew")
    try:
        lines = _status_lines(out, path, beat, now)
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError, OSError):
        raise InputError(f"{path}: a field is not what the lab writes (damaged or edited); delete "
                         f"it and the next lab command under {out} writes it anew") from None
    if newest:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(newest.get("statuses", {}).items())) or "no runs"
        lines.append(f"store: newest experiment {newest['id']} ({newest['step']}): {counts}")
    return "\n".join(lines)


def _status_lines(out: Path, path: Path, beat: dict | None, now: float) -> list[str]:
    lines = []
    if beat is None:
        lines.append(f"not running: no lab command has reported under {out} ({path} is absent)")
    else:
        here = beat.get("host") == socket.gethostname()
        running = beat.get("state") == "running" and (not here or _alive(int(beat.get("pid", 0))))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(beat.get("started", 0)))
        what = (f"{beat.get('step')} experiment {beat.get('experiment')} (backend {beat.get('backend')}, "
                f"pid {beat.get('pid')} on {beat.get('host')})")
        progress = f"{beat.get('runs_done', 0)}/{beat.get('runs_total', 0)} runs"
        if running:
            lines.append(f"running: {what} since {since} ({duration(now - beat.get('started', now))}); "
                         f"{progress}" + (f", ETA ~{duration(beat['eta_s'])}" if beat.get("eta_s") else "")
                         + ("" if here else " (another host: its pid is not checked here)"))
            for f in beat.get("in_flight", []):
                phase_since = time.strftime("%H:%M:%S", time.localtime(f.get("phase_since", now)))
                figs = Progress._figures_text(f.get("figures") or {}) if f.get("figures") else ""
                lines.append(f"  {f['point']}: {f['phase']} since {phase_since} "
                             f"({duration(now - f.get('phase_since', now))})" + (f": {figs}" if figs else ""))
            if beat.get("stage") == "preparing":
                lines.append("  preparing: provisioning the hosts, checking the plan (no run yet)")
            if beat.get("web_url"):
                lines.append(f"  Locust web UI: {beat['web_url']}")
        else:
            seen = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(beat.get("updated", 0)))
            how = {"finished": "finished", "interrupted": "interrupted"}.get(
                beat.get("state"), "stopped without finishing (its process is gone)")
            lines.append(f"not running; last seen {seen} ({duration(now - beat.get('updated', now))} ago): "
                         f"{what}, {how} after {progress}")
        if beat.get("last"):
            lines.append(f"  last run: {beat['last']}")
    return lines
