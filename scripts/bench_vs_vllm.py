#!/usr/bin/env python3
"""The lab's figures beside `vllm bench serve`'s, on one server with the same flags and load.

Starts the server through the lab's playbooks, runs the lab's Locust traffic and then
`vllm bench serve` (random dataset, fixed lengths, --ignore-eos, the same concurrency and request
count), stops the server, and prints output throughput, TTFT p50 and TPOT p50 side by side.
With --twin it also checks that `vllm bench serve` runs unchanged against the twin.

    python scripts/bench_vs_vllm.py --inventory inventory/gpukit.yml --backend vllm \\
        --model $GPUKIT_MODEL --out $OUT [--twin]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_lab import scenarios, serving
from vllm_lab.backends import _post
from vllm_lab.summary import summarize
from vllm_lab.traffic import run_load


def bench_cmd(url: str, model: str, tokenizer: str, users: int, prompts: int, inp: int, out: int,
              result: Path) -> list[str]:
    """`vllm bench serve` as the reference files were taken."""
    return ["vllm", "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(inp),
            "--random-output-len", str(out), "--ignore-eos", "--max-concurrency", str(users),
            "--num-prompts", str(prompts), "--seed", str(int(time.time())), "--save-result",
            "--result-dir", str(result.parent), "--result-filename", result.name]


def lab_scenario(model: str, users: int, prompts: int, inp: int, out: int):
    """The default scenario with the bench's workload: fixed lengths, closed loop, N requests."""
    return scenarios.resolve("default", overrides=[
        f"serve.model={model}", "serve.load-format=dummy",
        "workload.source=synthetic", f"workload.tokenizer={model}", "workload.ignore_eos=true",
        f"workload.input={{dist: fixed, mean: {inp}}}", f"workload.output={{dist: fixed, mean: {out}}}",
        f"load.shape.level={users}", f"load.stop.max_requests={prompts}", "load.stop.duration_s=600"])


def compare(args) -> dict:
    """One server start: the lab's run, then vllm bench serve's, same flags and load."""
    s = lab_scenario(args.model, args.users, args.prompts, args.input_len, args.output_len)
    inst = serving.start(s.serve, inventory=args.inventory, backend=args.backend,
                         extra_vars={"vllm_environment": {"VLLM_SERVER_DEV_MODE": "1"}})[0]
    try:
        for _ in range(4):  # warm-up, as both tools see a warm server
            _post(inst.url + "/v1/completions", {"model": args.model, "prompt": "hi " * 64,
                                                  "max_tokens": 16, "ignore_eos": True}, None)
        res = run_load(inst.url, args.model, s.workload, s.load, args.out / "lab-run", seed=1)
        lab = summarize(res.samples, s.slo)
        _post(inst.url + "/reset_prefix_cache", None, None)
        result = args.out / f"vllm-bench-c{args.users}.json"
        subprocess.run(bench_cmd(inst.url, args.model, args.model, args.users, args.prompts,
                                 args.input_len, args.output_len, result), check=True)
        ref = json.loads(result.read_text())
    finally:
        serving.stop(args.inventory)
    rows = {"output_throughput": (lab["output_throughput"], ref["output_throughput"]),
            "ttft_p50_ms": (lab["ttft_p50"] * 1000, ref["median_ttft_ms"]),
            "tpot_p50_ms": (lab["tpot_p50"] * 1000, ref["median_tpot_ms"])}
    print(f"{'metric':20s} {'lab (Locust)':>14s} {'vllm bench':>12s} {'diff':>8s}")
    for k, (a, b) in rows.items():
        print(f"{k:20s} {a:14.2f} {b:12.2f} {(a - b) / b:+8.1%}")
    return {k: {"lab": a, "vllm_bench": b, "diff": (a - b) / b} for k, (a, b) in rows.items()}


def twin_compat(args) -> dict:
    """`vllm bench serve` against the twin, unchanged."""
    port = 8321
    proc = subprocess.Popen([sys.executable, "-m", "vllm_lab.twin.server", "serve", args.model,
                             "--port", str(port), "--twin-startup-seconds", "1"],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        result = args.out / "vllm-bench-against-twin.json"
        subprocess.run(bench_cmd(url, args.model, args.model, 32, 320, 512, 128, result), check=True)
        ref = json.loads(result.read_text())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    print(f"vllm bench serve against the twin: {ref['completed']} of {ref['num_prompts']} completed, "
          f"{ref['output_throughput']:.0f} tok/s, TTFT p50 {ref['median_ttft_ms']:.1f} ms, "
          f"TPOT p50 {ref['median_tpot_ms']:.2f} ms")
    return {k: ref[k] for k in ("completed", "failed", "output_throughput", "median_ttft_ms",
                                "median_tpot_ms")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inventory", type=Path, default=Path("inventory/gpukit.yml"))
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--twin", action="store_true", help="also run vllm bench serve against the twin")
    ap.add_argument("--skip-compare", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    if not args.skip_compare:
        summary["lab_vs_vllm_bench"] = compare(args)
    if args.twin:
        summary["vllm_bench_against_twin"] = twin_compat(args)
    (args.out / "bench_vs_vllm.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
