"""Troubleshooting findings from a run's metrics: what the tuning guide's troubleshooting section
looks for, each with the numbers that triggered it and the flag to try.

The four patterns (the guide's "Troubleshooting" list):

- **token budget too small**: throughput below expectation while the GPU is under 80% busy and
  requests wait: each step carries too few tokens, so raise ``max-num-batched-tokens``. Where the
  batch was full at ``max-num-seqs`` (as many running as it allows, or a closed loop of more users
  than it), vLLM schedules no more requests whatever the budget: the waiting ones wait for a slot,
  and the finding is the batch cap instead (raise ``max-num-seqs``, the KV cache permitting).
  Where the API server sets TTFT (below), it is what leaves the GPU idle, and neither is said;
- **long requests block the queue**: TTFT swings (p99 many times p50) while a few long prompts
  arrive: cap how much of a step one prefill may take (``long-prefill-token-threshold``), so the
  short prompts behind it get the rest of the budget (the guide's other flag,
  ``max-num-partial-prefills``, was V0's: vLLM's V1 engine refuses to start with it above 1);
- **out of memory at high gpu-memory-utilization**: the start (or a run) failed with an OOM while
  ``gpu-memory-utilization`` was 0.9 or more: lower it;
- **preemption storm**: many preemptions per request with the KV cache full: lower
  ``max-num-seqs`` or give the KV cache more memory.

And two the lab adds, since it records vLLM's own account of each TTFT and the host's CPU:

- **the API server sets TTFT**: vLLM's histograms put half its mean TTFT or more (0.1 s at least)
  outside its engine's queue and prefill, in the API server's one event loop (taking requests in,
  streaming tokens out): no engine flag helps, more API-server processes may;
- **a starved host**: a container's CPU quota stalled the run for more than 2% of its sending
  (vLLM's engine core, its API-server processes and the load generator share it, and a stall holds
  them all): the figures are the host's limit; fewer API-server processes, or more cores. Where
  it holds, the API server's finding is not made: more processes would starve the host more.

Input is one row of ``Store.runs()`` (a mapping), optionally with per-run sample aggregates
(``prompt_p50``, ``prompt_p99``); nothing here reads the store itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_lab import flags as flag_catalog
from vllm_lab.analysis.points import api_server_sets_ttft
from vllm_lab.summary import as_float, value
from vllm_lab.traffic.host_cpu import THROTTLED_SHARE_NOTED

# Per-run aggregates of the raw samples a caller may add to a row (not summary metrics).
SAMPLE_FIGURES = ("prompt_p50", "prompt_p99")
# Thresholds named once, so the report can say what triggered a finding.
GPU_UTIL_LOW = 80.0          # percent: the guide's "GPU utilization under 80%"
QUEUE_WAITING_MIN = 1.0      # mean requests waiting: the server had work it did not schedule
TTFT_SWING = 5.0             # TTFT p99 / p50: a latency swing
LONG_PROMPT_RATIO = 4.0      # prompt p99 / p50: a few long requests among short ones
HIGH_GPU_MEMORY = 0.90       # gpu-memory-utilization at or above this counts as high
PREEMPTIONS_PER_REQUEST = 0.1
KV_FULL = 0.95

# vLLM 0.26's defaults from the flag catalog, used when a run's serve flags leave a flag unset;
# the batch sizes are those vLLM picks on the large GPUs (70 GiB or more) the lab's presets name.
VLLM_DEFAULTS = flag_catalog.engine_defaults(
    flag_catalog.LARGE_GPU_GIB, names=("max-num-batched-tokens", "max-num-seqs",
                                       "gpu-memory-utilization", "long-prefill-token-threshold"))


@dataclass(frozen=True)
class Finding:
    """One troubleshooting finding: what, the numbers that triggered it, and the flags to try."""

    kind: str            # budget | batch-cap | long-prefill | oom | preemption-storm | api-server | starved-host
    title: str
    evidence: str        # the numbers, in a sentence
    advice: str          # what to change and why
    flags: dict[str, Any] = field(default_factory=dict)   # flag -> suggested value
    experiment_id: str = ""
    run_key: str = ""
    scenario_name: str = ""


def _num(row: Mapping[str, Any], key: str) -> float:
    """A figure of the row, NaN when missing or empty: a summary metric (checked against the
    catalog; from the run's decoded ``summary`` where the store keeps it in no column) or one of
    the per-run sample aggregates the caller added."""
    if key in SAMPLE_FIGURES:
        v = as_float(row.get(key))
        return math.nan if v is None else v
    found = value(row, key)
    summary = row.get("summary")
    return value(summary, key) if math.isnan(found) and isinstance(summary, Mapping) else found


def _clause(text: str, v: float) -> str:
    """``text`` with the figure ``v`` in it ({v} in the text), or nothing where the figure was not
    measured: a finding never prints a missing figure as nan."""
    return "" if math.isnan(v) else text.format(v=v)


def _scenario(row: Mapping[str, Any]) -> dict[str, Any]:
    """The run's recorded scenario as a plain mapping ({} where it has none)."""
    scenario = row.get("scenario")
    if scenario is None:
        try:
            scenario = json.loads(row.get("scenario_json") or "{}")
        except json.JSONDecodeError:
            scenario = {}
    return scenario if isinstance(scenario, Mapping) else {}


def serve_flags(row: Mapping[str, Any]) -> dict[str, Any]:
    """The serve flags the run used (from its recorded scenario), vLLM's defaults filled in."""
    return {**VLLM_DEFAULTS, **(_scenario(row).get("serve") or {})}


def _full_batch(row: Mapping[str, Any], seqs: int) -> str:
    """How the run shows its batch full at max-num-seqs, in words ("" where it does not): as many
    requests running as the cap allows (vLLM's gauge), or, where a run kept no such figure, a
    closed loop of more users than the cap."""
    running = _num(row, "running_max")
    if not math.isnan(running):
        return f"{running:.0f} running at most" if running >= seqs else ""
    load = _scenario(row).get("load") or {}
    users = as_float((load.get("shape") or {}).get("level"))
    closed = load.get("mode") == "closed" and users is not None and users > seqs
    return f"a closed loop of {users:.0f} users" if closed else ""


def _budget(row, flags) -> Finding | None:
    util, waiting = _num(row, "gpu_util_mean"), _num(row, "queue_len_mean")
    if not (util < GPU_UTIL_LOW and waiting >= QUEUE_WAITING_MIN) or _api_server_bound(row):
        return None  # an API server at its limit leaves the GPU idle whatever the budget
    budget, seqs = int(flags["max-num-batched-tokens"]), int(flags["max-num-seqs"])
    waits = (f"GPU utilization {util:.0f}% (< {GPU_UTIL_LOW:.0f}%) with {waiting:.1f} requests "
             f"waiting on average{_clause(' (max {v:.0f})', _num(row, 'queue_len_max'))}; output "
             + (_clause("{v:.0f} tok/s", _num(row, "output_throughput")) or "not measured"))
    full = _full_batch(row, seqs)
    if full:
        return Finding(
            "batch-cap", "Requests wait behind a full batch: max-num-seqs caps it",
            f"{waits} at max-num-seqs={seqs}, {full}",
            "vLLM schedules at most max-num-seqs requests at once, so the waiting ones wait for "
            "a slot, whatever the token budget: raise max-num-seqs (the KV cache permitting)",
            {"max-num-seqs": seqs * 2})
    return Finding(
        "budget", "Throughput below expectation: GPU under 80% busy while requests wait",
        f"{waits} at max-num-batched-tokens={budget}",
        "the token budget per step is too small to keep the GPU busy: raise max-num-batched-tokens",
        {"max-num-batched-tokens": budget * 2})


def _long_prefill(row, flags) -> Finding | None:
    p50, p99 = _num(row, "ttft_p50"), _num(row, "ttft_p99")
    if not (p50 > 0 and p99 / p50 >= TTFT_SWING):
        return None
    prompt50, prompt99 = _num(row, "prompt_p50"), _num(row, "prompt_p99")
    long_prompts = prompt50 > 0 and prompt99 / prompt50 >= LONG_PROMPT_RATIO
    queued = _num(row, "queue_len_max") >= QUEUE_WAITING_MIN
    if not (long_prompts or queued):
        return None
    budget = int(flags["max-num-batched-tokens"])
    threshold = int(flags.get("long-prefill-token-threshold") or 0)
    # Cap one prefill at a share of the step so short requests still get scheduled beside it.
    suggested = max(256, min(budget // 4, threshold // 2 if threshold else budget // 4))
    prompts = (f"; prompts p50 {prompt50:.0f} / p99 {prompt99:.0f} tokens" if long_prompts else "")
    return Finding(
        "long-prefill", "Latency swings: long requests block the queue",
        f"TTFT p99 {p99 * 1000:.0f} ms is {p99 / p50:.1f}x p50 {p50 * 1000:.0f} ms{prompts}"
        + _clause("; up to {v:.0f} requests waiting", _num(row, "queue_len_max")),
        "long prefills take whole steps: cap each one's chunk with long-prefill-token-threshold, "
        "so the short prompts behind it share the step's budget",
        {"long-prefill-token-threshold": suggested})


def _oom(row, flags) -> Finding | None:
    gmu = float(flags["gpu-memory-utilization"])
    if row.get("status") != "oom" or gmu < HIGH_GPU_MEMORY:
        return None
    error = str(row.get("error") or "").splitlines()
    cause = error[0][:160] if error else "out of memory"
    return Finding(
        "oom", "Out of memory at high gpu-memory-utilization",
        f"status oom with gpu-memory-utilization={gmu:g} (>= {HIGH_GPU_MEMORY:g}): {cause}",
        "leave room for activations, CUDA graphs and other processes: lower gpu-memory-utilization",
        {"gpu-memory-utilization": round(max(0.5, gmu - 0.05), 2)})


def _preemption_storm(row, flags) -> Finding | None:
    preemptions, requests = _num(row, "preemptions"), _num(row, "requests")
    kv = _num(row, "kv_usage_max")
    if not (requests > 0 and preemptions / requests >= PREEMPTIONS_PER_REQUEST and kv >= KV_FULL):
        return None
    seqs = int(flags["max-num-seqs"])
    gmu = float(flags["gpu-memory-utilization"])
    suggestion: dict[str, Any] = {"max-num-seqs": max(1, seqs // 2)}
    if gmu < 0.95:
        suggestion["gpu-memory-utilization"] = round(min(0.95, gmu + 0.05), 2)
    return Finding(
        "preemption-storm", "Preemption storm: the KV cache is full",
        f"{preemptions:.0f} preemptions over {requests:.0f} requests "
        f"({preemptions / requests:.2f} per request) with KV cache usage up to {kv:.0%}, "
        f"at max-num-seqs={seqs}, gpu-memory-utilization={gmu:g}",
        "too many sequences share the KV cache and get recomputed: lower max-num-seqs, "
        "or give the cache more memory",
        suggestion)


def _ttft_parts(row) -> tuple[float, float, float]:
    """vLLM's own account of the run's mean TTFT: whole, in its engine's queue, from scheduling
    to first token (seconds; NaN where the run kept none)."""
    return tuple(_num(row, k) for k in ("server_ttft_mean", "server_queue_mean",
                                        "server_prefill_mean"))


def _api_server_bound(row) -> bool:
    ttft, queue, prefill = _ttft_parts(row)
    return api_server_sets_ttft(ttft - queue - prefill, ttft)


def _api_server(row, flags) -> Finding | None:
    ttft, queue, prefill = _ttft_parts(row)
    hold = ttft - queue - prefill
    if not api_server_sets_ttft(hold, ttft) or _host_starved(row):
        return None
    processes = int(flags.get("api-server-count") or 1)
    cpu = _num(row, "server_api_cpu")
    return Finding(
        "api-server", "vLLM's API server sets TTFT",
        f"vLLM's /metrics put {hold * 1e3:,.0f} ms of its {ttft * 1e3:,.0f} ms "
        f"mean TTFT outside its engine ({queue * 1e3:,.0f} ms queued, {prefill * 1e3:,.0f} ms from "
        f"scheduling to first token), with "
        + (f"{processes} API-server processes" if processes > 1
           else "one API-server process" + _clause(" using {v:.2f} of a core", cpu)),
        "the API server takes requests in and streams every token out on one event loop a "
        "process; at its limit no engine flag shortens TTFT, and a run settles on that limit or "
        "the engine's by chance, so its TTFT repeats poorly: run more API-server processes, on a "
        "host with cores to spare for them",
        {"api-server-count": processes * 2})


def _host_starved(row) -> bool:
    stalled, span = _num(row, "client_host_throttled_s"), _num(row, "send_span_s")
    return span > 0 and stalled > THROTTLED_SHARE_NOTED * span


def _starved_host(row, flags) -> Finding | None:
    if not _host_starved(row):
        return None
    stalled, span = _num(row, "client_host_throttled_s"), _num(row, "send_span_s")
    processes = int(flags.get("api-server-count") or 1)
    cores, physical = _num(row, "client_host_cpus"), _num(row, "client_host_physical_cores")
    smt = _clause(" ({v:g} physical)", physical) if physical < cores else ""
    return Finding(
        "starved-host", "The host's CPU quota stalled the run",
        f"the quota{_clause(' of {v:g} cores', cores)}{smt} held the host's processes for {stalled:.1f} s "
        f"of {span:.0f} s of sending ({stalled / span:.0%}), with {processes} API-server "
        f"process{'es' if processes > 1 else ''}",
        "vLLM's engine core, its API-server processes and the load generator share the quota and "
        "a stall holds them all, so the figures are the host's limit, not the configuration's: "
        "give the container more cores, send the load from another host"
        + (", or run fewer API-server processes" if processes > 1 else ""),
        {"api-server-count": max(1, processes // 2)} if processes > 1 else {})


RULES = (_budget, _long_prefill, _oom, _preemption_storm, _api_server, _starved_host)


def findings(row: Mapping[str, Any]) -> list[Finding]:
    """The troubleshooting findings of one run (a row of ``Store.runs()``), worst first."""
    flags = serve_flags(row)
    out = []
    for rule in RULES:
        found = rule(row, flags)
        if found is not None:
            out.append(Finding(**{**found.__dict__,
                                  "experiment_id": str(row.get("experiment_id") or ""),
                                  "run_key": str(row.get("run_key") or ""),
                                  "scenario_name": str(row.get("scenario_name") or "")}))
    return out


def describe(finding: Finding) -> str:
    """One finding as two lines: what and its numbers, then the flags to try."""
    flags = " ".join(f"--{k} {v}" for k, v in finding.flags.items())
    todo = f"try: {flags} ({finding.advice})" if flags else finding.advice
    return f"{finding.title}: {finding.evidence}.\n    {todo}"
