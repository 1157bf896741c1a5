"""Benchmark the traffic layer's measurements against a server with known ground truth.

Runs the lab's Locust user and an asyncio/aiohttp reference client (timed the way `vllm bench
serve` times: perf_counter around `async for chunk in response.content`) against the scripted
server, whose truth log records when each token really left it (perf_counter: the same monotonic
clock as the clients on one host). Truth TTFT runs from the client's send to the server's first
token send, so the error is the client's own lateness in noticing tokens. Prints, per client:
  1. accuracy at light load: TTFT p50/p99 and TPOT p50 error against the truth;
  2. capacity: streamed tokens/s as concurrency grows, and the most tokens/s one client process
     (one core) sustains before its TTFT p50 or TPOT p50 drifts more than 5% from the truth;
  3. turnaround: how long a closed-loop user waits between a reply's end and its next send, with
     512-token prompts built by a real tokenizer (--tokenizer DIR, or one trained here);
  4. overhead: a run's own time beside its load, at 1, 2 and 4 Locust processes: from the call to
     the first send, how long it sent against its duration, and from the last reply to the return.

    .venv/bin/python scripts/bench_traffic.py [--quick] [--out DIR] [--server-processes N]
                                              [--tokenizer MODEL_DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The scripted server is a test fixture in tests/support/: put the checkout on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from tests.support.scripted_server import running
from vllm_lab.summary import closed_loop_gaps
from vllm_lab.traffic import Lengths, Load, Workload, run_load


def _pin(cores: str | None) -> tuple[str, ...]:
    return ("taskset", "-c", cores) if cores and shutil.which("taskset") else ()


_ALL_CORES = os.sched_getaffinity(0)


def _pin_self(cores: str | None) -> None:
    """Pin this process (and so the clients it starts) to cores, or unpin it with None."""
    if cores is None:
        os.sched_setaffinity(0, _ALL_CORES)
        return
    cpus = set()
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        cpus |= set(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)


# ---- the reference client: vLLM's benchmark timing loop, in asyncio + aiohttp -------------------
async def _ref_request(session, url: str, body: dict, rid: str) -> dict:
    st = time.perf_counter()
    recent, ttft, itl, out = st, None, [], 0
    async with session.post(url + "/v1/completions", json=body,
                            headers={"X-Request-Id": rid}) as resp:
        async for chunk_bytes in resp.content:
            chunk_bytes = chunk_bytes.strip()
            if not chunk_bytes:
                continue
            chunk = chunk_bytes.decode().removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if choices := data.get("choices"):
                ts = time.perf_counter()
                if choices[0].get("text"):
                    if ttft is None:
                        ttft = ts - st
                    else:
                        itl.append(ts - recent)
                    recent = ts
            elif usage := data.get("usage"):
                out = usage["completion_tokens"]
    e2e = recent - st
    return {"request_id": rid, "ttft_s": ttft, "e2e_s": e2e, "output_tokens": out,
            "tpot_s": (e2e - ttft) / (out - 1) if ttft is not None and out > 1 else None,
            "start": st}


async def _ref_run(url: str, concurrency: int, duration_s: float, tokens: int) -> list[dict]:
    import aiohttp

    body = {"model": "ok", "prompt": "hello " * 32, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    rows: list[dict] = []
    deadline = time.perf_counter() + duration_s
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def user(u: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                rows.append(await _ref_request(session, url, body, f"ref-c{concurrency}-{u}-{k}"))
                k += 1

        await asyncio.gather(*(user(u) for u in range(concurrency)))
    return rows


def reference_main(argv: list[str]) -> None:
    """Subprocess entry: run the reference client and print its rows as JSON."""
    url, conc, dur, tokens, out = argv[0], int(argv[1]), float(argv[2]), int(argv[3]), argv[4]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    rows = asyncio.run(_ref_run(url, conc, dur, tokens))
    cpu = (time.process_time() - cpu0) / (time.perf_counter() - t0)
    Path(out).write_text(json.dumps({"rows": rows, "cpu_fraction": cpu}))


def run_reference(url, conc, dur, tokens) -> tuple[list[dict], float]:
    """Run the reference client in its own process; return its rows and CPU share."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    subprocess.run([sys.executable, __file__, "--reference", url, str(conc),
                    str(dur), str(tokens), out], check=True, start_new_session=True,
                   timeout=dur + 120)
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    return data["rows"], data["cpu_fraction"]


def run_locust(url, conc, dur, tokens, out_dir: Path, prompt: int = 32,
               tokenizer: Path | None = None) -> tuple[list[dict], float, bool]:
    """Run the lab's Locust user (one process); return its rows, CPU share and overload flag."""
    workload = Workload(source="synthetic", input=Lengths(mean=prompt), output=Lengths(mean=tokens),
                        tokenizer=tokenizer)
    load = Load(shape={"level": conc}, stop={"duration_s": dur}, request_timeout_s=600)
    r = run_load(url, "ok", workload, load, out_dir, scrape_metrics=False)
    df = r.samples[r.samples.status == "ok"].copy()
    anchor = {w["worker"]: w["perf0"] - w["wall0"] for w in r.workers}
    df["start"] = df.start_ts + df.worker.map(anchor)  # back onto the perf_counter clock
    rows = df[["request_id", "ttft_s", "e2e_s", "output_tokens", "tpot_s", "start"]].to_dict(
        "records")
    return rows, r.cpu_fraction_max, r.client_overloaded


# ---- comparison against the truth --------------------------------------------------------------
def compare(rows: list[dict], truth: dict[str, dict]) -> dict[str, float]:
    """Return p50/p99 of client TTFT and TPOT next to the server's truth, and the errors."""
    c_ttft, t_ttft, c_tpot, t_tpot, toks, spans = [], [], [], [], 0, []
    for r in rows:
        t = truth.get(r["request_id"])
        if t is None or r["ttft_s"] is None or len(t["sent"]) < 2:
            continue
        # Truth TTFT: from the client's send to the server's first-token send, on the shared
        # monotonic clock; the error is then only how late the client noticed the token.
        c_ttft.append(r["ttft_s"])
        t_ttft.append(t["sent"][0] - r["start"])
        c_tpot.append(r["tpot_s"])
        t_tpot.append((t["sent"][-1] - t["sent"][0]) / (len(t["sent"]) - 1))
        toks += len(t["sent"])
        spans.append((r["start"], t["sent"][-1]))
    if not c_ttft:
        return {"n": 0}
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    out = {"n": len(c_ttft), "tokens_per_s": toks / span if span > 0 else 0.0}
    for name, c, t, ps in (("ttft", c_ttft, t_ttft, (50, 99)), ("tpot", c_tpot, t_tpot, (50,))):
        for p in ps:
            cp, tp = float(np.percentile(c, p)), float(np.percentile(t, p))
            out[f"{name}_p{p}_client_ms"] = cp * 1e3
            out[f"{name}_p{p}_truth_ms"] = tp * 1e3
            out[f"{name}_p{p}_err_ms"] = (cp - tp) * 1e3
            out[f"{name}_p{p}_err_rel"] = (cp - tp) / tp
    out["drift"] = max(abs(out["ttft_p50_err_rel"]), abs(out["tpot_p50_err_rel"]))
    return out


def turnaround(rows: list[dict], users: int) -> dict[str, float]:
    """A closed loop's wait between a reply's end and the next send: the k-th send after the
    first wave follows the k-th end, whichever user it was."""
    gap = closed_loop_gaps([r["start"] for r in rows], [r["start"] + r["e2e_s"] for r in rows],
                           users) * 1e3
    return {"n": len(rows), "turnaround_p50_ms": float(np.median(gap)),
            "turnaround_p90_ms": float(np.percentile(gap, 90)),
            "turnaround_p99_ms": float(np.percentile(gap, 99))}


def _tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer trained on the standard library: real per-prompt CPU cost."""
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:300]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((Path(f).read_text(errors="ignore") for f in files), trainers.BpeTrainer(
        vocab_size=16000, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = out / "tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def _truth(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["request_id"]: r for r in rows}


def _line(label: str, m: dict) -> str:
    if not m.get("n"):
        return f"  {label:8s} no samples"
    return (f"  {label:8s} n={m['n']:5d} tok/s={m['tokens_per_s']:9.0f}  "
            f"TTFT p50 {m['ttft_p50_client_ms']:8.2f} (truth {m['ttft_p50_truth_ms']:8.2f}, "
            f"err {m['ttft_p50_err_ms']:+6.2f} ms)  "
            f"p99 err {m['ttft_p99_err_ms']:+6.2f} ms  "
            f"TPOT p50 {m['tpot_p50_client_ms']:6.3f} (truth {m['tpot_p50_truth_ms']:6.3f}, "
            f"err {m['tpot_p50_err_ms']:+6.3f} ms)  drift {100 * m['drift']:5.1f}%  "
            f"cpu {m.get('cpu', 0):4.2f}{'  OVERLOADED' if m.get('overloaded') else ''}")


def phase(url, truth_log, conc, dur, tokens, work: Path) -> dict[str, dict]:
    """Run both clients, one after the other, at one concurrency; return their comparisons."""
    res = {}
    rows, cpu, over = run_locust(url, conc, dur, tokens, work / f"locust-c{conc}")
    res["locust"] = {**compare(rows, _truth(truth_log)), "cpu": cpu, "overloaded": over}
    rows, cpu = run_reference(url, conc, dur, tokens)
    res["aiohttp"] = {**compare(rows, _truth(truth_log)), "cpu": cpu}
    return res


def main() -> None:
    """Parse arguments, run both phases, print the figures and write them as JSON."""
    if len(sys.argv) > 1 and sys.argv[1] == "--reference":
        reference_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter points")
    p.add_argument("--out", type=Path, default=Path("bench-traffic"))
    p.add_argument("--server-processes", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--client-core", default=None, help="core for the clients, e.g. 1")
    p.add_argument("--server-cores", default=None, help="taskset core list for the server")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--levels", default="1,8,32,64,128,256,512")
    p.add_argument("--tokenizer", type=Path, help="model folder with tokenizer.json (turnaround)")
    p.add_argument("--only", choices=["accuracy", "capacity", "turnaround", "overhead"], action="append",
                   help="run only this section (repeatable); all by default")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dur = 4.0 if a.quick else a.duration
    levels = [1, 8, 32, 128] if a.quick else [int(x) for x in a.levels.split(",")]
    report: dict = {"cpu_count": os.cpu_count(), "server_processes": a.server_processes}
    only = set(a.only or ["accuracy", "capacity", "turnaround", "overhead"])
    wrap = _pin(a.server_cores)
    if "accuracy" in only:
        report["accuracy"] = accuracy(a, dur, wrap)
    if "capacity" in only:
        report.update(capacity(a, dur, levels, wrap))
    if "turnaround" in only:
        report["turnaround"] = turnaround_phase(a, dur, wrap)
    if "overhead" in only:
        report["overhead"] = overhead(a, dur, wrap)
    (a.out / "bench_traffic.json").write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {a.out / 'bench_traffic.json'}")


def overhead(a, dur: float, wrap, repeats: int = 3) -> list[dict]:
    """Section 4: a closed loop of 16 users for ``dur`` s, at 1, 2 and 4 Locust processes."""
    print(f"== overhead: 16 users, {dur:g} s runs, {repeats} each ==")
    load = Load(mode="closed", shape={"level": 16}, stop={"duration_s": dur})
    work = Workload(source="synthetic", input=Lengths(mean=20), output=Lengths(mean=20))
    rows = []
    with running("--ttft-ms", "20", "--itl-ms", "5", "--processes", str(a.server_processes),
                 wrap=wrap) as url:
        _pin_self(a.client_core)
        for processes in (1, 2, 4):
            for i in range(repeats):
                called = time.time()
                r = run_load(url, "ok", work, load, a.out / f"overhead-{processes}-{i}",
                             processes=processes, scrape_metrics=False)
                back = time.time()
                s = r.samples
                first, last_send = s.start_ts.min(), s.start_ts.max()
                rows.append({"processes": processes, "to_first_send_s": first - called,
                             "sending_s": last_send - first,
                             "after_last_reply_s": back - (s.start_ts + s.e2e_s).max()})
        _pin_self(None)
    for processes in (1, 2, 4):
        mine = [r for r in rows if r["processes"] == processes]
        print(f"  {processes} process(es): first send after "
              f"{np.median([r['to_first_send_s'] for r in mine]):.2f} s, sent for "
              f"{np.median([r['sending_s'] for r in mine]):.2f} s of {dur:g}, returned "
              f"{np.median([r['after_last_reply_s'] for r in mine]):.2f} s after the last reply")
    return rows


def accuracy(a, dur: float, wrap) -> dict:
    """Section 1: both clients against the truth at light load."""
    print("== accuracy: TTFT 200 ms, ITL 20 ms, 50 tokens, 4 users ==")
    truth_log = a.out / "truth-accuracy.jsonl"
    truth_log.unlink(missing_ok=True)
    with running("--ttft-ms", "200", "--itl-ms", "20", "--tokens", "50", "--truth-log",
                 str(truth_log), "--processes", str(a.server_processes), wrap=wrap) as url:
        _pin_self(a.client_core)
        acc = phase(url, truth_log, 4, max(dur, 6.0), 50, a.out)
    _pin_self(None)
    for k, m in acc.items():
        print(_line(k, m))
    return acc


def capacity(a, dur: float, levels: list[int], wrap) -> dict:
    """Section 2: tokens/s as concurrency grows, and the most one process sustains within 2%."""
    print("== capacity: TTFT 50 ms, ITL 5 ms, 400 tokens per reply (200 tok/s per stream) ==")
    cap: dict[str, list] = {"locust": [], "aiohttp": []}
    truth_log = a.out / "truth-capacity.jsonl"
    truth_log.unlink(missing_ok=True)
    server = ["--ttft-ms", "50", "--itl-ms", "5", "--tokens", "400", "--no-precise",
              "--truth-log", str(truth_log), "--processes", str(a.server_processes)]
    with running(*server, wrap=wrap) as url:
        _pin_self(a.client_core)
        for c in levels:
            res = phase(url, truth_log, c, dur, 400, a.out)
            print(f" concurrency {c}")
            for k, m in res.items():
                print(_line(k, m))
                cap[k].append({"concurrency": c, **m})
    _pin_self(None)
    report: dict = {"capacity": cap}
    print("== most streamed tokens/s one client process sustains with drift <= 2% ==")
    for k, pts in cap.items():
        good = [m for m in pts if m.get("n") and m["drift"] <= 0.02 and not m.get("overloaded")]
        best = max(good, key=lambda m: m["tokens_per_s"], default=None)
        report[f"max_tokens_per_s_{k}"] = best["tokens_per_s"] if best else 0.0
        print(f"  {k:8s} {best['tokens_per_s']:9.0f} tok/s at concurrency {best['concurrency']}"
              if best else f"  {k:8s} none within 2%")
    return report


def turnaround_phase(a, dur: float, wrap) -> dict:
    """Section 3: a closed-loop user's wait between a reply's end and its next send, when the
    lab builds 512-token prompts with a real tokenizer (vllm bench serve builds them all first)."""
    print("== turnaround: 32 users, 512-token prompts, TTFT 50 ms, ITL 5 ms, 128 tokens ==")
    tok = a.tokenizer or _tokenizer(a.out)
    with running("--ttft-ms", "50", "--itl-ms", "5", "--tokens", "128", "--processes",
                 str(a.server_processes), wrap=wrap) as url:
        _pin_self(a.client_core)
        rows, _cpu, _over = run_locust(url, 32, max(dur, 8.0), 128, a.out / "locust-turnaround",
                                       prompt=512, tokenizer=tok)
        ta = {"locust": turnaround(rows, 32)}
        ta["aiohttp"] = turnaround(run_reference(url, 32, max(dur, 8.0), 128)[0], 32)
    _pin_self(None)
    for k, m in ta.items():
        print(f"  {k:8s} n={m['n']:5d}  turnaround p50 {m['turnaround_p50_ms']:6.2f} ms  "
              f"p90 {m['turnaround_p90_ms']:6.2f} ms  p99 {m['turnaround_p99_ms']:6.2f} ms")
    return ta


if __name__ == "__main__":
    main()
