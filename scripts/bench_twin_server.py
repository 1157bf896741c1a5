"""Benchmark: can the twin's server keep its timing honest under many concurrent streams?

Starts `vllm-twin serve` (H200 profile by default) as a subprocess and drives it, on the same
machine, with N closed-loop streaming users sending the lab's ShareGPT-like workload with
ignore_eos. The client is the lab's own load generator (`--client locust`, the default:
`vllm_lab.traffic.run_load`, the Locust user that times chunks by hand) or the reference
asyncio/aiohttp client (`--client aiohttp`); both send the same request sequence (the lab's
WorkloadGenerator) and each request carries an X-Request-Id. The client-measured TTFT and TPOT are
then matched, request by request, with the twin's own ground truth (/twin/ground_truth, whose ids
are "cmpl-<X-Request-Id>") and the figures are printed with the server's event-loop lag.

    .venv/bin/python scripts/bench_twin_server.py [--client locust|aiohttp] [--concurrency 64]
        [--requests 640] [--repeats 3] [--server-cpus 0|any] [--client-cpus 1|any] [--realtime]

Each user's first request also opens its connection while every other user opens theirs (a cold
start): the verdict is on the steady state after them (--warmup), the all-requests figures are
printed next to it. The TTFT gap (client minus twin) is split into its parts on the shared
monotonic clock: client send -> server handler, the server's first write after the token was due,
and that write -> the client reading it. By default the twin and the client each get a CPU of
their own: unpinned, the scheduler often wakes the client on the server's CPU, where it waits for
the server's burst of writes to end (a TTFT tail of 1-4 ms on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from vllm_lab.traffic.spec import Load, Shape, Stop, Workload
from vllm_lab.traffic.workloads import WorkloadGenerator

TARGET = 0.05


def _workload() -> Workload:
    return Workload(source="sharegpt-like", api="completions", ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the clients: each returns rows {id, t0, first, ttft_s, tpot_s, n}, times on perf_counter ---

def run_locust(url: str, model: str, concurrency: int, total: int, seed: int,
               out_dir: Path) -> tuple[list[dict], dict]:
    """The lab's load generator: Locust (one process), closed loop, `total` requests."""
    from vllm_lab.traffic import run_load  # Locust's gevent patching stays out of plain imports

    load = Load(mode="closed", shape=Shape(kind="constant", level=concurrency),
                stop=Stop(duration_s=3600, max_requests=total), request_timeout_s=120)
    r = run_load(url, model, _workload(), load, out_dir, seed=seed, scrape_metrics=False)
    df = r.samples
    bad = df[df.status != "ok"]
    anchor = {w["worker"]: w["perf0"] - w["wall0"] for w in r.workers}
    rows = []
    for s in df[df.status == "ok"].itertuples():
        t0 = s.start_ts + anchor[s.worker]  # back onto the perf_counter clock
        rows.append({"id": f"cmpl-{s.request_id}", "t0": t0, "first": t0 + s.ttft_s,
                     "ttft_s": s.ttft_s, "tpot_s": None if np.isnan(s.tpot_s) else s.tpot_s,
                     "n": int(s.output_tokens)})
    info = {"errors": len(bad), "client_loop_lag_p99_s": r.loop_lag_p99_s,
            "client_cpu": r.cpu_fraction_max, "client_overloaded": r.client_overloaded,
            "stop_reason": r.stop_reason}
    return rows, info


async def _aiohttp_request(session, url, path, body, rid, rows):
    """Send one streaming request and time its first and last tokens by hand."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with session.post(url + path, json=body, headers={"X-Request-Id": rid}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if b'"choices":[]' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
            elif b'"text":""' not in line:
                if first is None:
                    first = now
                last = now
    rows.append({"id": f"cmpl-{rid}", "t0": t0, "first": first, "ttft_s": first - t0,
                 "tpot_s": (last - first) / (n - 1) if n > 1 else None, "n": n})


async def _aiohttp_drive(url, model, concurrency, total, seed):
    import aiohttp

    gen = WorkloadGenerator(_workload(), seed)
    todo = list(range(total))[::-1]
    rows: list[dict] = []
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def user():
            while todo:
                i = todo.pop()
                path, body = gen.body(gen.request(i), model)
                await _aiohttp_request(session, url, path, body, f"aio-{seed}-{i}", rows)
        await asyncio.gather(*(user() for _ in range(concurrency)))
    return rows


def run_aiohttp(url: str, model: str, concurrency: int, total: int, seed: int,
                out_dir: Path) -> tuple[list[dict], dict]:
    """The reference client: asyncio + aiohttp (on uvloop when installed), closed loop."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    rows = asyncio.run(_aiohttp_drive(url, model, concurrency, total, seed))
    return rows, {"errors": total - len(rows),
                  "client_cpu": (time.process_time() - cpu0) / (time.perf_counter() - t0)}


CLIENTS = {"locust": run_locust, "aiohttp": run_aiohttp}


# ---- one run: a fresh server, one client, the comparison ---------------------------------------

def _cpus(spec: str | None) -> set[int] | None:
    """A taskset-style CPU list ("0", "0-1", "0,2") as a set, or None for "any"."""
    if not spec or spec == "any":
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus |= set(range(int(lo), int(hi or lo) + 1))
    return cpus


def _start_server(args, port: int, log) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, *(["-m", "cProfile", "-o", args.cprofile] if args.cprofile else []),
         "-m", args.server_module, "serve", args.model, "--host", "127.0.0.1",
         "--port", str(port), "--twin-profile", args.profile, "--twin-startup-seconds", "0.2",
         "--disable-uvicorn-access-log", *args.serve_flag],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if cpus := _cpus(args.server_cpus):
        os.sched_setaffinity(server.pid, cpus)  # before it starts any thread: they inherit it
    return server


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values, p):
    values = [v for v in values if v is not None]
    return float(np.percentile(values, p)) if values else float("nan")


def one_run(args, seed: int, work: Path) -> dict:
    """Start a server, drive it with the chosen client, compare with its ground truth."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / f"twin-{port}.log", "w+")  # noqa: SIM115 - closed below
    server = _start_server(args, port, log)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    log.seek(0)
                    raise RuntimeError("the twin did not start:\n" + log.read()[-3000:]) from None
                time.sleep(0.1)
        load0 = os.getloadavg()[0]
        cpu0 = _cpu_s(server.pid)
        t0 = time.perf_counter()
        rows, info = CLIENTS[args.client](url, args.model, args.concurrency, args.requests, seed,
                                          work / f"client-{seed}")
        wall = time.perf_counter() - t0
        cpu1 = _cpu_s(server.pid)
        truth = json.load(urllib.request.urlopen(url + "/twin/ground_truth"))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
        log.close()
    by_id = {t["id"]: t for t in truth["requests"]}
    matched = sorted(((s, by_id[s["id"]]) for s in rows if s["id"] in by_id),
                     key=lambda p: p[0]["t0"])
    fig = {"seed": seed, "requests": len(rows), "matched": len(matched), "wall_s": wall,
           "output_tok_s": sum(s["n"] for s in rows) / wall, "load_1m_before": load0,
           "load_1m_after": os.getloadavg()[0],
           "server_cpu": (cpu1 - cpu0) / wall if cpu0 is not None and cpu1 is not None else None,
           "server_lag": truth["lag_s"], "coalesced_tokens": truth["coalesced_tokens"],
           "warmup": min(args.warmup, len(matched)), **info}
    # The first request of each user also opens its connection, all users at once: a cold
    # start, not the steady state. Both are shown; the verdict is on the steady state.
    fig["all"] = _compare(matched)
    fig.update(_compare(matched[fig["warmup"]:]))
    return fig


def _compare(matched: list[tuple[dict, dict]]) -> dict:
    """Client against twin: TTFT/TPOT percentiles, their errors and the TTFT gap's parts."""
    c_ttft = [s["ttft_s"] for s, _ in matched]
    t_ttft = [t["ttft_s"] for _, t in matched]
    gaps = [s["ttft_s"] - t["ttft_s"] for s, t in matched]
    # perf_counter is CLOCK_MONOTONIC on Linux: one clock for both processes on this host.
    fig = {
        "n": len(matched),
        "ttft_p50_client": _pct(c_ttft, 50), "ttft_p50_truth": _pct(t_ttft, 50),
        "ttft_p99_client": _pct(c_ttft, 99), "ttft_p99_truth": _pct(t_ttft, 99),
        "tpot_p50_client": _pct([s["tpot_s"] for s, _ in matched], 50),
        "tpot_p50_truth": _pct([t["tpot_s"] for _, t in matched], 50),
        "gap_p50": _pct(gaps, 50), "gap_p90": _pct(gaps, 90), "gap_p99": _pct(gaps, 99),
        "gap_mean": float(np.mean(gaps)) if gaps else float("nan"),
        "gap_send_to_handler": _pct([t["arrival_s"] - s["t0"] for s, t in matched], 50),
        "gap_first_write_late": _pct([t["first_token_late_s"] for _, t in matched], 50),
        "gap_write_to_read": _pct([s["first"] - (t["arrival_s"] + t["ttft_s"]
                                                 + t["first_token_late_s"])
                                   for s, t in matched], 50),
    }
    for k in ("ttft_p50", "ttft_p99", "tpot_p50"):
        fig[k + "_err"] = fig[k + "_client"] / fig[k + "_truth"] - 1
    return fig


def _print(f: dict, label: str) -> None:
    lag = f["server_lag"]
    a = f["all"]
    print(f"[{label}] requests={f['requests']} matched={f['matched']} errors={f['errors']} "
          f"wall={f['wall_s']:.1f}s output={f['output_tok_s']:.0f} tok/s  load1m "
          f"{f['load_1m_before']:.2f}->{f['load_1m_after']:.2f}")
    print(f"  all {a['n']} requests: TTFT p50 client {a['ttft_p50_client'] * 1e3:.2f} ms twin "
          f"{a['ttft_p50_truth'] * 1e3:.2f} ms ({100 * a['ttft_p50_err']:+.2f}%), TTFT p99 "
          f"{100 * a['ttft_p99_err']:+.2f}%, TPOT p50 {100 * a['tpot_p50_err']:+.2f}%")
    print(f"  steady state ({f['n']} requests, the first {f['warmup']} left out):")
    for k, name in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99")):
        print(f"  {name}: client {f[k + '_client'] * 1e3:8.2f} ms  twin {f[k + '_truth'] * 1e3:8.2f}"
              f" ms  diff {100 * f[k + '_err']:+6.2f}%")
    print(f"  TPOT p50: client {f['tpot_p50_client'] * 1e3:8.3f} ms  twin "
          f"{f['tpot_p50_truth'] * 1e3:8.3f} ms  diff {100 * f['tpot_p50_err']:+6.2f}%")
    print(f"  server step-release (event-loop) lag: p50 {lag['p50'] * 1e3:.2f} ms  p99 "
          f"{lag['p99'] * 1e3:.2f} ms  max {lag['max'] * 1e3:.2f} ms; coalesced tokens "
          f"{f['coalesced_tokens']}")
    extra = ""
    if "client_loop_lag_p99_s" in f:
        extra = (f"; client loop lag p99 {f['client_loop_lag_p99_s'] * 1e3:.2f} ms"
                 f"{'  CLIENT OVERLOADED' if f['client_overloaded'] else ''}")
    srv = f"{f['server_cpu']:.2f}" if f["server_cpu"] is not None else "?"
    print(f"  CPU: server {srv} core, client {f['client_cpu']:.2f} core{extra}")
    print(f"  per-request TTFT gap (client - twin): p50 {f['gap_p50'] * 1e3:.2f} ms  p90 "
          f"{f['gap_p90'] * 1e3:.2f} ms  p99 {f['gap_p99'] * 1e3:.2f} ms  mean "
          f"{f['gap_mean'] * 1e3:.2f} ms")
    print(f"  TTFT gap p50 parts: client send -> server handler "
          f"{f['gap_send_to_handler'] * 1e3:.2f} ms, server first write late "
          f"{f['gap_first_write_late'] * 1e3:.2f} ms, server write -> client read "
          f"{f['gap_write_to_read'] * 1e3:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client", choices=sorted(CLIENTS), default="locust",
                    help="locust: the lab's load generator (default); aiohttp: the reference")
    ap.add_argument("--profile", default="h200-llama-3-8b")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--warmup", type=int, help="requests (the first sent) left out of the "
                    "steady-state comparison; default: --concurrency (each user's first request, "
                    "which opens its connection)")
    ap.add_argument("--repeats", type=int, default=1, help="runs (a fresh server each); the "
                    "verdict is on the medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-flag", action="append", default=[],
                    help="extra `vllm serve` flag words, e.g. --serve-flag=--max-num-seqs=32")
    ap.add_argument("--server-module", default="vllm_lab.twin.server",
                    help="the server to start with `python -m` (to compare a variant)")
    ap.add_argument("--cprofile", help="write the server's cProfile stats to this file")
    ap.add_argument("--json", type=Path, help="write every run's figures to this file")
    mine = sorted(os.sched_getaffinity(0))
    two = len(mine) >= 2
    ap.add_argument("--server-cpus", default=str(mine[0]) if two else "any",
                    help="CPUs for the twin, taskset-style, or 'any' (default: the first CPU of "
                    "two or more, so that the server and the client do not wait for each other)")
    ap.add_argument("--client-cpus", default=str(mine[1]) if two else "any",
                    help="CPUs for the client, or 'any' (default: the second CPU)")
    ap.add_argument("--realtime", action="store_true",
                    help="run this script, the twin and the client under SCHED_FIFO (needs root "
                    "or CAP_SYS_NICE): on a machine shared with other work, what the 2 cores "
                    "would do for these processes alone")
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = args.concurrency
    if args.realtime:
        # Inherited by the twin and the Locust processes started below.
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(5))
    if cpus := _cpus(args.client_cpus):
        # This process runs the aiohttp client and starts Locust: both inherit it.
        os.sched_setaffinity(0, cpus)
    print(f"client={args.client} profile={args.profile} concurrency={args.concurrency} "
          f"requests={args.requests} cores={os.cpu_count()} "
          f"scheduling={'SCHED_FIFO 5' if args.realtime else 'normal'} "
          f"cpus server={args.server_cpus} client={args.client_cpus} "
          f"load1m={os.getloadavg()[0]:.2f}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-twin-") as tmp:
        for k in range(args.repeats):
            f = one_run(args, args.seed + k, Path(tmp))
            _print(f, f"run {k + 1}/{args.repeats}")
            runs.append(f)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    med = {k: statistics.median(r[k] for r in runs)
           for k in runs[0] if k.endswith(("_client", "_truth", "_err"))}
    if len(runs) > 1:
        print(f"median of {len(runs)} runs:")
        for k, name in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
                        ("tpot_p50", "TPOT p50")):
            print(f"  {name}: client {med[k + '_client'] * 1e3:8.3f} ms  twin "
                  f"{med[k + '_truth'] * 1e3:8.3f} ms  diff {100 * med[k + '_err']:+6.2f}%")
        print(f"  all requests (warm-up included): TTFT p50 diff "
              f"{100 * statistics.median(r['all']['ttft_p50_err'] for r in runs):+6.2f}%")
    ok = abs(med["ttft_p50_err"]) <= TARGET and abs(med["tpot_p50_err"]) <= TARGET
    print(f"TTFT p50 and TPOT p50 within {100 * TARGET:.0f}%: " + ("yes" if ok else "NO"))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
