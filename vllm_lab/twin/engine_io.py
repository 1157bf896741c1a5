"""What goes into the engine and comes out of it: a request as the engine core receives it, the
outputs of a step, a step's summary for the predictor, a run of pure-decode steps, the stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class EngineRequest:
    """One generation request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_after: int | None = None   # output length at which the simulated model emits EOS
    arrival_time: float = 0.0
    num_prompt_tokens: int | None = None   # twin-only: a length without ids; never hits the cache
    priority: int = 0                      # --scheduling-policy priority: smaller is served sooner


@dataclass
class RequestOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    queue_time_s: float | None = None   # queued to first scheduled, on the first output only
    scheduled_s: float | None = None    # when it was first scheduled (vLLM's scheduled_ts), idem


@dataclass
class StepResult:
    """One engine step: its modelled GPU time and what became visible at its end."""

    duration_s: float
    outputs: list[RequestOutput]
    num_scheduled_tokens: int
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_preempted: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass(slots=True)
class FinishedRequest:
    """A request that finished, with the counts the predictor books for it."""

    request_id: Any
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int


@dataclass(slots=True)
class StepSummary:
    """One step told in counts, not tokens: the predictor's cheaper view of ``step``."""

    duration_s: float
    num_decode_tokens: int
    num_prefill_tokens: int
    first_token_ids: list            # requests whose first token this step made
    first_scheduled: list            # (queued_ts, scheduled_ts) of each of them, as vLLM stamps them
    finished: list[FinishedRequest]


@dataclass(slots=True)
class DecodeRun:
    """Consecutive pure-decode steps computed in one go by ``Engine.fast_forward``."""

    step_times: np.ndarray           # each step's modelled duration, in order
    batch_size: int                  # requests decoding in every one of them
    finished: list[FinishedRequest]  # those that finished with the last step


@dataclass
class EngineStats:
    """The engine's gauges and counters, the numbers vLLM's /metrics shows."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_gpu_blocks: int
    block_size: int
    prompt_tokens_total: int
    generation_tokens_total: int
    gpu_utilization: float
    gpu_memory_used_bytes: int
    gpu_memory_total_bytes: int
    gpu_power_w: float = 0.0        # the power model's draw over the last second (all GPUs)
    gpu_energy_j: float = 0.0       # the power model's energy since the engine started (all GPUs)
