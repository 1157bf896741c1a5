"""Benchmark: GuideLLM, unchanged, against the twin, next to the lab's own client.

GuideLLM is a large install and no dependency of the lab: put it in a virtual environment of its
own (`python -m venv gl && gl/bin/pip install guidellm`) and pass its executable. Each client
drives a fresh twin (H200 profile, a Llama-3-8B-shaped model folder made here) with the same
closed loop: N streams of 512-token prompts and 128-token replies, R requests. Both are read the
same way from their per-request records: output throughput (tokens over first send to last
reply), TPOT ((e2e - TTFT) / (tokens - 1), GuideLLM's inter-token latency) and TTFT p50. Goal:
throughput and TPOT within 1% of each other.

    .venv/bin/python scripts/bench_guidellm.py --guidellm gl/bin/guidellm [--streams 8]
        [--requests 160] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# The twin's process helper lives with the tests in tests/support/: put the checkout on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from tests.support.processes import TwinProcess
from vllm_lab.models import make_model_folder
from vllm_lab.summary import closed_loop_gaps
from vllm_lab.traffic import Lengths, Load, Workload, run_load

PROMPT, OUTPUT = 512, 128


@contextlib.contextmanager
def twin(model: Path, log_dir: Path):
    """A fresh twin (H200 profile) in its own process group, stopped by that group at the end."""
    proc = TwinProcess(log_dir, model=str(model), profile="h200-llama-3-8b", startup_s=0.2)
    try:
        yield proc.url
    finally:
        proc.stop()


def figures(start, end, tokens, tpot_s, ttft_s, streams: int) -> dict[str, float]:
    """The compared figures from per-request arrays (seconds), and the client's turnaround: the
    wait between a reply's end and the next send (the k-th send after the first wave follows
    the k-th end), which sets how tightly a closed loop's waves arrive and so its TTFT."""
    start, end = np.asarray(start, dtype=float), np.asarray(end, dtype=float)
    gap = closed_loop_gaps(start, end, streams)
    return {"requests": len(start), "turnaround_p50_ms": float(np.median(gap) * 1e3),
            "output_throughput": float(np.sum(tokens) / (np.max(end) - np.min(start))),
            "tpot_mean_ms": float(np.mean(tpot_s) * 1e3),
            "ttft_p50_ms": float(np.median(ttft_s) * 1e3)}


def run_guidellm(exe: str, url: str, model: Path, streams: int, requests: int, out: Path) -> dict:
    """GuideLLM's closed loop (its `concurrent` profile), read from its JSON report."""
    report = out / "guidellm.json"
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT},output_tokens={OUTPUT}",
           "--tokenizer", f"kind=hf_auto,model={model}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    with open(out / "guidellm.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=1800,
                       start_new_session=True)
    rows = json.loads(report.read_text())["benchmarks"][0]["requests"]["successful"]
    col = {k: np.array([r[k] for r in rows], dtype=float) for k in (
        "request_start_time", "request_end_time", "output_tokens", "inter_token_latency_ms",
        "time_to_first_token_ms")}
    return figures(col["request_start_time"], col["request_end_time"], col["output_tokens"],
                   col["inter_token_latency_ms"] / 1e3, col["time_to_first_token_ms"] / 1e3,
                   streams)


def run_lab(url: str, model: Path, streams: int, requests: int, out: Path) -> dict:
    """The lab's Locust client, the same closed loop and lengths."""
    workload = Workload(source="synthetic", input=Lengths(mean=PROMPT), output=Lengths(mean=OUTPUT),
                        tokenizer=model)
    load = Load(mode="closed", shape={"level": streams}, stop={"max_requests": requests})
    r = run_load(url, str(model), workload, load, out / "lab", scrape_metrics=False)
    ok = r.samples[r.samples.status == "ok"]
    return figures(ok.start_ts, ok.start_ts + ok.e2e_s, ok.output_tokens, ok.tpot_s, ok.ttft_s,
                   streams)


def main(argv: list[str] | None = None) -> int:
    """Run GuideLLM and the lab's client against the twin; print and write both."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--guidellm", required=True, help="the guidellm executable")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    out.mkdir(parents=True, exist_ok=True)
    model = make_model_folder("llama-3-8b", out / "model")
    res = {}
    with twin(model, out) as url:
        res["guidellm"] = run_guidellm(a.guidellm, url, model, a.streams, a.requests, out)
    with twin(model, out) as url:
        res["lab"] = run_lab(url, model, a.streams, a.requests, out)
    print(f"{a.streams} streams, {a.requests} requests of {PROMPT}/{OUTPUT} tokens, the twin")
    print(f"{'client':9s} {'requests':>8s} {'output tok/s':>13s} {'TPOT mean ms':>13s} "
          f"{'TTFT p50 ms':>12s} {'turnaround p50 ms':>18s}")
    for k, m in res.items():
        print(f"{k:9s} {m['requests']:8d} {m['output_throughput']:13.1f} {m['tpot_mean_ms']:13.3f} "
              f"{m['ttft_p50_ms']:12.1f} {m['turnaround_p50_ms']:18.2f}")
    g, lab = res["guidellm"], res["lab"]
    res["diff"] = {k: lab[k] / g[k] - 1 for k in ("output_throughput", "tpot_mean_ms", "ttft_p50_ms")}
    print("lab / guidellm - 1: " + ", ".join(f"{k} {v:+.2%}" for k, v in res["diff"].items()))
    (out / "bench_guidellm.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'bench_guidellm.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
