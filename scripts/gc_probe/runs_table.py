#!/usr/bin/env python3
"""A Markdown table of a reference folder's runs beside what their API server's process did.

Reads a folder that the parity script's ``export`` wrote (runs.jsonl; warmups.jsonl, if there is
one, holds the discarded run after each server start), each run with a ``history`` (its server
start and its order since it), and the GC probe's lines (``sitecustomize.py`` here) joined into
``gc.csv.gz`` and ``threads.csv.gz`` with a ``start`` column naming the server start:

    python scripts/gc_probe/runs_table.py vllm_lab/twin/reference/h200-vllm0.26/traffic-2026-12-05

Per run: its server start and order since it (0 the discarded warm-up), TTFT and TPOT p50, output
tokens a second (the bench's definition), the time the API server adds before the engine has a
request (vLLM's TTFT less its queue and prefill, means) and the output lag, the requests running
in the engine (the median of vLLM's gauge in ``scrapes.csv.gz``, if there is one), the API
server's process CPU and its busiest thread's (cores, while the run was under way: between 20%
and 80% of that thread's CPU seconds in the run), the process's RSS at the run's end, and per
collector generation the collections, their seconds and the longest pause during the run; then
the state it settled in (engine: under 0.6 s added; admission: over 0.9 s; between).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_lab.twin.reference import loop_cpu

ENGINE_S, ADMISSION_S = 0.6, 0.9   # the time the API server adds, between the two states


def state(api_s: float | None) -> str:
    """The state a 256-user run settled in, by the time its API server added to each request."""
    if api_s is None or np.isnan(api_s):
        return "?"
    return "engine" if api_s < ENGINE_S else "admission" if api_s > ADMISSION_S else "between"


def _window(run: dict) -> tuple[float, float, float, float]:
    """The run's span (its call's start and end) and where its busiest thread was under way."""
    t0, t1 = run["started"], run["started"] + run["wall_s"]
    series = np.asarray((run.get("cpu") or {}).get("server_api_busiest_thread_series") or [],
                        dtype=float)
    if len(series) < 3 or series[-1, 1] <= 0:
        return t0, t1, t0, t1
    i, j = np.searchsorted(series[:, 1], [0.2 * series[-1, 1], 0.8 * series[-1, 1]])
    j = min(j, len(series) - 1)
    return t0, t1, t0 + series[i, 0], t0 + series[j, 0]


def _at(df: pd.DataFrame, col: str, t: float) -> float:
    return float(np.interp(t, df.ts.to_numpy(), df[col].to_numpy(dtype=float)))


def row(run: dict, gc: pd.DataFrame, threads: pd.DataFrame, scrapes: pd.DataFrame) -> dict:
    """One run's line of the table."""
    f, s, h = run["figures"], run.get("server") or {}, run.get("history") or {}
    t0, t1, u0, u1 = _window(run)
    out = {"start": h.get("start", ""), "order": h.get("order", ""),
           "ttft_p50_ms": f["ttft_p50"] * 1e3, "tpot_p50_ms": f["tpot_p50"] * 1e3,
           "output_tok_s": f.get("bench_def_output_throughput") or f["output_throughput"]}
    api = None
    if {"server_ttft_mean", "server_queue_mean", "server_prefill_mean"} <= set(s):
        api = s["server_ttft_mean"] - s["server_queue_mean"] - s["server_prefill_mean"]
    out["api_added_ms"] = api * 1e3 if api is not None else np.nan
    out["output_lag_ms"] = s.get("server_frontend_lag_mean", np.nan) * 1e3
    g = gc[(gc.ts >= t0 - 1.5) & (gc.ts <= t1 + 1.5)]
    if len(g) >= 2 and u1 > u0:
        out["api_cpu"] = (_at(g, "cpu_s", u1) - _at(g, "cpu_s", u0)) / (u1 - u0)
    out["loop_cpu"] = loop_cpu(run.get("cpu") or {})
    if len(scrapes):
        sc = scrapes[(scrapes.tag == run["tag"]) & (scrapes.name == "vllm:num_requests_running")]
        running = sc[(sc.ts >= u0) & (sc.ts <= u1)].groupby("ts").value.sum()
        out["running"] = float(running.median()) if len(running) else np.nan
    if len(threads):
        th = threads[(threads.ts >= u0 - 1) & (threads.ts <= u1 + 1)]
        busiest = th.groupby("tid").cpu_s.agg(lambda x: x.max() - x.min())
        if len(busiest):
            out["busiest_thread"] = th[th.tid == busiest.idxmax()].name.iloc[-1]
    if len(g):
        out["rss_mb"] = g.rss_bytes.iloc[-1] / 2**20
        for gen in (0, 1, 2):
            out[f"gc{gen}_n"] = int(g[f"n{gen}"].iloc[-1] - g[f"n{gen}"].iloc[0])
            out[f"gc{gen}_s"] = float(g[f"s{gen}"].iloc[-1] - g[f"s{gen}"].iloc[0])
            longest = g[f"max{gen}"].iloc[1:]   # the first line's second is before the run
            out[f"gc{gen}_max_ms"] = float(longest.max() * 1e3) if len(longest) else 0.0
        out["gc_enabled"] = int(g.enabled.min())
    out["state"] = state(api)
    return out


def table(folder: Path) -> pd.DataFrame:
    """Every run of the folder, warm-ups included, in the order they ran."""
    runs = []
    for name in ("warmups.jsonl", "runs.jsonl"):
        if (folder / name).exists():
            runs += [json.loads(x) for x in (folder / name).read_text().splitlines() if x.strip()]
    def read(name: str) -> pd.DataFrame:
        return pd.read_csv(folder / name) if (folder / name).exists() else pd.DataFrame()

    gc, th, sc = read("gc.csv.gz"), read("threads.csv.gz"), read("scrapes.csv.gz")
    empty = pd.DataFrame({"ts": [], "cpu_s": []})
    rows = [row(r, gc if len(gc) else empty, th, sc)
            for r in sorted(runs, key=lambda r: r["started"])]
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    cols = [("start", "start", "{}"), ("order", "run since start", "{}"),
            ("ttft_p50_ms", "TTFT p50 ms", "{:,.0f}"), ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
            ("output_tok_s", "output tok/s", "{:,.0f}"),
            ("api_added_ms", "API server adds ms", "{:,.0f}"),
            ("output_lag_ms", "output lag ms", "{:,.0f}"),
            ("running", "running in the engine", "{:.0f}"),
            ("api_cpu", "API process cores", "{:.2f}"),
            ("loop_cpu", "busiest thread cores", "{:.2f}"), ("rss_mb", "RSS MiB", "{:,.0f}"),
            ("gc0_n", "GC gen0 n / s", "{}"), ("gc1_n", "gen1 n / s", "{}"),
            ("gc2_n", "gen2 n / s / max ms", "{}"), ("state", "state", "{}")]
    head = "| " + " | ".join(c[1] for c in cols) + " |\n|" + "---|" * len(cols) + "\n"
    lines = []
    for _, r in df.iterrows():
        cells = []
        for key, _, fmt in cols:
            v = r.get(key)
            if key.startswith("gc") and key.endswith("_n") and pd.notna(v):
                gen = key[2]
                cell = f"{int(v)} / {r[f'gc{gen}_s']:.3f}"
                if gen == "2":
                    cell += f" / {r['gc2_max_ms']:.0f}"
                cells.append(cell)
            elif v is None or (isinstance(v, float) and np.isnan(v)):
                cells.append("")
            else:
                cells.append(fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--csv", type=Path, help="also write every figure to this CSV")
    args = ap.parse_args()
    df = table(args.folder)
    if args.csv:
        df.to_csv(args.csv, index=False, float_format="%.6g")
    print(markdown(df), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
