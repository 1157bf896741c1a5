"""A scheduler that steps like vLLM V1: continuous batching, chunked prefill, a paged KV cache,
preemption by recompute and prefix caching, priced step by step by ``steptime``.

The scheduling follows ``vllm/v1/core/sched/scheduler.py``: each step first gives the RUNNING
requests their tokens in order (one per decoding request, the next chunk to a prefilling one),
preempting the last running request when blocks run out; then, if nothing was preempted, admits
WAITING requests first-come-first-served while the token budget lasts and fewer than
max-num-seqs run. A preempted request loses its KV and goes back to the front of the queue.

Per-step work is O(changes), not O(running): decoding requests form a group whose counters
advance together from one global step count, and heaps say when each next needs a block or
finishes. ``step`` (the server's API) still reports every token of every request.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_lab.flags import engine_defaults
from vllm_lab.twin.kvcache import KVCache, block_hashes
from vllm_lab.twin.power import PowerModel
from vllm_lab.twin.profile import Profile
from vllm_lab.twin.steptime import StepTimeModel

GiB = 1024 ** 3
_WEIGHT_DTYPES = {"float32": (4, "fp32"), "float": (4, "fp32"), "float16": (2, "fp16"),
                  "half": (2, "fp16"), "bfloat16": (2, "bf16")}
_KV_DTYPES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "bfloat16": 2, "float16": 2,
              "half": 2}
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# The flags the engine reads; every other flag it is given changes nothing in it. Their defaults
# come from the flag catalog (vllm_lab.flags), the GPU-dependent ones sized for the profile's GPU.
ENGINE_FLAGS = frozenset({
    "max-num-seqs", "max-num-batched-tokens", "gpu-memory-utilization", "block-size",
    "max-model-len", "enforce-eager", "dtype", "kv-cache-dtype", "tensor-parallel-size",
    "enable-prefix-caching", "long-prefill-token-threshold", "num-gpu-blocks-override",
    "async-scheduling",
})
WAITING, RUNNING, FINISHED = 0, 1, 2


class EngineStartError(Exception):
    """vLLM would refuse to start: ``cause`` is "oom" or "refused-flag", ``message`` vLLM's words."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause
        self.message = message


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


@dataclass
class MemoryPlan:
    """How vLLM splits GPU memory at start-up (per GPU)."""

    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    num_gpu_blocks: int


@dataclass
class EngineConfig:
    """The flags the engine reads, resolved against vLLM's defaults."""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    block_size: int
    max_model_len: int
    enforce_eager: bool
    weight_bytes: int
    peak_key: str
    kv_bytes: int
    tensor_parallel_size: int
    enable_prefix_caching: bool
    long_prefill_token_threshold: int
    num_gpu_blocks_override: int | None
    # vLLM 0.26 schedules step N+1 while step N runs unless an incompatible option turns it off
    # (config/vllm.py: async_scheduling None -> True); --no-async-scheduling plans each step after
    # the previous one ends.
    async_scheduling: bool = True
    raw: dict[str, Any] = field(default_factory=dict)


def _norm_key(key: str) -> str:
    return key.lstrip("-").replace("_", "-")


def resolve_flags(flags: dict[str, Any], profile: Profile, model) -> EngineConfig:
    """Merge ``flags`` over vLLM's defaults for this GPU and check them as vLLM would."""
    defaults = engine_defaults(profile.hardware.memory_gib, profile.hardware.name, ENGINE_FLAGS)
    merged = {**defaults, **{_norm_key(k): v for k, v in flags.items()}}

    def refuse(msg: str):
        raise EngineStartError("refused-flag", msg)

    dtype = str(merged["dtype"] or "auto")
    dtype_name = model.torch_dtype if dtype == "auto" else dtype
    dtype_name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype_name, dtype_name)
    if dtype_name not in _WEIGHT_DTYPES:
        refuse(f"argument --dtype: invalid choice: '{dtype}' (choose from 'auto', 'bfloat16', "
               f"'float', 'float16', 'float32', 'half')")
    weight_bytes, peak_key = _WEIGHT_DTYPES[dtype_name]
    kv_dtype = str(merged["kv-cache-dtype"] or "auto")
    if kv_dtype == "auto":
        kv_bytes = weight_bytes
    elif kv_dtype in _KV_DTYPES:
        kv_bytes = _KV_DTYPES[kv_dtype]
    else:
        refuse(f"argument --kv-cache-dtype: invalid choice: '{kv_dtype}'")
    block_size = int(merged["block-size"])
    if block_size not in _BLOCK_SIZES:
        refuse(f"argument --block-size: invalid choice: {block_size} (choose from "
               f"{', '.join(map(str, _BLOCK_SIZES))})")
    util = float(merged["gpu-memory-utilization"])
    if not 0 < util <= 1:
        refuse(f"1 validation error for CacheConfig\ngpu_memory_utilization\n  Input should be "
               f"{'greater than 0' if util <= 0 else 'less than or equal to 1'} "
               f"[type=greater_than, input_value={util}]")
    tp = int(merged["tensor-parallel-size"])
    if tp < 1:
        refuse(f"tensor_parallel_size must be at least 1, got {tp}")
    if model.num_heads % tp:
        refuse(f"Total number of attention heads ({model.num_heads}) must be divisible by tensor "
               f"parallel size ({tp}).")
    if tp > profile.hardware.gpu_count:
        refuse(f"World size ({tp}) is larger than the number of available GPUs "
               f"({profile.hardware.gpu_count}) in this node.")
    derived = model.max_position_embeddings
    max_model_len = merged.get("max-model-len")
    if max_model_len is None:
        max_model_len = derived
    max_model_len = int(max_model_len)
    if max_model_len > derived:
        refuse(f"User-specified max_model_len ({max_model_len}) is greater than the derived "
               f"max_model_len (max_position_embeddings={derived} or model_max_length=None in "
               f"model's config.json). To allow overriding this maximum, set the env var "
               f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
    if max_model_len < 1:
        refuse(f"max_model_len must be at least 1, got {max_model_len}")
    seqs = int(merged["max-num-seqs"])
    mnbt = int(merged["max-num-batched-tokens"])
    if seqs < 1 or mnbt < 1:
        refuse("max_num_seqs and max_num_batched_tokens must be at least 1")
    if mnbt < seqs:
        refuse(f"max_num_batched_tokens ({mnbt}) must be greater than or equal to max_num_seqs "
               f"({seqs}).")
    override = merged.get("num-gpu-blocks-override")
    return EngineConfig(
        max_num_seqs=seqs, max_num_batched_tokens=mnbt, gpu_memory_utilization=util,
        block_size=block_size, max_model_len=max_model_len,
        enforce_eager=bool(merged["enforce-eager"]), weight_bytes=weight_bytes, peak_key=peak_key,
        kv_bytes=kv_bytes, tensor_parallel_size=tp,
        enable_prefix_caching=bool(merged["enable-prefix-caching"]),
        long_prefill_token_threshold=int(merged.get("long-prefill-token-threshold") or 0),
        async_scheduling=merged.get("async-scheduling") is not False,
        num_gpu_blocks_override=int(override) if override else None, raw=merged)


def plan_memory(cfg: EngineConfig, profile: Profile, model) -> MemoryPlan:
    """Split one GPU's memory as vLLM's profiling run does, or raise where vLLM would not start."""
    hw, co = profile.hardware, profile.coefficients
    tp = cfg.tensor_parallel_size
    total = int(hw.memory_gib * GiB)
    requested = int(total * cfg.gpu_memory_utilization)
    weights = model.num_params * cfg.weight_bytes // tp
    # The profiling run's peak: one max-num-batched-tokens forward (MLP intermediates dominate)
    # plus the sampler's fp32 logits for max-num-seqs sequences.
    act = cfg.max_num_batched_tokens * (3 * model.intermediate_size + 4 * model.hidden_size)
    act = act * cfg.weight_bytes // tp + cfg.max_num_seqs * model.vocab_size * 4 // tp
    graphs = 0 if cfg.enforce_eager else int(co.cuda_graph_memory_gib * GiB)
    non_torch = int(co.non_torch_memory_gib * GiB)
    per_token = model.kv_bytes_per_token(cfg.kv_bytes) // tp
    if weights > total - non_torch:
        raise EngineStartError("oom", (
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{min(weights, 2 * GiB) / 2**20:.2f} MiB. GPU 0 has a total capacity of "
            f"{total / GiB:.2f} GiB of which {max(total - non_torch - weights, 0) / 2**20:.2f} MiB "
            f"is free. Failed to load model - not enough GPU memory."))
    kv = requested - weights - act - graphs - non_torch
    if kv <= 0:
        raise EngineStartError("oom", "No available memory for the cache blocks. Try increasing "
                                      "`gpu_memory_utilization` when initializing the engine.")
    blocks = kv // (per_token * cfg.block_size)
    if cfg.num_gpu_blocks_override:
        blocks = cfg.num_gpu_blocks_override
    need = cfg.max_model_len * per_token
    if blocks * cfg.block_size < cfg.max_model_len:
        est = blocks * cfg.block_size
        raise EngineStartError("oom", (
            f"To serve at least one request with the models's max seq len ({cfg.max_model_len}), "
            f"({need / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({kv / GiB:.2f} GiB). Based on the available memory, the estimated maximum "
            f"model length is {est}. Try increasing `gpu_memory_utilization` or decreasing "
            f"`max_model_len` when initializing the engine."))
    return MemoryPlan(total, requested, weights, act, graphs, non_torch, kv, per_token, int(blocks))


class _Req:
    """The engine's view of one request (counters are lazy while it decodes in the group)."""

    __slots__ = (
        "anon",
        "arrival",
        "cached_tokens",
        "cepoch",
        "eligible",
        "fepoch",
        "first_sched",
        "g0",
        "hashed",
        "hashes",
        "id",
        "in_group",
        "n_promoted",
        "num_computed",
        "num_prompt",
        "num_tokens",
        "preemptions",
        "queued",
        "reason",
        "seed",
        "state",
        "t0",
        "target",
    )

    def __init__(self, rid, hashes, num_prompt, target, reason, arrival, seed):
        self.id, self.hashes, self.num_prompt = rid, hashes, num_prompt
        self.target, self.reason, self.arrival, self.seed = target, reason, arrival, seed
        self.state = WAITING
        self.num_computed = 0
        self.num_tokens = num_prompt
        self.hashed: list[int] = []
        self.anon = 0
        self.n_promoted = 0
        self.in_group = False
        self.g0 = self.t0 = self.fepoch = self.cepoch = 0
        self.cached_tokens = 0
        self.first_sched: float | None = None
        self.queued = arrival           # vLLM's queued_ts: when the engine core took it in
        self.eligible = 0               # the first step (Engine.steps) it may be scheduled in
        self.preemptions = 0


def _finished(r: _Req) -> FinishedRequest:
    return FinishedRequest(r.id, r.num_prompt, r.num_tokens - r.num_prompt, r.cached_tokens,
                           r.preemptions)


class Engine:
    """vLLM V1's engine core as a simulation: add requests, step, read outputs and stats."""

    def __init__(self, cfg: EngineConfig, profile: Profile, model, memory: MemoryPlan):
        self.cfg, self.profile, self.model, self.memory = cfg, profile, model, memory
        self.block_size = bs = cfg.block_size
        self.kv = KVCache(memory.num_gpu_blocks, bs, cfg.enable_prefix_caching)
        graph_max = min(profile.coefficients.cuda_graph_max_tokens, 2 * cfg.max_num_seqs)
        self.stm = StepTimeModel(profile, model, cfg.weight_bytes, cfg.kv_bytes,
                                 cfg.tensor_parallel_size, cfg.enforce_eager, bs, graph_max,
                                 cfg.peak_key)
        self.running: list[_Req] = []
        self.waiting: deque[_Req] = deque()
        self.partials: list[_Req] = []          # running requests still prefilling, in order
        self.reqs: dict[str, _Req] = {}
        self.G = 0                               # decode steps the group has taken
        self.B = 0                               # requests in the decoding group
        self.S = 0                               # their context lengths, summed
        self._fin: list = []                     # (group step at which it finishes, n, req, fepoch)
        self._cross: list = []                   # (group step needing a new block, n, req, cepoch)
        self._n = 0
        self.num_preemptions = 0
        self.prefix_queries = self.prefix_hits = 0
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.busy_s = 0.0
        # The simulated GPUs' energy (twin/power.py): each step's at its compute share, the time
        # between steps at the idle power, counted from ``origin`` (the live server sets its start).
        self.power = PowerModel.of(profile.hardware)
        self.busy_energy_j = 0.0
        self.origin = 0.0
        self.clock = 0.0
        self.steps = 0                           # steps run so far: the next step's index
        self._last_step = (-math.inf, -math.inf)  # (start, end) of the last step run
        self._recent: deque[tuple[float, float, float]] = deque()
        self._vocab = max(2, min(model.vocab_size, 32000))

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_flags(cls, flags: dict[str, Any], profile: Profile, model) -> Engine:
        """Build an engine as ``vllm serve`` would with these flags, or raise EngineStartError."""
        cfg = resolve_flags(flags, profile, model)
        return cls(cfg, profile, model, plan_memory(cfg, profile, model))

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds (vLLM's "GPU KV cache size: N tokens")."""
        return self.kv.num_blocks * self.block_size

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have."""
        return self.cfg.max_model_len

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; ValueError for a duplicate id or a prompt the model cannot take."""
        if req.request_id in self.reqs:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        ids = req.prompt_token_ids
        n = len(ids) if ids else int(req.num_prompt_tokens or 0)
        if n < 1:
            raise ValueError("The prompt cannot be empty.")
        if n >= self.cfg.max_model_len:
            raise ValueError(f"The decoder prompt (length {n}) is longer than the maximum model "
                             f"length of {self.cfg.max_model_len}. Make sure that `max_model_len` "
                             f"is no smaller than the number of text tokens.")
        target, reason = max(1, int(req.max_tokens)), "length"
        if not req.ignore_eos and req.eos_after is not None:
            eos = max(int(req.eos_after), int(req.min_tokens), 1)
            if eos <= target:
                target, reason = eos, "stop"
        room = self.cfg.max_model_len - n
        if room < target:
            target, reason = room, "length"
        hashes = (block_hashes(ids, self.block_size)
                  if ids and self.cfg.enable_prefix_caching else None)
        self._n += 1
        r = _Req(req.request_id, hashes, n, target, reason, req.arrival_time, self._n * 2654435761)
        # The engine core takes requests in between steps: vLLM's queue time starts then, not when
        # the request reached its socket. Under async scheduling the next step was planned while
        # the last one ran, so a request taken in while work is in flight can join the step after.
        r.queued = max(req.arrival_time, self.clock)
        if self.cfg.async_scheduling and self.running:
            r.eligible = self.steps + 1
        else:
            r.eligible = self.steps
        self.reqs[req.request_id] = r
        self.waiting.append(r)
        self.prompt_tokens_total += n

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is; unknown ids are ignored, as in vLLM."""
        r = self.reqs.pop(request_id, None)
        if r is None:
            return
        if r.state == WAITING:
            self.waiting.remove(r)
        elif r.state == RUNNING:
            self._remove_running(r)
        r.state = FINISHED

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.reqs)

    def reset_prefix_cache(self) -> bool:
        """Forget cached blocks; False while requests hold blocks, as vLLM answers."""
        return self.kv.reset()

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use now (vLLM's kv_cache_usage_perc)."""
        return self.kv.usage

    # -- the decoding group ------------------------------------------------------------------
    def _join(self, r: _Req) -> None:
        r.in_group = True
        r.g0, r.t0 = self.G, r.num_tokens
        self.B += 1
        self.S += r.num_tokens
        r.fepoch += 1
        r.cepoch += 1
        self._n += 1
        heapq.heappush(self._fin, (self.G + r.target - (r.num_tokens - r.num_prompt), self._n, r,
                                   r.fepoch))
        blocks = len(r.hashed) + r.anon
        heapq.heappush(self._cross, (blocks * self.block_size + 1 - r.t0 + r.g0, self._n, r,
                                     r.cepoch))

    def _leave(self, r: _Req) -> None:
        n = r.t0 + self.G - r.g0
        r.num_tokens, r.num_computed = n, n - 1
        self.B -= 1
        self.S -= n
        r.in_group = False
        r.fepoch += 1
        r.cepoch += 1

    def _tokens(self, r: _Req) -> int:
        return r.t0 + self.G - r.g0 if r.in_group else r.num_tokens

    def _remove_running(self, r: _Req) -> None:
        if r.in_group:
            self._leave(r)
        else:
            self.partials.remove(r)
        self.running.remove(r)
        self.kv.release(r.anon, r.hashed)
        r.anon, r.hashed, r.n_promoted = 0, [], 0

    def _preempt(self, r: _Req) -> None:
        self._remove_running(r)
        r.num_computed = 0
        r.state = WAITING
        r.preemptions += 1
        self.waiting.appendleft(r)
        self.num_preemptions += 1

    # -- one step ----------------------------------------------------------------------------
    def _chunk(self, r: _Req, budget: int) -> int:
        n = r.num_tokens - r.num_computed
        thr = self.cfg.long_prefill_token_threshold
        if 0 < thr < n:
            n = thr
        return min(budget, n)

    def _schedule(self, now: float):
        """Pick this step's work; returns (decoders or None, chunks, preempted count)."""
        bs, kv = self.block_size, self.kv
        budget = self.cfg.max_num_batched_tokens
        due = []
        cross = self._cross
        G = self.G
        while cross and cross[0][0] <= G:
            e = heapq.heappop(cross)
            if e[2].in_group and e[3] == e[2].cepoch:
                due.append(e)
        demand = self.B
        need = len(due)
        plans = []
        for r in self.partials:
            q = self._chunk(r, 1 << 62)
            demand += q
            need += -(-(r.num_computed + q) // bs) - len(r.hashed) - r.anon
            plans.append((r, q))
        chunks: list[tuple[_Req, int, int]] = []
        paused: list[_Req] = []
        preempted = 0
        if demand <= budget and need <= kv.num_free:
            kv.take(need)
            for e in due:
                r = e[2]
                r.anon += 1
                heapq.heappush(cross, (e[0] + bs, e[1], r, e[3]))
            for r, q in plans:
                r.anon += -(-(r.num_computed + q) // bs) - len(r.hashed) - r.anon
                chunks.append((r, q, r.num_computed))
            budget -= demand
        else:
            for e in due:
                heapq.heappush(cross, e)
            budget, preempted = self._schedule_running_exact(budget, chunks, paused)
        if not preempted:
            self._admit(now, budget, chunks)
        return chunks, paused, preempted

    def _schedule_running_exact(self, budget, chunks, paused):
        """vLLM's RUNNING loop request by request, preempting the last request when blocks run out."""
        bs, kv, running = self.block_size, self.kv, self.running
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if r.in_group:
                q = 1
                need = -(-self._tokens(r) // bs) - len(r.hashed) - r.anon
            else:
                q = self._chunk(r, budget)
                need = -(-(r.num_computed + q) // bs) - len(r.hashed) - r.anon
            ok = True
            while not kv.take(need):
                victim = running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            r.anon += need
            if r.in_group:
                if need:
                    r.cepoch += 1
                    self._n += 1
                    blocks = len(r.hashed) + r.anon
                    heapq.heappush(self._cross, (blocks * bs + 1 - r.t0 + r.g0, self._n, r,
                                                 r.cepoch))
            else:
                chunks.append((r, q, r.num_computed))
            budget -= q
            i += 1
        for r in running[i:]:
            if r.in_group:
                self._leave(r)      # not scheduled this step: its counters must not advance
                paused.append(r)
        return budget, preempted

    def _admit(self, now: float, budget: int, chunks) -> None:
        """vLLM's WAITING loop: first come first served while budget, seats and blocks last."""
        bs, kv, cfg = self.block_size, self.kv, self.cfg
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting[0]
            if r.eligible > self.steps and (running or chunks):
                break   # async: this step was planned before the request came in
            hits = evictable = 0
            if r.hashes:
                hits, evictable = kv.lookup(r.hashes, (r.num_tokens - 1) // bs)
            computed = hits * bs
            r.num_computed = computed
            q = self._chunk(r, budget)
            need = -(-(computed + q) // bs) - hits
            if need > kv.num_free - evictable:
                r.num_computed = 0
                break
            if hits:
                kv.acquire(r.hashes[:hits])
            kv.take(need)
            r.hashed, r.anon, r.n_promoted = list(r.hashes[:hits]) if hits else [], need, hits
            if cfg.enable_prefix_caching:
                self.prefix_queries += r.num_tokens
                self.prefix_hits += computed
            if r.first_sched is None:
                # Async scheduling plans a step while the one before it runs: the request was
                # scheduled when that one started (or when it was taken in, if later).
                start, end = self._last_step
                r.first_sched = (max(start, r.queued) if cfg.async_scheduling and end >= now
                                 else now)
                r.cached_tokens = computed
            waiting.popleft()
            r.state = RUNNING
            running.append(r)
            self.partials.append(r)
            chunks.append((r, q, computed))
            budget -= q

    def _finish_chunks(self, chunks, first, finished) -> None:
        """Advance prefilling requests by their chunk; those done sample their next token."""
        kv, bs = self.kv, self.block_size
        for r, q, _c in chunks:
            if r.state != RUNNING or r.in_group:
                continue
            r.num_computed += q
            if r.hashes:
                full = min(r.num_computed // bs, len(r.hashes))
                for j in range(r.n_promoted, full):
                    h = r.hashes[j]
                    if kv.promote(h):
                        r.hashed.append(h)
                        r.anon -= 1
                r.n_promoted = max(r.n_promoted, full)
            if r.num_computed == r.num_tokens:
                r.num_tokens += 1
                out = r.num_tokens - r.num_prompt
                self.generation_tokens_total += 1
                if out == 1:
                    first.append(r)
                if out >= r.target:
                    finished.append(r)
                    self._finish(r)
                else:
                    self.partials.remove(r)
                    self._join(r)

    def _finish(self, r: _Req) -> None:
        self._remove_running(r)
        r.state = FINISHED
        self.reqs.pop(r.id, None)

    def _pop_finished(self, finished) -> None:
        fin, G = self._fin, self.G
        while fin and fin[0][0] <= G:
            _k, _n, r, ep = heapq.heappop(fin)
            if r.in_group and ep == r.fepoch:
                finished.append(r)
                self._finish(r)

    def _price(self, B: int, S: int, chunks) -> tuple[float, int, int]:
        tokens, pairs, kv_tokens, sampled = B, float(S), S, B
        for r, q, c in chunks:
            tokens += q
            pairs += q * (c + (q + 1) / 2)
            kv_tokens += c + q
            if c + q == r.num_tokens:
                sampled += 1
        return self.stm.step_time(tokens, B + len(chunks), sampled, pairs, kv_tokens), tokens, sampled

    def _run_step(self, now: float, collect: bool):
        chunks, paused, preempted = self._schedule(now)
        B, S = self.B, self.S
        decoders = [r for r in self.running if r.in_group] if collect and B else None
        if not chunks and not B:
            for r in paused:
                self._join(r)
            return 0.0, 0, [], [], decoders, preempted, chunks
        dur, tokens, _sampled = self._price(B, S, chunks)
        if B:
            self.G += 1
            self.S += B
            self.generation_tokens_total += B
        first: list[_Req] = []
        finished: list[_Req] = []
        self._finish_chunks(chunks, first, finished)
        self._pop_finished(finished)
        for r in paused:
            if r.state == RUNNING:
                self._join(r)
        self._account(now, dur, self.stm.compute_share(tokens, dur))
        self.steps += 1
        self._last_step = (now, now + dur)
        return dur, tokens, first, finished, decoders, preempted, chunks

    def _account(self, now: float, dur: float, compute_share: float) -> None:
        self.busy_s += dur
        watts = self.power.busy_w(compute_share) * self.cfg.tensor_parallel_size
        self.busy_energy_j += dur * watts
        end = now + dur
        self.clock = max(self.clock, end)
        rec = self._recent
        rec.append((now, end, watts))
        while rec and rec[0][1] < end - 1.0:
            rec.popleft()

    def energy_j(self, now: float) -> float:
        """The simulated GPUs' energy from ``origin`` to ``now``: busy steps plus idle time."""
        idle = max(0.0, now - self.origin - self.busy_s)
        return self.busy_energy_j + idle * self.power.idle_w * self.cfg.tensor_parallel_size

    def step(self, now: float) -> StepResult:
        """Schedule and run one step starting at ``now``; outputs become visible at now + duration."""
        self.clock = max(self.clock, now)
        dur, tokens, first, finished, decoders, preempted, chunks = self._run_step(now, True)
        outputs: dict[str, RequestOutput] = {}
        first_ids = {id(r) for r in first}

        def emit(r: _Req) -> None:
            out = self._tokens(r) - r.num_prompt
            tok = (r.seed + out * 40503) % self._vocab
            sched = r.first_sched if id(r) in first_ids else None
            queue = sched - r.queued if sched is not None else None
            done = r.state == FINISHED
            outputs[r.id] = RequestOutput(r.id, [tok], done, r.reason if done else None,
                                          r.num_prompt, out, r.cached_tokens, queue, sched)

        for r in decoders or ():
            emit(r)
        for r, _q, _c in chunks:
            if r.num_tokens > r.num_computed and r.id not in outputs and (
                    r.in_group or r.state == FINISHED) and r.num_computed + 1 == r.num_tokens:
                emit(r)
        for r in finished:
            if r.id not in outputs:
                emit(r)
        n_prefill = sum(q for _r, q, _c in chunks)
        return StepResult(dur, list(outputs.values()), tokens, tokens - n_prefill, n_prefill,
                          preempted, len(self.running), len(self.waiting), self.kv.usage)

    # -- the predictor's API: counts instead of tokens, and a fast path ------------------------
    def step_summary(self, now: float) -> StepSummary:
        """Schedule and run one step starting at ``now`` as ``step`` does, reporting counts only."""
        dur, tokens, first, finished, _d, _p, chunks = self._run_step(now, False)
        n_prefill = sum(q for _r, q, _c in chunks)
        return StepSummary(dur, tokens - n_prefill, n_prefill, [r.id for r in first],
                           [(r.queued, r.first_sched) for r in first],
                           [_finished(r) for r in finished])

    def fast_forward(self, now: float, horizon: float, max_steps: int = 4096) -> DecodeRun | None:
        """Run consecutive pure-decode steps in one computation while nothing else can happen.

        Nothing can change while no request prefills, no waiting request can be admitted, no
        request finishes and the free blocks cover every block the group may need. Stops at the
        step during which ``horizon`` (the next arrival) passes. None when no such run of two or
        more steps exists now: then ``step_summary`` (or ``step``) takes the next step.
        """
        B = self.B
        if not B or self.partials or B > self.cfg.max_num_batched_tokens:
            return None
        if self.waiting and len(self.running) < self.cfg.max_num_seqs:
            return None
        fin = self._fin
        while fin and not (fin[0][2].in_group and fin[0][3] == fin[0][2].fepoch):
            heapq.heappop(fin)
        bs = self.block_size
        k = min(max_steps, fin[0][0] - self.G if fin else max_steps,
                (self.kv.num_free // B) * bs)
        if k < 2:
            return None
        times = self.stm.decode_times(B, self.S, k)
        if horizon < math.inf:
            cum = np.cumsum(times)
            k = min(k, int(np.searchsorted(cum, horizon - now)) + 1)
            times = times[:k]
        last = self.G + k - 1
        cross, kv = self._cross, self.kv
        while cross and cross[0][0] <= last:
            K, n, r, ep = heapq.heappop(cross)
            if not (r.in_group and ep == r.cepoch):
                continue
            c = 1 + (last - K) // bs
            kv.take(c)
            r.anon += c
            heapq.heappush(cross, (K + c * bs, n, r, ep))
        self.G += k
        self.S += B * k
        self.generation_tokens_total += B * k
        finished: list[_Req] = []
        self._pop_finished(finished)
        total = float(times.sum())
        self._account(now, total, self.stm.compute_share(B, total / k))
        self.steps += k
        self._last_step = (now + total - float(times[-1]), now + total)
        return DecodeRun(times, B, [_finished(r) for r in finished])

    # -- stats -------------------------------------------------------------------------------
    def gpu_utilization(self, now: float | None = None, window_s: float = 1.0) -> float:
        """Share of the last ``window_s`` seconds the GPU was busy, as nvidia-smi samples it."""
        end = self.clock if now is None else now
        start = end - window_s
        busy = 0.0
        for a, b, _w in self._recent:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                busy += hi - lo
        return min(1.0, busy / window_s)

    def gpu_power_w(self, now: float | None = None, window_s: float = 1.0) -> float:
        """The power model's mean draw over the last ``window_s`` seconds, every GPU's together."""
        end = self.clock if now is None else now
        start = end - window_s
        busy = energy = 0.0
        for a, b, w in self._recent:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                busy += hi - lo
                energy += (hi - lo) * w
        idle = max(0.0, window_s - busy) * self.power.idle_w * self.cfg.tensor_parallel_size
        return (energy + idle) / window_s

    @property
    def stats(self) -> EngineStats:
        """Gauges and counters now (utilization over the second before the latest step's end)."""
        return self.stats_at(None)

    def stats_at(self, now: float | None) -> EngineStats:
        """The stats with GPU utilization over the second before ``now``."""
        m = self.memory
        used = m.weights_bytes + m.activation_bytes + m.cuda_graph_bytes + m.non_torch_bytes
        used += self.kv.num_blocks * self.block_size * m.kv_bytes_per_token
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions_total=self.num_preemptions,
            prefix_cache_queries=self.prefix_queries, prefix_cache_hits=self.prefix_hits,
            num_gpu_blocks=self.kv.num_blocks, block_size=self.block_size,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            gpu_utilization=self.gpu_utilization(now), gpu_memory_used_bytes=int(used),
            gpu_memory_total_bytes=m.total_bytes, gpu_power_w=self.gpu_power_w(now),
            gpu_energy_j=self.energy_j(self.clock if now is None else now))
