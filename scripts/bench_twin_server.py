"""Benchmark: can the twin's server keep its timing honest under many concurrent streams?

Starts `vllm-twin serve` (H200 profile by default) as a subprocess, drives it with N concurrent
streaming clients (aiohttp, same machine) sending ShareGPT-like prompt/output lengths with
ignore_eos, then compares the client-measured TTFT and TPOT with the twin's own ground truth
(/twin/ground_truth, matched by request id) and prints the figures and the event-loop lag.

    .venv/bin/python scripts/bench_twin_server.py [--concurrency 64] [--requests 640]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp

WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on",
         "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one"]


def sharegpt_like(rng: random.Random) -> tuple[int, int]:
    """(prompt tokens, output tokens) from lognormals shaped like ShareGPT's conversations."""
    prompt = int(min(2048, max(4, rng.lognormvariate(5.2, 1.0))))   # median ~180
    output = int(min(1024, max(16, rng.lognormvariate(5.3, 0.8))))  # median ~200
    return prompt, output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(session, url, model, prompt_len, max_tokens, rng, samples):
    """Send one streaming completion and time its first and last tokens by hand."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_len))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    rid = None
    n = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            # Parse only what timing needs: the id once, and the final usage chunk.
            if rid is None:
                rid = json.loads(line[6:])["id"]
            if b'"choices":[]' in line:
                n = json.loads(line[6:])["usage"]["completion_tokens"]
            elif b'"text":""' not in line:
                if first is None:
                    first = now
                last = now
    samples.append({"id": rid, "ttft_s": first - t0, "t0": t0, "first": first,
                    "tpot_s": (last - first) / (n - 1) if n > 1 else None, "n": n})


async def drive(url, model, concurrency, total, seed):
    """Closed loop: each of `concurrency` users sends its next request when the last one ends."""
    rng = random.Random(seed)
    plan = [sharegpt_like(rng) for _ in range(total)]
    samples: list[dict] = []
    conn = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def user(uid):
            urng = random.Random(seed * 1000 + uid)
            while plan:
                p, o = plan.pop()
                await one_request(session, url, model, p, o, urng, samples)
        t0 = time.perf_counter()
        await asyncio.gather(*(user(i) for i in range(concurrency)))
        return samples, time.perf_counter() - t0


def _p50(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h200-llama-3-8b")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-flag", action="append", default=[],
                    help="extra `vllm serve` flag words, e.g. --serve-flag=--max-num-seqs=32")
    ap.add_argument("--cprofile", help="write the server's cProfile stats to this file")
    args = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/bench-twin-{port}.log", "w+")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, *(["-m", "cProfile", "-o", args.cprofile] if args.cprofile else []),
         "-m", "vllm_lab.twin.server", "serve", args.model, "--host", "127.0.0.1",
         "--port", str(port), "--twin-profile", args.profile, "--twin-startup-seconds", "0.2",
         "--disable-uvicorn-access-log", *args.serve_flag],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    log.seek(0)
                    print(log.read())
                    return 1
                time.sleep(0.1)
        try:
            import uvloop  # the client's loop; the server picks uvloop up by itself

            uvloop.install()
        except ImportError:
            pass
        samples, wall = asyncio.run(drive(url, args.model, args.concurrency, args.requests,
                                          args.seed))
        truth = json.load(urllib.request.urlopen(url + "/twin/ground_truth"))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
    by_id = {t["id"]: t for t in truth["requests"]}
    matched = [(s, by_id[s["id"]]) for s in samples if s["id"] in by_id]
    c_ttft = _p50([s["ttft_s"] for s, _ in matched])
    t_ttft = _p50([t["ttft_s"] for _, t in matched])
    c_tpot = _p50([s["tpot_s"] for s, _ in matched])
    t_tpot = _p50([t["tpot_s"] for _, t in matched])
    tokens = sum(s["n"] for s in samples)
    lag = truth["lag_s"]
    print(f"profile={args.profile} concurrency={args.concurrency} requests={len(samples)} "
          f"matched={len(matched)} wall={wall:.1f}s output={tokens / wall:.0f} tok/s")
    print(f"TTFT p50: client {c_ttft * 1e3:.2f} ms  twin {t_ttft * 1e3:.2f} ms  "
          f"diff {100 * (c_ttft / t_ttft - 1):+.2f}%")
    print(f"TPOT p50: client {c_tpot * 1e3:.3f} ms  twin {t_tpot * 1e3:.3f} ms  "
          f"diff {100 * (c_tpot / t_tpot - 1):+.2f}%")
    print(f"step-release lag: p50 {lag['p50'] * 1e3:.2f} ms  p99 {lag['p99'] * 1e3:.2f} ms  "
          f"max {lag['max'] * 1e3:.2f} ms; coalesced tokens {truth['coalesced_tokens']} of "
          f"{tokens} ({100 * truth['coalesced_tokens'] / max(1, tokens):.1f}%)")
    # perf_counter is CLOCK_MONOTONIC on Linux: one clock for both processes on this host.
    to_server = _p50([t["arrival_s"] - s["t0"] for s, t in matched])
    late = _p50([t["first_token_late_s"] for _, t in matched])
    to_client = _p50([s["first"] - (t["arrival_s"] + t["ttft_s"] + t["first_token_late_s"])
                      for s, t in matched])
    print(f"TTFT gap p50 parts: client send -> server handler {to_server * 1e3:.2f} ms, "
          f"server first write late {late * 1e3:.2f} ms, server write -> client read "
          f"{to_client * 1e3:.2f} ms")
    ok = abs(c_ttft / t_ttft - 1) <= 0.05 and abs(c_tpot / t_tpot - 1) <= 0.05
    print("within 5%: " + ("yes" if ok else "NO"))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
