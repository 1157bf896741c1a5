"""The offline predictor: the twin's engine driven on a virtual clock by simulated clients.

No HTTP and no sleeping: the clock jumps from step end to step end, and runs of pure-decode steps
where nothing can change are computed in one go. The numbers are the ones ``vllm bench serve``
reports: throughput, goodput, TTFT / TPOT / ITL / E2E percentiles, plus preemptions and KV usage.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab.twin.engine import Engine, EngineRequest, FinishedRequest
from vllm_lab.twin.frontend import Frontend
from vllm_lab.twin.profile import Profile

PERCENTILES = (50, 90, 99)


@dataclass
class PredictRequest:
    """A request of the workload: its prompt (a length, or token ids) and its output length."""

    prompt_tokens: int | list[int]
    output_tokens: int
    chat: bool = False  # sent to /v1/chat/completions: the API server does more for it


# vllm bench serve's mean turnaround on the H200 host, from its per-request samples
# (reports/examples/client-parity-h200/bench-samples.csv.gz): 0.5 ms at 1 user, 1.4 ms at 64,
# about 4 ms at 256 and 512 users, where its one event loop is busier.
CLIENT_TURNAROUND_S = 0.0015


@dataclass
class Closed:
    """A closed loop: ``users`` clients, each sends, waits for the end, thinks, sends again.

    ``turnaround_s`` is the mean of the client's own delay between a reply's end and its next
    send (exponential): reading the end, recording it, building the next request, waiting its
    turn in the client's event loop. It is short but it matters: with none, users of identical
    requests lock into the same batches wave after wave, and TTFT takes a few discrete values
    where a real run spreads them (its median 12% higher at 64 users on the H200).
    """

    users: int
    think_time_s: float = 0.0
    turnaround_s: float = CLIENT_TURNAROUND_S


@dataclass
class Open:
    """An open loop: arrivals at ``rate`` per second, gamma gaps (burstiness 1 = Poisson), or at
    the given ``times`` (seconds from the start, one per request: a live run's own schedule, a
    trace), with at most ``max_in_flight`` requests sent and not yet answered."""

    rate: float
    burstiness: float = 1.0
    max_in_flight: int | None = None
    times: Sequence[float] | None = None


@dataclass
class Prediction:
    """What a run would measure."""

    duration_s: float
    completed: int
    output_throughput: float
    request_throughput: float
    total_token_throughput: float
    ttft: dict[str, float]
    tpot: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    num_preemptions: int
    kv_usage_peak: float
    kv_usage_mean: float
    gpu_utilization: float
    kv_cache_tokens: int
    requests: pd.DataFrame | None = None
    energy_j: float = 0.0       # the GPUs' modelled energy over the run (twin/power.py)

    def summary(self) -> dict[str, Any]:
        """The flat numbers, milliseconds for latencies, as vllm bench names them."""
        out: dict[str, Any] = {
            "duration": self.duration_s, "completed": self.completed,
            "output_throughput": self.output_throughput,
            "request_throughput": self.request_throughput,
            "total_token_throughput": self.total_token_throughput,
            "num_preemptions": self.num_preemptions,
            "kv_usage_peak": self.kv_usage_peak, "kv_usage_mean": self.kv_usage_mean,
            "gpu_utilization": self.gpu_utilization,
        }
        for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e")):
            for stat, v in getattr(self, key).items():
                out[f"{stat}_{name}_ms"] = v * 1000
        return out


def _stats(values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    if weights is None:
        out = {"mean": float(values.mean())}
        out.update({f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES})
        return out
    order = np.argsort(values)
    v, w = values[order], np.asarray(weights, dtype=float)[order]
    cum = np.cumsum(w)
    total = cum[-1]
    out = {"mean": float((v * w).sum() / total)}
    for p in PERCENTILES:
        out[f"p{p}"] = float(v[min(np.searchsorted(cum, total * p / 100), len(v) - 1)])
    return out


def predict(flags: dict[str, Any], profile: Profile, model, requests: Sequence[PredictRequest],
            arrivals: Closed | Open, seed: int = 0) -> Prediction:
    """Run ``requests`` (in order) through the twin under ``arrivals`` and measure it all.

    SLOs are not judged here: the lab judges the per-request samples (``Prediction.requests``)
    with ``vllm_lab.summary``, the same code that judges a measured run."""
    if isinstance(arrivals, Open) and arrivals.times is not None:
        requests = list(requests)[:len(arrivals.times)]  # one request per arrival
    eng = Engine.from_flags(flags, profile, model)
    # The API server admits each request (its process busy meanwhile), then the rest of the way
    # to the engine core takes ``lat``; it streams each step's tokens after the GPU made them and
    # before the next step's: when it falls behind, requests and tokens reach their side late.
    frontend = Frontend.of(profile.coefficients, flags)
    lat = Frontend.delay(profile.coefficients)
    n = len(requests)
    prompt_n = np.array([len(r.prompt_tokens) if isinstance(r.prompt_tokens, list)
                         else int(r.prompt_tokens) for r in requests], dtype=np.int64)
    send = np.full(n, np.nan)
    first = np.full(n, np.nan)
    queued = np.full(n, np.nan)                 # engine core: taken in to first scheduled
    prefill = np.full(n, np.nan)                # engine core: first scheduled to first token
    engine_in = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    # How late the API server handed out each request's first and last token after the GPU made
    # them: their difference is vLLM's e2e - TTFT - decode time, the stream's own lag.
    first_lag = np.full(n, np.nan)
    finish_lag = np.full(n, np.nan)
    outs = np.zeros(n, dtype=np.int64)
    cached = np.zeros(n, dtype=np.int64)
    preempt = np.zeros(n, dtype=np.int64)
    pending: list[tuple[float, int]] = []       # (time the engine sees it, index)
    itl_t: list[np.ndarray] = []
    itl_w: list[np.ndarray] = []
    step_t: list[float] = []
    step_w: list[int] = []
    usage_peak = usage_area = 0.0
    rng = np.random.default_rng(seed)
    nxt = 0
    backlog: list[float] = []                   # open loop: arrival times waiting for a slot
    in_flight = 0
    arrival_times = None
    think = turnaround = 0.0
    if isinstance(arrivals, Closed):
        think, turnaround = arrivals.think_time_s, arrivals.turnaround_s
        for _ in range(min(arrivals.users, n)):
            send[nxt] = 0.0
            heapq.heappush(pending, (frontend.admit(0.0, requests[nxt].chat) + lat, nxt))
            nxt += 1
    elif arrivals.times is not None:
        arrival_times = np.asarray(arrivals.times, dtype=float)[:n]
    else:
        shape = max(arrivals.burstiness, 1e-6)
        gaps = rng.gamma(shape, 1.0 / (arrivals.rate * shape), size=n)
        arrival_times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    cap = getattr(arrivals, "max_in_flight", None) or math.inf

    def send_req(i: int, t: float) -> None:
        nonlocal in_flight
        send[i] = t
        in_flight += 1
        heapq.heappush(pending, (frontend.admit(t, requests[i].chat) + lat, i))

    def submit(i: int, t: float) -> None:
        r = requests[i]
        ids = r.prompt_tokens if isinstance(r.prompt_tokens, list) else []
        engine_in[i] = t
        eng.add_request(EngineRequest(i, ids, int(r.output_tokens), ignore_eos=True,
                                      arrival_time=t, num_prompt_tokens=int(prompt_n[i])))

    def done(r: FinishedRequest, t: float, made: float) -> None:
        nonlocal nxt, in_flight
        i = r.request_id
        finish[i] = t
        finish_lag[i] = t - made
        outs[i] = r.num_output_tokens
        cached[i] = r.num_cached_tokens
        preempt[i] = r.num_preemptions
        if isinstance(arrivals, Closed):
            if nxt < n:
                t_send = t + think + (rng.exponential(turnaround) if turnaround else 0.0)
                send[nxt] = t_send
                heapq.heappush(pending, (frontend.admit(t_send, requests[nxt].chat) + lat, nxt))
                nxt += 1
        else:
            in_flight -= 1
            if backlog:
                backlog.pop(0)
                send_req(nxt_backlog.pop(0), t)

    nxt_backlog: list[int] = []
    last_seen = 0.0
    now = 0.0
    ai = 0
    while True:
        if arrival_times is not None:
            while ai < n and arrival_times[ai] <= now:
                if in_flight < cap:
                    send_req(ai, float(arrival_times[ai]))
                else:
                    backlog.append(float(arrival_times[ai]))
                    nxt_backlog.append(ai)
                ai += 1
        while pending and pending[0][0] <= now:
            t, i = heapq.heappop(pending)
            submit(i, t)
        if not eng.has_unfinished_requests():
            nexts = [pending[0][0]] if pending else []
            if arrival_times is not None and ai < n:
                nexts.append(float(arrival_times[ai]))
            if not nexts:
                break
            now = min(nexts)
            continue
        horizon = pending[0][0] if pending else math.inf
        if arrival_times is not None and ai < n:
            horizon = min(horizon, float(arrival_times[ai]))
        run = eng.fast_forward(now, horizon)
        if run is not None:
            times, nb = run.step_times, run.batch_size
            ends = now + np.cumsum(times)
            if frontend.token_cost_s or frontend.request_cost_s or frontend.chat_cost_s:
                vis = np.array([frontend.release(e, nb) for e in ends])
            else:
                vis = ends
            gaps = np.diff(vis, prepend=max(last_seen, now))
            seen = last_seen = float(vis[-1])
            itl_t.append(gaps)
            itl_w.append(np.full(times.size, nb, dtype=np.int64))
            usage = eng.kv_cache_usage
            dur = float(times.sum())
            now += dur
            usage_area += usage * dur
            usage_peak = max(usage_peak, usage)
            for r in run.finished:
                done(r, seen, now)
            continue
        step = eng.step_summary(now)
        dur = step.duration_s
        if dur <= 0.0:
            now = horizon if horizon < math.inf else now + 1e-3
            continue
        ndec = step.num_decode_tokens
        firsts = step.first_token_ids
        now += dur
        seen = frontend.release(now, ndec + len(firsts))
        if ndec:     # a decoder's previous token became visible with the previous step's
            step_t.append(seen - max(last_seen, now - dur))
            step_w.append(ndec)
        last_seen = seen
        usage = eng.kv_cache_usage
        usage_area += usage * dur
        usage_peak = max(usage_peak, usage)
        for i, (q, sched) in zip(firsts, step.first_scheduled):
            first[i] = seen
            first_lag[i] = seen - now
            queued[i] = sched - q
            prefill[i] = now - sched
        for r in step.finished:
            done(r, seen, now)

    ok = ~np.isnan(finish)
    t0 = np.nanmin(send) if n else 0.0
    duration = float(np.nanmax(finish) - t0) if ok.any() else 0.0
    ttft = first - send
    e2e = finish - send
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outs > 1, (e2e - ttft) / (outs - 1), np.nan)
    df = pd.DataFrame({"prompt_tokens": prompt_n, "output_tokens": outs, "cached_tokens": cached,
                       "send_s": send,
                       "scheduled_s": arrival_times if arrival_times is not None else send,
                       "first_token_s": first, "finish_s": finish, "ttft_s": ttft,
                       "tpot_s": tpot, "e2e_s": e2e, "preemptions": preempt,
                       "queue_s": queued, "prefill_s": prefill,
                       "stream_lag_s": finish_lag - first_lag})
    if step_t:
        itl_t.append(np.array(step_t))
        itl_w.append(np.array(step_w))
    itl_v = np.concatenate(itl_t) if itl_t else np.array([])
    itl_wt = np.concatenate(itl_w) if itl_w else None
    total_out = int(outs[ok].sum())
    return Prediction(
        duration_s=duration, completed=int(ok.sum()),
        output_throughput=total_out / duration if duration else 0.0,
        request_throughput=float(ok.sum() / duration) if duration else 0.0,
        total_token_throughput=(total_out + int(prompt_n[ok].sum())) / duration if duration else 0.0,
        ttft=_stats(ttft[ok]), tpot=_stats(tpot[ok & ~np.isnan(tpot)]),
        itl=_stats(itl_v, itl_wt), e2e=_stats(e2e[ok]), num_preemptions=eng.num_preemptions,
        kv_usage_peak=usage_peak, kv_usage_mean=usage_area / eng.busy_s if eng.busy_s else 0.0,
        gpu_utilization=eng.busy_s / duration if duration else 0.0,
        kv_cache_tokens=eng.kv_cache_tokens, requests=df,
        energy_j=eng.energy_j(t0 + duration))  # the clock starts at the first send, t0 = 0


def bench_serve(flags: dict[str, Any], profile: Profile, model, num_prompts: int,
                input_len: int = 512, output_len: int = 128, max_concurrency: int | None = None,
                request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0) -> Prediction:
    """What ``vllm bench serve --dataset-name random --ignore-eos`` would report (fresh prompts)."""
    reqs = [PredictRequest(input_len, output_len) for _ in range(num_prompts)]
    if request_rate == math.inf:
        arrivals: Closed | Open = Closed(users=max_concurrency or num_prompts)
    else:
        arrivals = Open(rate=request_rate, burstiness=burstiness, max_in_flight=max_concurrency)
    return predict(flags, profile, model, reqs, arrivals, seed=seed)


def sharegpt_like(n: int, seed: int = 0, prompt_mean: float = 161.0, output_mean: float = 338.0,
                  max_len: int = 4096) -> list[PredictRequest]:
    """Requests with lognormal prompt and output lengths, ShareGPT-like means (~161 / ~338 tokens)."""
    rng = np.random.default_rng(seed)
    sp, so = 1.0, 0.8
    p = rng.lognormal(math.log(prompt_mean) - sp * sp / 2, sp, n)
    o = rng.lognormal(math.log(output_mean) - so * so / 2, so, n)
    p = np.clip(np.rint(p), 4, max_len).astype(int)
    o = np.clip(np.rint(o), 2, max_len).astype(int)
    return [PredictRequest(int(a), int(b)) for a, b in zip(p, o)]
