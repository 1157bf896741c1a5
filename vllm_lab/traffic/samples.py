"""Raw per-request samples: their columns, per-worker JSONL files and the merge into one DataFrame.

Percentiles are always computed from the pooled raw samples of all workers, never by averaging
per-worker percentiles (which is wrong for any tail). What Locust leaves in a run's folder (sample
files, each worker's summary, the stop reason) is read like every file the lab reads back: a
regular file of a bounded size, opened without blocking (`inputs.read_bytes`), through no link;
anything else is one sentence (InputError), never a hang or a traceback.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_lab.inputs import DATA_BYTES, InputError, read_bytes

# name -> pandas dtype; times are seconds, timestamps are Unix seconds (wall clock anchored to
# each worker's perf_counter, so differences within a worker have perf_counter resolution).
COLUMNS: dict[str, str] = {
    "request_id": "string",      # "<worker>-<global index>-<turn>"
    "index": "Int64",            # global request index (the workload's sequence position)
    "turn": "Int64",
    "worker": "string",
    "user": "Int64",
    "api": "string",
    "scheduled_ts": "float64",   # when the arrival process (or think time) wanted it sent
    "start_ts": "float64",       # when it was sent
    "send_lag_s": "float64",     # start - scheduled: client lag plus any in-flight-cap wait
    "sched_lag_s": "float64",    # the client's own lateness only (the overload signal)
    "ttft_s": "float64",         # to the first non-empty content
    "e2e_s": "float64",          # to the end of the stream
    "tpot_s": "float64",         # (e2e - ttft) / (output_tokens - 1)
    "itl_s": "object",           # list of gaps between content chunks after the first
    "prompt_tokens": "Int64",    # from usage (the server's count is the truth)
    "output_tokens": "Int64",
    "target_prompt_tokens": "Int64",
    "target_output_tokens": "Int64",
    "priority": "Int64",         # the priority it was sent with (0: none; workload.priorities)
    "chunks": "Int64",           # content chunks received
    "status": "string",          # ok | error
    "http_status": "Int64",
    "error": "string",           # "" | http_error | timeout | broken_stream | empty_output | overlong_stream
    "error_detail": "string",
}

# What a live read takes of a growing samples file at most (the rest at the next read).
LIVE_CHUNK_BYTES = 64 << 20
# A worker's summary and the stop reason are a few hundred bytes: a megabyte is no record of Locust's.
RECORD_BYTES = 1 << 20

ERROR_CLASSES = ("http_error", "timeout", "broken_stream", "empty_output", "overlong_stream")


def empty() -> pd.DataFrame:
    """Return an empty samples DataFrame with the right columns and dtypes."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()})


def read_worker_file(path: Path) -> pd.DataFrame:
    """Read one worker's JSONL sample file, skipping a torn last line from a killed worker and any
    line that is no sample; InputError (one sentence) for a file that is no regular file, is
    bigger than DATA_BYTES, or holds a value a column cannot take."""
    rows = []
    for line in io.BytesIO(read_bytes(path, DATA_BYTES, "samples file")):  # no second copy
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # torn, empty, or nothing a worker writes
            continue
        if isinstance(row, dict):
            rows.append(row)
    return _typed(pd.DataFrame(rows), path) if rows else empty()


def _typed(df: pd.DataFrame, path: Path | str = "samples") -> pd.DataFrame:
    for c, t in COLUMNS.items():
        if c not in df:
            df[c] = pd.Series([None] * len(df), dtype=t if t != "object" else "object")
            continue
        try:
            if t != "object":
                df[c] = df[c].astype(t)
            elif not df[c].map(lambda x: isinstance(x, list) or _missing(x)).all():
                raise TypeError("not a list")
            else:  # a row without the key reads NaN: no gaps, as None says
                df[c] = df[c].map(lambda x: x if isinstance(x, list) else None)
        except (ValueError, TypeError, OverflowError):
            kind = {"Int64": "a whole number", "float64": "a number", "object": "a list of seconds"}
            raise InputError(f"{path}: column {c!r} holds a value that is not {kind.get(t, t)}: "
                             f"not a samples file the load generator wrote") from None
    return df[list(COLUMNS)]


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def merge(paths: list[Path]) -> pd.DataFrame:
    """Concatenate per-worker sample files into one DataFrame sorted by start time."""
    frames = [read_worker_file(p) for p in paths]
    frames = [f for f in frames if len(f)]
    if not frames:
        return empty()
    df = pd.concat(frames, ignore_index=True)
    return df.sort_values("start_ts", kind="stable").reset_index(drop=True)


def merge_dir(samples_dir: Path) -> pd.DataFrame:
    """Merge every `*.jsonl` sample file under a folder."""
    return merge(sorted(Path(samples_dir).glob("*.jsonl")))


def read_run_samples(samples_dir: Path) -> pd.DataFrame:
    """A run's samples (``merge_dir``), once none of its sample files is a symbolic link."""
    paths = sorted(Path(samples_dir).glob("*.jsonl"))
    for path in paths:
        if path.is_symlink():
            raise InputError(f"{path}: a symbolic link among the run's samples; the lab follows "
                             f"no link in OUT")
    return merge(paths)


def read_record(path: Path, what: str) -> dict:
    """The JSON object Locust wrote at ``path``, read bounded and without blocking; InputError
    naming the file and what is wrong with it (a link, a FIFO, a huge or torn file)."""
    if path.is_symlink():
        raise InputError(f"{path}: a symbolic link; the {what} is a file Locust writes, and the "
                         f"lab follows no link in OUT")
    data = read_bytes(path, RECORD_BYTES, what)
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        raise InputError(f"{path}: not the JSON object of a {what} (a torn or foreign file)")
    return obj


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def worker_summaries(samples_dir: Path) -> list[dict]:
    """Each worker's summary (its event-loop lag and CPU). One that cannot be read is left out, as
    a killed worker's missing one is, with a line on stderr: that worker's health is unknown."""
    out = []
    for path in sorted(Path(samples_dir).glob("*.summary.json")):
        try:
            w = read_record(path, "worker summary")
            lag = w.get("loop_lag")
            if not (isinstance(lag, dict) and _number(lag.get("p99"))
                    and _number(w.get("cpu_fraction"))):
                raise InputError(f"{path}: no event-loop lag p99 and CPU fraction (numbers >= 0) "
                                 f"in the worker summary")
        except InputError as e:
            print(f"traffic: {e}; that worker's event-loop lag and CPU are left out of the "
                  f"client's health", file=sys.stderr)
            continue
        out.append(w)
    return out


def stop_reason(path: Path) -> str:
    """Why Locust ended the run, from its file at ``path`` ("killed": it wrote none; "unknown",
    with a line on stderr: the file cannot be read)."""
    if not path.exists() and not path.is_symlink():
        return "killed"
    try:
        reason = read_record(path, "stop reason file").get("reason")
        if not isinstance(reason, str) or not reason.isidentifier():
            raise InputError(f"{path}: its reason is no word such as 'duration'")
    except InputError as e:
        print(f"traffic: {e}; the run's stop reason is unknown", file=sys.stderr)
        return "unknown"
    return reason


class LiveFigures:
    """Requests done, output tok/s and errors so far, read from the sample files local Locust
    processes flush every second (remote workers' files arrive only after the run)."""

    WINDOW_S = 10.0  # tok/s over the last this-many seconds: the current rate, not the average

    def __init__(self, samples_dir: Path):
        self.samples_dir = samples_dir
        self.offsets: dict[Path, int] = {}
        self.requests = self.errors = self.tokens = 0
        self.history: list[tuple[float, int]] = [(time.monotonic(), 0)]

    def read(self) -> dict:
        """Take in what the files gained since the last read; the figures so far."""
        for path in sorted(self.samples_dir.glob("*.jsonl")):
            try:
                chunk = _read_new(path, self.offsets.get(path, 0), LIVE_CHUNK_BYTES)
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
            if not end and len(chunk) == LIVE_CHUNK_BYTES:
                end = len(chunk)  # no sample is this long: passed over, not read again
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in chunk[:end].splitlines():
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if not isinstance(row, dict):
                    continue  # no sample: a live count is no place to say so
                tokens = row.get("output_tokens")
                self.requests += 1
                self.errors += row.get("status") != "ok"
                self.tokens += tokens if isinstance(tokens, int) and tokens > 0 else 0
        now = time.monotonic()
        self.history.append((now, self.tokens))
        while len(self.history) > 2 and now - self.history[1][0] >= self.WINDOW_S:
            self.history.pop(0)
        t0, k0 = self.history[0]
        rate = (self.tokens - k0) / (now - t0) if now > t0 else None
        return {"requests": self.requests, "tok_s": rate, "errors": self.errors}


def _read_new(path: Path, offset: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of the regular file ``path`` from ``offset``; nothing from a link, a
    FIFO or a device (opened without following or blocking, never read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.pread(fd, limit, offset) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def summarize(df: pd.DataFrame) -> dict[str, float]:
    """Pooled percentiles of TTFT, TPOT, ITL and E2E over successful requests, plus error counts."""
    ok = df[df["status"] == "ok"]
    out: dict[str, float] = {"requests": float(len(df)), "ok": float(len(ok))}
    for cls in ERROR_CLASSES:
        out[f"errors_{cls}"] = float((df["error"] == cls).sum())
    for col in ("ttft_s", "tpot_s", "e2e_s"):
        v = ok[col].dropna().to_numpy(dtype=float)
        for p in (50, 90, 99):
            out[f"{col[:-2]}_p{p}_s"] = float(np.percentile(v, p)) if v.size else float("nan")
    itl = np.concatenate([np.asarray(x, float) for x in ok["itl_s"] if x is not None and len(x)]
                         or [np.array([])])
    for p in (50, 99):
        out[f"itl_p{p}_s"] = float(np.percentile(itl, p)) if itl.size else float("nan")
    if len(ok):
        span = (ok["start_ts"] + ok["e2e_s"]).max() - ok["start_ts"].min()
        out["output_tokens_per_s"] = float(ok["output_tokens"].sum() / span) if span > 0 else 0.0
    return out
