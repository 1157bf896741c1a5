"""How many Locust processes a run needs, from its planned peak and one process's measured capacity.

One Locust process is one gevent loop on one core. It times a chunk to the millisecond only while
it is far from full: a burst of chunks (vLLM hands out one token per running request at the same
instant) is read one after another, so the last reader of a burst is late by the burst's length
times the cost of one chunk. `scripts/bench_traffic.py` measures the most tokens/s one process
streams with TTFT and TPOT within 2% of the truth; the limits below keep a process at half of it:

- the 16-core H200 host of reports/examples/client-parity-h200: 12,100 tokens/s over 64 streams
  (at 128 streams its core was full and TTFT drifted 21%);
- a 2-core development machine: 24,000 tokens/s over 128 streams (TTFT within 1.1%).
"""

from __future__ import annotations

import math
import os

from vllm_lab.traffic.spec import Load, Workload

# Per process: open streams, and streamed tokens (chunks) per second.
PROCESS_STREAMS = 64
PROCESS_TOKENS_S = 6000.0
# A closed loop's token rate is not known before the run: each stream is taken at the fastest
# single-stream decode of a current GPU (an 8B model on an H200 streams ~200 tokens/s alone).
STREAM_TOKENS_S = 200.0
# Cores left to the rest of a host that also runs the server (its API server and engine core).
RESERVED_CORES = 2


def peak(load: Load, workload: Workload) -> tuple[float, float]:
    """The run's planned peak: (concurrent streams, streamed tokens per second)."""
    level = load.shape.level * (load.shape.spike_factor if load.shape.kind == "spike" else 1)
    if load.mode == "closed":
        return level, level * STREAM_TOKENS_S
    if load.mode == "replay":
        return float(load.max_in_flight), _replay_tokens_s(load, workload)
    out = workload.lengths()[1]
    mean_out = out.mean if out is not None else 256.0
    return float(load.max_in_flight), level * mean_out


def _replay_tokens_s(load: Load, workload: Workload) -> float:
    """A replay's peak of streamed tokens per second: the busiest 10 s of its window, as sent."""
    from vllm_lab.traffic.traces import replay_times, trace_requests

    rows = trace_requests(workload, load)
    times = replay_times(rows, load.replay)
    span = 10.0
    busiest: dict[int, float] = {}
    for t, r in zip(times, rows):
        busiest[int(t // span)] = busiest.get(int(t // span), 0.0) + r.output_tokens
    return max(busiest.values()) / span


def plan_processes(load: Load, workload: Workload, hosts: int = 1,
                   cores: int | None = None) -> int:
    """Locust processes per load-generator host for this run's peak (at least 1).

    hosts: how many load-generator hosts share the run; cores: the cores of one of them
    (default: this machine's), of which RESERVED_CORES are left to the server.
    """
    streams, tokens_s = peak(load, workload)
    need = max(math.ceil(streams / PROCESS_STREAMS), math.ceil(tokens_s / PROCESS_TOKENS_S), 1)
    per_host = math.ceil(need / max(1, hosts))
    cap = max(1, (cores if cores is not None else os.cpu_count() or 1) - RESERVED_CORES)
    return max(1, min(per_host, cap))
