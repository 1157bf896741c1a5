#!/usr/bin/env python3
"""Real vLLM's engine step time by batch composition: decodes, prefill chunks, and both mixed.

The twin prices a step from what it carries (tokens, sequences, the context each attends over).
This measures that on the GPU host itself: vLLM's own engine in this process (no API server, no
async scheduling, prefix caching off), driven step by step. For each decode batch B at context C
it times pure-decode steps, then steps that carry a prefill chunk of P tokens beside the B
decodes, and prefills alone (B = 0); each step's composition is read from vLLM's scheduler
(tokens and computed context per request), so every row says exactly what ran.

    python scripts/bench_step_times.py --model DIR --out steps.jsonl [--batches 0,1,8,32,64,128,256]
        [--contexts 512] [--prefills 16,64,256,512,1024,2048,4096,7936] [--serve-flag k=v ...]

Needs vLLM (a GPU host); the model folder may hold only config and tokenizer (dummy weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


class StepRecorder:
    """Wraps vLLM's scheduler to keep what each step scheduled: (tokens, context before) per request."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.last: list[tuple[int, int]] = []
        self._schedule = scheduler.schedule
        scheduler.schedule = self._wrapped

    def _wrapped(self, *args, **kwargs):
        out = self._schedule(*args, **kwargs)
        reqs = self.scheduler.requests
        # num_computed_tokens already counts this step's tokens once schedule() returns.
        self.last = [(int(n), int(reqs[rid].num_computed_tokens) - int(n))
                     for rid, n in out.num_scheduled_tokens.items() if rid in reqs]
        return out


class Bench:
    """Drives one in-process vLLM engine and writes a row per timed step."""

    def __init__(self, args):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        from vllm import LLM, SamplingParams

        flags = dict(kv.split("=", 1) for kv in args.serve_flag)
        flags = {k.replace("-", "_"): _value(v) for k, v in flags.items()}
        self.llm = LLM(model=args.model, load_format="dummy", enable_prefix_caching=False,
                       async_scheduling=False, **flags)
        self.engine = self.llm.llm_engine
        core = self.engine.engine_core.engine_core
        self.recorder = StepRecorder(core.scheduler)
        self.budget = int(getattr(core.scheduler, "max_num_scheduled_tokens", 0)
                          or self.engine.vllm_config.scheduler_config.max_num_batched_tokens)
        self.params = SamplingParams
        self.rng = np.random.default_rng(0)
        self.vocab = 32000
        self.out = open(args.out, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.n = 0
        self.meta = {"flags": flags, "budget": self.budget}

    def close(self) -> None:
        self.out.close()

    def _add(self, prompt_len: int, max_tokens: int = 2048) -> str:
        self.n += 1
        rid = f"r{self.n}"
        ids = self.rng.integers(100, self.vocab, prompt_len).tolist()
        sp = self.params(max_tokens=max_tokens, ignore_eos=True,
                         detokenize=False, temperature=1.0)
        self.engine.add_request(rid, {"prompt_token_ids": ids}, sp)
        return rid

    def _step(self) -> tuple[float, list]:
        t = time.perf_counter()
        outs = self.engine.step()
        return time.perf_counter() - t, outs

    def _row(self, kind: str, b: int, c: int, p: int, dt: float) -> None:
        sched = self.recorder.last
        row = {"kind": kind, "batch": b, "context": c, "prefill": p, "step_s": dt,
               "tokens": sum(n for n, _ in sched), "seqs": len(sched),
               "chunks": [[n, ctx] for n, ctx in sched if n > 1], "decodes": sum(n == 1 for n, _ in sched),
               "decode_context": sum(ctx for n, ctx in sched if n == 1), **self.meta}
        self.out.write(json.dumps(row) + "\n")

    def _until_first_tokens(self, ids: set[str], limit: int = 10_000) -> None:
        """Step until every request of ``ids`` has its first token (its prefill is done)."""
        waiting = set(ids)
        for _ in range(limit):
            if not waiting:
                return
            _, outs = self._step()
            for o in outs:
                if o.outputs and o.outputs[0].token_ids:
                    waiting.discard(o.request_id)

    def point(self, b: int, c: int, prefills: list[int], decode_steps: int, repeats: int) -> None:
        """B running decodes at context C: pure-decode steps, then a prefill of each P beside them."""
        running = [self._add(c) for _ in range(b)]
        self._until_first_tokens(set(running))
        for _ in range(2):  # settle: the last prefill's step is not a decode step
            self._step()
        for _ in range(decode_steps if b else 0):
            dt, _ = self._step()
            self._row("decode", b, c, 0, dt)
        for p in prefills:
            for _ in range(repeats):
                rid = self._add(p)
                for _ in range(64):  # its chunks, one step each, until its first token
                    dt, outs = self._step()
                    self._row("mixed" if b else "prefill", b, c, p, dt)
                    if any(o.request_id == rid and o.outputs and o.outputs[0].token_ids for o in outs):
                        break
                self.engine.abort_request([rid])
                self._step()  # the abort's step: not timed
        self.engine.abort_request(running)
        while self.engine.has_unfinished_requests():
            self._step()


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="0,1,8,32,64,128,256")
    ap.add_argument("--contexts", default="512")
    # 7936: the longest prompt that leaves the model's 8192-token context room to decode.
    ap.add_argument("--prefills", default="16,64,256,512,1024,2048,4096,7936")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--serve-flag", action="append", default=[], help="an engine flag, k=v")
    ap.add_argument("--time-limit-s", type=float, default=1e9, help="stop starting points after this")
    args = ap.parse_args()
    t0 = time.monotonic()
    bench = Bench(args)
    print(f"engine ready in {time.monotonic() - t0:.0f} s, budget {bench.budget}", flush=True)
    prefills = [int(x) for x in args.prefills.split(",")]
    try:
        for c in (int(x) for x in args.contexts.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                if time.monotonic() - t0 > args.time_limit_s:
                    print("time limit: stopping", flush=True)
                    return 0
                t = time.monotonic()
                try:
                    bench.point(b, c, prefills, args.decode_steps, args.repeats)
                except Exception as e:  # noqa: BLE001 - one point's failure is reported, the rest run
                    print(f"B={b} C={c}: failed: {e!r}", flush=True)
                    continue
                print(f"B={b} C={c}: {time.monotonic() - t:.1f} s", flush=True)
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
