"""Request traces: timestamped production requests, read from the public formats users have.

A trace is a list of `TraceRequest`s in time order: when each request came (seconds from the
trace's first), its prompt and output length, and what its prompt shares with others: Mooncake's
``hash_ids`` (each one block of `MOONCAKE_BLOCK_TOKENS` prompt tokens; requests that share hash
ids share those blocks, so the prefix cache sees what production saw) or a plain trace's
``prefix_id``. Formats (``workload.trace_format``):

- ``mooncake``: JSONL of ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``
  (kvcache-ai/Mooncake, ``FAST25-release/traces``);
- ``azure``: the Azure LLM inference trace CSV, ``TIMESTAMP,ContextTokens,GeneratedTokens``
  (Azure/AzurePublicDataset, ``AzureLLMInferenceTrace_{code,conv}.csv``);
- ``burstgpt``: BurstGPT's CSV, ``Timestamp,Model,Request tokens,Response tokens,Total
  tokens,Log Type`` (HPMLL/BurstGPT); rows whose response has no tokens (failed requests) are
  left out, and counted;
- ``jsonl``: what a user writes from their own logs, one ``{"timestamp": s, "prompt_tokens",
  "output_tokens"[, "prefix_id"[, "prefix_tokens"]]}`` a line; requests of one ``prefix_id``
  share their first ``prefix_tokens`` (default: the group's shortest prompt).

Parsing is strict: a row that cannot be read is one sentence naming the file, the line and the
field, and what the field takes. A file is read at most `MAX_BYTES` and `MAX_ROWS` rows, a
request's prompt and output at most `MAX_TOKENS` tokens each.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from vllm_lab.traffic.spec import MAX_TOKENS  # one bound, said where lengths are

FORMATS = ("mooncake", "azure", "burstgpt", "jsonl")
# Mooncake's traces hash prompts in blocks of this many tokens.
MOONCAKE_BLOCK_TOKENS = 512
MAX_BYTES = 512 * 2**20
MAX_ROWS = 5_000_000
# Python reads no integer of more decimal digits (sys.get_int_max_str_digits).
MAX_INT_DIGITS = 4300


class TraceError(ValueError):
    """A trace file that cannot be read as its format: the message names file, line and field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    t_s: float                     # when it came, seconds from the trace's first request
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()   # Mooncake hash ids, one per block of its prompt
    prefix: str | None = None      # jsonl prefix_id: requests that share it share prefix_tokens
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Trace:
    """A trace's requests in time order, and what reading it left out."""

    path: str
    format: str
    requests: tuple[TraceRequest, ...]
    skipped: int = 0               # rows left out (BurstGPT's failed requests)

    def window(self, start_s: float = 0.0, duration_s: float | None = None) -> tuple[TraceRequest, ...]:
        """The requests that came in [start_s, start_s + duration_s), times from start_s."""
        end = math.inf if duration_s is None else start_s + duration_s
        return tuple(TraceRequest(r.t_s - start_s, r.prompt_tokens, r.output_tokens, r.blocks,
                                  r.prefix, r.prefix_tokens)
                     for r in self.requests if start_s <= r.t_s < end)


def _bad(path: Path, line: int, field: str, why: str) -> TraceError:
    return TraceError(f"{path}: line {line}: field {field!r}: {why}")


def _count(path: Path, line: int, field: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(path, line, field, f"expected a whole number, got {type(value).__name__}")
    try:
        n = float(value)
    except ValueError:
        raise _bad(path, line, field, f"expected a whole number, got {str(value)[:40]!r}") from None
    except OverflowError:  # an integer past a float's range
        n = math.inf
    if n > MAX_TOKENS:  # never NaN
        raise _bad(path, line, field, f"expected at most {MAX_TOKENS:,} tokens (past any model's "
                                      f"context), got {_digits(value)}")
    if not math.isfinite(n) or n != int(n) or n < minimum:
        raise _bad(path, line, field, f"expected a whole number >= {minimum}, got {str(value)[:40]}")
    return int(n)


def _digits(value) -> str:
    """A number as an error shows it: itself when short, else how many digits it has."""
    text = str(value).strip()
    return text if len(text) <= 40 else f"a number of {len(text):,} characters"


def _seconds(path: Path, line: int, field: str, value, scale: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(path, line, field, f"expected a number, got {type(value).__name__}")
    try:
        t = float(value) * scale
    except ValueError:
        raise _bad(path, line, field, f"expected a number, got {str(value)[:40]!r}") from None
    except OverflowError:
        t = math.inf
    if not math.isfinite(t) or t < 0:
        raise _bad(path, line, field, f"expected a finite time >= 0, got {_digits(value)}")
    return t


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        # O_NONBLOCK: a FIFO is refused below, never waited on for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TraceError(f"workload.path: {path}: {e.strerror or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise TraceError(f"workload.path: {path} is not a regular file")
    if info.st_size > MAX_BYTES:
        os.close(fd)
        raise TraceError(f"workload.path: {path} is {info.st_size / 2**20:.0f} MiB, more than the "
                         f"{MAX_BYTES // 2**20} MiB a trace may be: cut it to the window you replay")
    read = 0
    with open(fd, encoding="utf-8", errors="strict", newline="") as fh:
        try:
            for n, text in enumerate(fh, 1):
                if n > MAX_ROWS + 1:
                    raise TraceError(f"workload.path: {path} has more than {MAX_ROWS:,} rows")
                read += len(text)
                if read > MAX_BYTES:
                    raise TraceError(f"workload.path: {path} grew past the {MAX_BYTES // 2**20} "
                                     f"MiB a trace may be while it was read")
                yield n, text
        except UnicodeDecodeError as e:
            raise TraceError(f"workload.path: {path} is not UTF-8 text ({e.reason})") from None


def _json_rows(path: Path) -> Iterator[tuple[int, dict]]:
    for n, text in _lines(path):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}: line {n}: not JSON ({e.msg})") from None
        except ValueError:  # Python's own limit on an integer's digits
            raise TraceError(f"{path}: line {n}: a number of more than {MAX_INT_DIGITS:,} digits; "
                             f"token counts are whole numbers up to {MAX_TOKENS:,}, times "
                             f"finite numbers") from None
        except RecursionError:
            raise TraceError(f"{path}: line {n}: nested too deeply to read; a row is one JSON "
                             f"object of numbers") from None
        if not isinstance(row, dict):
            raise TraceError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
        yield n, row


def _need(path: Path, n: int, row: dict, *fields: str) -> None:
    for f in fields:
        if f not in row:
            raise _bad(path, n, f, "missing")


def _mooncake(path: Path) -> list[TraceRequest]:
    out = []
    for n, row in _json_rows(path):
        _need(path, n, row, "timestamp", "input_length", "output_length")
        ids = row.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                for h in ids):
            raise _bad(path, n, "hash_ids", "expected a list of whole numbers")
        prompt = _count(path, n, "input_length", row["input_length"])
        if ids and prompt > len(ids) * MOONCAKE_BLOCK_TOKENS:
            raise _bad(path, n, "input_length", f"{prompt} tokens need more than the "
                       f"{len(ids)} blocks of {MOONCAKE_BLOCK_TOKENS} its hash_ids name")
        out.append(TraceRequest(_seconds(path, n, "timestamp", row["timestamp"], 1e-3), prompt,
                                _count(path, n, "output_length", row["output_length"]),
                                blocks=tuple(ids)))
    return out


def _jsonl(path: Path) -> list[TraceRequest]:
    rows = []
    for n, row in _json_rows(path):
        _need(path, n, row, "timestamp", "prompt_tokens", "output_tokens")
        prefix = row.get("prefix_id")
        if prefix is not None and not isinstance(prefix, (str, int)):
            raise _bad(path, n, "prefix_id", "expected a string or a number")
        given = row.get("prefix_tokens")
        rows.append((n, TraceRequest(
            _seconds(path, n, "timestamp", row["timestamp"]),
            _count(path, n, "prompt_tokens", row["prompt_tokens"]),
            _count(path, n, "output_tokens", row["output_tokens"]),
            prefix=None if prefix is None else str(prefix),
            prefix_tokens=0 if given is None else _count(path, n, "prefix_tokens", given, 0))))
    # A group without prefix_tokens shares what all its prompts can: the shortest one.
    shortest: dict[str, int] = {}
    for _n, r in rows:
        if r.prefix is not None:
            shortest[r.prefix] = min(shortest.get(r.prefix, r.prompt_tokens), r.prompt_tokens)
    out = []
    for n, r in rows:
        if r.prefix is None:
            out.append(r)
            continue
        k = r.prefix_tokens or shortest[r.prefix]
        if k > r.prompt_tokens:
            raise _bad(path, n, "prefix_tokens", f"{k} is more than the prompt's {r.prompt_tokens}")
        out.append(TraceRequest(r.t_s, r.prompt_tokens, r.output_tokens, prefix=r.prefix,
                                prefix_tokens=k))
    return out


def _csv_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    text = "".join(t for _n, t in _lines(path))
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{path}: line 1: the header lacks {', '.join(repr(c) for c in missing)} "
                         f"(it has {', '.join(reader.fieldnames or []) or 'nothing'})")
    for row in reader:
        yield reader.line_num, row


def _azure_time(path: Path, n: int, text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than fromisoformat takes.
    head, _, frac = str(text).strip().partition(".")
    try:
        t = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        raise _bad(path, n, "TIMESTAMP", f"expected a date and time, got {str(text)[:40]!r}") from None
    if frac and not frac.isdigit():
        raise _bad(path, n, "TIMESTAMP", f"expected a date and time, got {str(text)[:40]!r}")
    return t + (float("0." + frac) if frac else 0.0)


def _azure(path: Path) -> list[TraceRequest]:
    out = []
    for n, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        out.append(TraceRequest(_azure_time(path, n, row["TIMESTAMP"]),
                                _count(path, n, "ContextTokens", row["ContextTokens"]),
                                _count(path, n, "GeneratedTokens", row["GeneratedTokens"])))
    return out


def _burstgpt(path: Path) -> tuple[list[TraceRequest], int]:
    out, skipped = [], 0
    for n, row in _csv_rows(path, ("Timestamp", "Request tokens", "Response tokens")):
        response = _count(path, n, "Response tokens", row["Response tokens"], 0)
        if response == 0:
            skipped += 1  # a failed request: nothing to replay
            continue
        out.append(TraceRequest(_seconds(path, n, "Timestamp", row["Timestamp"]),
                                _count(path, n, "Request tokens", row["Request tokens"]), response))
    return out, skipped


@lru_cache(maxsize=8)
def _read(path: str, fmt: str, _mtime: float) -> Trace:
    p = Path(path)
    skipped = 0
    if fmt == "mooncake":
        reqs = _mooncake(p)
    elif fmt == "azure":
        reqs = _azure(p)
    elif fmt == "burstgpt":
        reqs, skipped = _burstgpt(p)
    elif fmt == "jsonl":
        reqs = _jsonl(p)
    else:
        raise TraceError(f"workload.trace_format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if not reqs:
        raise TraceError(f"workload.path: {path} holds no requests")
    reqs.sort(key=lambda r: r.t_s)  # stable: logs merged from several servers come out of order
    t0 = reqs[0].t_s
    return Trace(path, fmt, tuple(TraceRequest(r.t_s - t0, r.prompt_tokens, r.output_tokens,
                                               r.blocks, r.prefix, r.prefix_tokens) for r in reqs),
                 skipped)


def load_trace(path: Path | str, fmt: str) -> Trace:
    """Read a trace file (cached while the file is unchanged); TraceError names what is wrong."""
    p = Path(path)
    try:
        mtime = p.stat().st_mtime
    except OSError as e:
        raise TraceError(f"workload.path: {p}: {e.strerror or e}") from None
    return _read(str(p), fmt, mtime)


def trace_requests(workload, load=None) -> tuple[TraceRequest, ...]:
    """The requests a run of ``workload`` (source trace) sends, in order: the trace's, within
    ``load.replay``'s window when the load replays it."""
    trace = load_trace(workload.path, workload.trace_format)
    replay = getattr(load, "replay", None)
    if replay is None:
        return trace.requests
    rows = trace.window(replay.start_s, replay.duration_s)
    if not rows:
        raise TraceError(f"load.replay: the window from {replay.start_s:g} s"
                         + (f" for {replay.duration_s:g} s" if replay.duration_s else "")
                         + f" holds no request of {workload.path}, whose requests span "
                         f"{trace.requests[-1].t_s:.0f} s")
    return rows


def replay_times(rows: tuple[TraceRequest, ...], replay) -> list[float]:
    """When each request of the window is sent, seconds from the run's start: its trace time over
    ``speed``, or rescaled so the window's mean rate is ``rate`` (its length: duration_s, else to
    its last request)."""
    times = [r.t_s for r in rows]
    if replay.rate is not None:
        length = replay.duration_s or max(times[-1], 1e-9)
        factor = (len(times) / length) / replay.rate
    else:
        factor = 1.0 / replay.speed
    return [t * factor for t in times]
