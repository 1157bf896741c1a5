#!/usr/bin/env python3
"""Write the small synthetic traces shipped in scenarios/traces/, one per format the lab reads.

    python scripts/make_traces.py [--out scenarios/traces] [--seed 0]

None of them is production data (real traces cannot be downloaded here); each imitates what its
public counterpart is known to look like, so the loaders, the replay and the predictor have
something of every shape to work on. `scenarios/traces/README.md` says how each was made and
where the real ones are published. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np

# A day's traffic compressed into ten minutes: a quiet start, a busy middle, bursts.
SPAN_S = 600.0


def _arrivals(rng: np.random.Generator, n: int, burst: float) -> np.ndarray:
    """n arrival times over SPAN_S: a rate that rises and falls, with gamma bursts (CV 1/sqrt(burst))."""
    base = rng.gamma(burst, 1.0 / burst, n)
    # Warp time so the middle third carries about half the requests.
    t = np.cumsum(base)
    t = t / t[-1]
    warped = t + 0.15 * np.sin(2 * np.pi * t) / (2 * np.pi)
    return np.sort(warped) * SPAN_S


def _lognormal(rng, n, mean, sigma, lo, hi) -> np.ndarray:
    x = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
    return np.clip(np.rint(x), lo, hi).astype(int)


def mooncake(rng, path: Path, n: int = 1200) -> None:
    """Conversations of several turns behind a few system prompts: each turn's prompt is the
    conversation so far, so its hash ids start with the previous turn's (512-token blocks)."""
    times = _arrivals(rng, n, 0.6)
    systems = [list(range(1000 * k, 1000 * k + rng.integers(1, 4))) for k in range(6)]
    convs: list[list[int]] = []
    next_id = 100_000
    rows = []
    for t in times:
        if convs and rng.random() < 0.55:
            ids = convs.pop(rng.integers(len(convs)))    # the next turn of an open conversation
        else:
            ids = list(systems[rng.integers(len(systems))])
        grow = int(rng.integers(1, 4))
        ids = [*ids, *range(next_id, next_id + grow)]
        next_id += grow
        prompt = min(len(ids) * 512, max(1, len(ids) * 512 - int(rng.integers(0, 400))))
        out = int(_lognormal(rng, 1, 250, 0.8, 8, 1500)[0])
        rows.append({"timestamp": round(float(t) * 1000), "input_length": prompt,
                     "output_length": out, "hash_ids": ids})
        if len(ids) < 24 and rng.random() < 0.7:
            convs.append(ids)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def azure(rng, path: Path, n: int = 1500) -> None:
    """The Azure LLM inference trace's columns and time format; conversation-like lengths."""
    times = _arrivals(rng, n, 0.4)
    start = dt.datetime(2023, 11, 16, 18, 15, 0)
    prompts = _lognormal(rng, n, 1000, 1.0, 4, 8000)
    outs = _lognormal(rng, n, 230, 0.9, 1, 1800)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for t, p, o in zip(times, prompts, outs):
            stamp = start + dt.timedelta(seconds=float(t))
            w.writerow([stamp.strftime("%Y-%m-%d %H:%M:%S.%f") + "0", int(p), int(o)])


def burstgpt(rng, path: Path, n: int = 1500) -> None:
    """BurstGPT's columns: two models, a conversation and an API log type, bursty arrivals and
    about 1% failed requests (0 response tokens), which the lab leaves out."""
    times = _arrivals(rng, n, 0.3)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
                    "Log Type"])
        for t in times:
            model = "ChatGPT" if rng.random() < 0.8 else "GPT-4"
            req = int(_lognormal(rng, 1, 600, 1.1, 1, 6000)[0])
            resp = 0 if rng.random() < 0.01 else int(_lognormal(rng, 1, 280, 0.9, 1, 2000)[0])
            kind = "Conversation log" if rng.random() < 0.7 else "API log"
            w.writerow([round(float(t), 3), model, req, resp, req + resp, kind])


def plain(rng, path: Path, n: int = 1000) -> None:
    """What a user writes from their own logs: seconds, lengths, and a prefix id for requests
    that share a system prompt (three products, each with its own prompt)."""
    times = _arrivals(rng, n, 1.0)
    products = {"search": 900, "support": 400, "code": 1600}
    rows = []
    for t in times:
        name = list(products)[rng.integers(len(products))]
        shared = products[name]
        prompt = shared + int(_lognormal(rng, 1, 150, 0.9, 1, 3000)[0])
        rows.append({"timestamp": round(float(t), 3), "prompt_tokens": prompt,
                     "output_tokens": int(_lognormal(rng, 1, 200, 0.8, 1, 1200)[0]),
                     "prefix_id": name, "prefix_tokens": shared})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "scenarios/traces")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in (("mooncake-synthetic.jsonl", mooncake), ("azure-synthetic.csv", azure),
                       ("burstgpt-synthetic.csv", burstgpt), ("requests-synthetic.jsonl", plain)):
        make(np.random.default_rng([args.seed, len(name)]), args.out / name)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
