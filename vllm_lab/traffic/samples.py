"""Raw per-request samples: their columns, per-worker JSONL files and the merge into one DataFrame.

Percentiles are always computed from the pooled raw samples of all workers, never by averaging
per-worker percentiles (which is wrong for any tail).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

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
    "chunks": "Int64",           # content chunks received
    "status": "string",          # ok | error
    "http_status": "Int64",
    "error": "string",           # "" | http_error | timeout | broken_stream | empty_output | overlong_stream
    "error_detail": "string",
}

ERROR_CLASSES = ("http_error", "timeout", "broken_stream", "empty_output", "overlong_stream")


def empty() -> pd.DataFrame:
    """Return an empty samples DataFrame with the right columns and dtypes."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()})


def read_worker_file(path: Path) -> pd.DataFrame:
    """Read one worker's JSONL sample file, skipping a torn last line from a killed worker."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return _typed(pd.DataFrame(rows)) if rows else empty()


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    for c, t in COLUMNS.items():
        if c not in df:
            df[c] = pd.Series([None] * len(df), dtype=t if t != "object" else "object")
        elif t != "object":
            df[c] = df[c].astype(t)
    return df[list(COLUMNS)]


def merge(paths: list[Path]) -> pd.DataFrame:
    """Concatenate per-worker sample files into one DataFrame sorted by start time."""
    frames = [read_worker_file(p) for p in paths if Path(p).stat().st_size > 0]
    frames = [f for f in frames if len(f)]
    if not frames:
        return empty()
    df = pd.concat(frames, ignore_index=True)
    return df.sort_values("start_ts", kind="stable").reset_index(drop=True)


def merge_dir(samples_dir: Path) -> pd.DataFrame:
    """Merge every `*.jsonl` sample file under a folder."""
    return merge(sorted(Path(samples_dir).glob("*.jsonl")))


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
