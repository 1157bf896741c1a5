"""A scheduler that steps like vLLM V1: continuous batching, chunked prefill, a paged KV cache,
preemption by recompute and prefix caching, priced step by step by ``steptime``.

The scheduling follows ``vllm/v1/core/sched/scheduler.py``: each step first gives the RUNNING
requests their tokens in order (one per decoding request, the next chunk to a prefilling one),
preempting a running request when blocks run out (the last scheduled; under --scheduling-policy
priority the largest (priority, arrival)); then, if nothing was preempted, admits WAITING requests
in the queue's order (arrival, or (priority, arrival)) while the token budget lasts and fewer than
max-num-seqs run. A preempted request loses its KV and goes back to the queue (at its front under
fcfs). Prompt blocks pushed out of the GPU's prefix cache may come back from a host tier
(--kv-offloading-size) over the host link.

Per-step work is O(changes), not O(running): decoding requests form a group whose counters
advance together from one global step count, and heaps say when each next needs a block or
finishes. ``step`` (the server's API) still reports every token of every request.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm_lab.twin.engine_config import (
    ENGINE_FLAGS,
    ONLINE_QUANTIZATION,
    EngineConfig,
    EngineStartError,
    MemoryPlan,
    plan_memory,
    resolve_flags,
)
from vllm_lab.twin.engine_io import (
    DecodeRun,
    EngineRequest,
    EngineStats,
    FinishedRequest,
    RequestOutput,
    StepResult,
    StepSummary,
)
from vllm_lab.twin.kvcache import HostTier, KVCache, block_hashes
from vllm_lab.twin.power import PowerModel
from vllm_lab.twin.profile import Profile
from vllm_lab.twin.request_queue import request_queue
from vllm_lab.twin.steptime import StepTimeModel, chunk_pairs

# The engine's API is this module's: its configuration (engine_config) and its inputs and outputs
# (engine_io) are imported from here by the predictor, the server and the tests.
__all__ = ["ENGINE_FLAGS", "DecodeRun", "Engine", "EngineConfig", "EngineRequest", "EngineStartError",
           "EngineStats", "FinishedRequest", "MemoryPlan", "RequestOutput", "StepResult",
           "StepSummary", "plan_memory", "resolve_flags"]

WAITING, RUNNING, FINISHED = 0, 1, 2


class _Req:
    """The engine's view of one request (counters are lazy while it decodes in the group)."""

    __slots__ = ("anon", "arrival", "cached_tokens", "cepoch", "eligible", "fepoch",
                 "first_sched", "g0", "hashed", "hashes", "id", "in_group", "n_promoted",
                 "num_computed", "num_prompt", "num_tokens", "preemptions", "priority", "queued",
                 "reason", "seed", "state", "t0", "target")

    def __init__(self, rid, hashes, num_prompt, target, reason, arrival, seed, priority=0):
        self.id, self.hashes, self.num_prompt = rid, hashes, num_prompt
        self.priority = priority
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
                                 cfg.peak_key, fp8_linear=cfg.quantization == ONLINE_QUANTIZATION,
                                 offload_bytes=cfg.cpu_offload_bytes)
        # --kv-offloading-size: a host tier of blocks (all GPUs' shares together), and the time a
        # block takes over the host link, each GPU loading its share at once.
        block_bytes = model.kv_bytes_per_token(cfg.kv_bytes) * bs
        self.host = HostTier(cfg.kv_offloading_bytes // block_bytes)
        self.block_load_s = block_bytes / cfg.tensor_parallel_size / self.stm.host_link
        self._load_s = 0.0                       # this step's loads from the host tier
        self.running: list[_Req] = []
        self.waiting = request_queue(cfg.scheduling_policy)
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
        self.busy_s = 0.0                        # seconds the engine stepped
        self.kernel_s = 0.0                      # of them, seconds the GPU ran kernels
        # The simulated GPUs' energy (twin/power.py): each step's kernels at their compute share,
        # the rest of a step and the time between steps at the idle power, counted from ``origin``
        # (the live server sets its start).
        self.power = PowerModel.of(profile.hardware)
        self.busy_energy_j = 0.0
        # Each step's (start, seconds, kernel seconds, compute share), where asked for (the
        # predictor): its run's energy counter is read from it (``PowerModel.counter``), and a
        # power model's figures are fitted on it (twin/power.py, ``fit``).
        self.step_log: list[tuple[float, float, float, float]] | None = None
        self.origin = 0.0
        self.clock = 0.0
        self.steps = 0                           # steps run so far: the next step's index
        self._last_step = (-math.inf, -math.inf)  # (start, end) of the last step run
        self._recent: deque[tuple[float, float, float, float]] = deque()  # start, end, W, kernel share
        self._vocab = max(2, min(model.vocab_size, 32000))

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_flags(cls, flags: dict[str, Any], profile: Profile, model,
                   environ: Mapping[str, str] | None = None) -> Engine:
        """Build an engine as ``vllm serve`` would with these flags (and ``environ``, the
        server's environment), or raise EngineStartError."""
        cfg = resolve_flags(flags, profile, model, environ)
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
        r = _Req(req.request_id, hashes, n, target, reason, req.arrival_time, self._n * 2654435761,
                 int(req.priority))
        # The engine core takes requests in between steps: vLLM's queue time starts then, not when
        # the request reached its socket. Under async scheduling the next step was planned while
        # the last one ran, so a request taken in while work is in flight can join the step after.
        r.queued = max(req.arrival_time, self.clock)
        if self.cfg.async_scheduling and self.running:
            r.eligible = self.steps + 1
        else:
            r.eligible = self.steps
        self.reqs[req.request_id] = r
        self.waiting.push(r)
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
        self.waiting.push_front(r)
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
        """vLLM's RUNNING loop request by request, preempting the policy's victim when blocks run out."""
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
                victim = self._victim()
                at = running.index(victim)
                if at < i:
                    # Under the priority policy the victim may have its tokens in this step
                    # already: vLLM gives them back to the budget.
                    budget += self._unschedule(victim, chunks)
                    i -= 1
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

    def _victim(self) -> _Req:
        """The running request vLLM preempts when blocks run out: the last scheduled (fcfs), or
        the largest (priority, arrival) among all running (priority)."""
        if self.cfg.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    @staticmethod
    def _unschedule(r: _Req, chunks) -> int:
        """Take ``r``'s work out of this step; the tokens it had (1 for a decode)."""
        for k, (c, q, _computed) in enumerate(chunks):
            if c is r:
                del chunks[k]
                return q
        return 1

    def _admit(self, now: float, budget: int, chunks) -> None:
        """vLLM's WAITING loop, in the queue's order, while budget, seats and blocks last."""
        bs, kv, cfg = self.block_size, self.kv, self.cfg
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting.peek()
            if r.eligible > self.steps and (running or chunks):
                break   # async: this step was planned before the request came in
            hits = evictable = loaded = 0
            if r.hashes:
                most = (r.num_tokens - 1) // bs
                hits, evictable = kv.lookup(r.hashes, most)
                loaded = self.host.lookup(r.hashes[hits:most]) if self.host.capacity else 0
            computed = (hits + loaded) * bs
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
            # Blocks found in the host tier come over the host link instead of being computed
            # (vLLM loads them before the request's first chunk; priced within this step).
            self._load_s += loaded * self.block_load_s
            if cfg.enable_prefix_caching:
                self.prefix_queries += r.num_tokens
                self.prefix_hits += hits * bs
            if r.first_sched is None:
                # Async scheduling plans a step while the one before it runs: the request was
                # scheduled when that one started (or when it was taken in, if later).
                start, end = self._last_step
                r.first_sched = (max(start, r.queued) if cfg.async_scheduling and end >= now
                                 else now)
                r.cached_tokens = computed
            waiting.pop()
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
                    self.host.store(h)
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

    def _price(self, B: int, S: int, chunks) -> tuple[float, float, int, int]:
        tokens, pairs, kv_tokens, sampled = B, float(S), S, B
        for r, q, c in chunks:
            tokens += q
            pairs += chunk_pairs(q, c)
            kv_tokens += c + q
            if c + q == r.num_tokens:
                sampled += 1
        return (*self.stm.step_parts(tokens, B + len(chunks), sampled, pairs, kv_tokens, len(chunks),
                                     self.kv.shared_tokens), tokens, sampled)

    def _run_step(self, now: float, collect: bool):
        chunks, paused, preempted = self._schedule(now)
        B, S = self.B, self.S
        decoders = [r for r in self.running if r.in_group] if collect and B else None
        if not chunks and not B:
            for r in paused:
                self._join(r)
            return 0.0, 0, [], [], decoders, preempted, chunks
        dur, kernels, tokens, _sampled = self._price(B, S, chunks)
        dur, self._load_s = dur + self._load_s, 0.0
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
        self._account(now, dur, kernels, self.stm.compute_share(tokens, kernels))
        self.steps += 1
        self._last_step = (now, now + dur)
        return dur, tokens, first, finished, decoders, preempted, chunks

    def _account(self, now: float, dur: float, kernel_s: float, compute_share: float) -> None:
        """A step (or a run of decode steps) of ``dur`` seconds, ``kernel_s`` of them the GPU's
        kernels at ``compute_share``: the rest the GPU waits on the host, at its idle power."""
        energy = float(self.power.step_j(dur, kernel_s, compute_share)) * self.cfg.tensor_parallel_size
        if self.step_log is not None:
            self.step_log.append((now, dur, kernel_s, compute_share))
        self.busy_s += dur
        self.kernel_s += kernel_s
        self.busy_energy_j += energy
        end = now + dur
        self.clock = max(self.clock, end)
        rec = self._recent
        rec.append((now, end, energy / dur if dur > 0 else 0.0, kernel_s / dur if dur > 0 else 0.0))
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
        times, kernels = self.stm.decode_parts(B, self.S, k, self.kv.shared_tokens)
        if horizon < math.inf:
            cum = np.cumsum(times)
            k = min(k, int(np.searchsorted(cum, horizon - now)) + 1)
            times, kernels = times[:k], kernels[:k]
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
        kernel_s = float(kernels.sum())
        self._account(now, total, kernel_s, self.stm.compute_share(B, kernel_s / k))
        self.steps += k
        self._last_step = (now + total - float(times[-1]), now + total)
        return DecodeRun(times, B, [_finished(r) for r in finished])

    # -- stats -------------------------------------------------------------------------------
    def gpu_utilization(self, now: float | None = None, window_s: float = 1.0) -> float:
        """Share of the last ``window_s`` seconds the GPU ran kernels, as nvidia-smi samples it."""
        end = self.clock if now is None else now
        start = end - window_s
        busy = 0.0
        for a, b, _w, kernels in self._recent:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                busy += (hi - lo) * kernels
        return min(1.0, busy / window_s)

    def gpu_power_w(self, now: float | None = None, window_s: float = 1.0) -> float:
        """The power model's mean draw over the last ``window_s`` seconds, every GPU's together."""
        end = self.clock if now is None else now
        start = end - window_s
        busy = energy = 0.0
        for a, b, w, _kernels in self._recent:
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
