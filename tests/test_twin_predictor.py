"""The offline predictor: bookkeeping, the fast-forward's exactness, fidelity and directions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from vllm_lab import stress
from vllm_lab.models import load_model_shape
from vllm_lab.scenarios import Scenario
from vllm_lab.summary import closed_loop_gaps
from vllm_lab.twin.engine import Engine
from vllm_lab.twin.fit import compare, load_point
from vllm_lab.twin.predictor import (
    Closed,
    Open,
    PredictRequest,
    bench_serve,
    predict,
    sharegpt_like,
)
from vllm_lab.twin.profile import load_profile

MODEL = load_model_shape("llama-3-8b")
H200 = load_profile("h200-llama-3-8b")
# `vllm bench serve` results of vLLM 0.26 on one H200 (Llama-3-8B), the ones the shipped profile is
# fitted to: shipped with the twin so the fidelity check runs on every machine.
REFERENCE = Path(__file__).resolve().parents[1] / "vllm_lab/twin/reference/h200-vllm0.26"
WORK = sharegpt_like(800, seed=3)


def _p(flags, reqs=WORK, users=256, **kw):
    return predict(flags, H200, MODEL, reqs, Closed(users), **kw)


def test_every_request_completes_and_tpot_is_bench_definition():
    p = _p({})
    df = p.requests
    assert p.completed == len(WORK) == len(df)
    assert (df.output_tokens == [r.output_tokens for r in WORK]).all()
    tpot = (df.e2e_s - df.ttft_s) / (df.output_tokens - 1)
    assert np.allclose(tpot[df.output_tokens > 1], df.tpot_s[df.output_tokens > 1])
    assert (df.ttft_s > 0).all() and (df.e2e_s >= df.ttft_s).all()
    assert p.output_throughput == pytest.approx(df.output_tokens.sum() / p.duration_s)
    assert 0 < p.kv_usage_mean <= p.kv_usage_peak <= 1


def test_fast_forward_changes_nothing(monkeypatch):
    reqs = sharegpt_like(200, seed=5)
    fast = _p({}, reqs, users=16)
    monkeypatch.setattr(Engine, "fast_forward", lambda self, now, horizon: None)
    slow = _p({}, reqs, users=16)
    assert np.allclose(fast.requests.e2e_s, slow.requests.e2e_s, rtol=1e-9, atol=1e-9)
    assert np.allclose(fast.requests.ttft_s, slow.requests.ttft_s, rtol=1e-9, atol=1e-9)
    assert fast.itl["p50"] == pytest.approx(slow.itl["p50"])


def test_open_loop_and_goodput_judged_by_the_labs_summary():
    p = predict({}, H200, MODEL, WORK[:300], Open(rate=20.0, burstiness=0.5))
    assert p.completed == 300
    assert not hasattr(p, "goodput")  # SLOs are judged in one place: vllm_lab.summary
    capped = predict({}, H200, MODEL, WORK[:300], Open(rate=200.0, max_in_flight=8))
    assert capped.completed == 300


def test_shared_prefixes_hit_the_cache():
    system = list(range(1000, 1512))
    reqs = [PredictRequest(system + [i, i + 1, i + 2], 20) for i in range(0, 300, 3)]
    p = predict({}, H200, MODEL, reqs, Closed(8))
    assert (p.requests.cached_tokens.iloc[8:] == 512).all()
    off = predict({"enable-prefix-caching": False}, H200, MODEL, reqs, Closed(8))
    assert (off.requests.cached_tokens == 0).all()
    assert off.ttft["p50"] > p.ttft["p50"]


def test_a_shared_prompts_repeated_reads_come_from_l2_not_memory():
    """Every running request holds the system prompt's blocks (the prefix cache's holds past the
    first), and a decode step reads them once from memory and the rest of the time from L2, at
    L2's bandwidth (``Hardware.l2_bandwidth_gbs``): the same traffic decodes faster behind one
    system prompt than behind one each, though both prompts are in the cache."""
    from vllm_lab.twin.kvcache import KVCache

    kv = KVCache(num_blocks=100, block_size=16)
    kv.take(3)
    for h in (1, 2, 3):
        kv.promote(h)          # the first request computes the prompt's three blocks
    kv.acquire([1, 2, 3])      # two more hold them
    kv.acquire([1, 2])
    assert kv.extra_holds == 5
    kv.release(0, [1, 2])
    assert kv.extra_holds == 3
    kv.release(0, [1, 2, 3])
    kv.release(0, [1, 2, 3])
    assert kv.extra_holds == 0 and len(kv.lru) == 3

    def tpot(groups: int) -> float:
        systems = [list(range(10_000 * (g + 1), 10_000 * (g + 1) + 1584)) for g in range(groups)]
        reqs = [PredictRequest(systems[i % groups] + [i, i + 1, i + 2, i + 3], 256) for i in range(256)]
        return predict({}, H200, MODEL, reqs, Closed(64)).tpot["p50"]

    one, each = tpot(1), tpot(64)
    assert 0.6 < one / each < 0.85


def test_the_h100_decodes_long_contexts_as_measured():
    """`reports/examples/h100`: 512-token replies after long prompts on one H100. Behind one system
    prompt or three (1,597 of 1,664 tokens) vLLM decoded at 9.6-9.7 ms a token at 64 users
    (h100-prefix-long) and 13.4 ms at 128 (h100-prefix-long-128b, unsteady: read over its steady
    windows), the repeated reads at L2's bandwidth; behind one prompt each, every prompt cached and
    none shared, at 8.9, 11.9 and 18.7 ms with 512-, 1,664- and 4,096-token prompts at 64 users
    (h100-kv-context, -prefix-long) and 18.3 ms at 128. All within 5%, and the error the same at
    every context: the KV cache is read at the HBM's bandwidth (``kv_bandwidth_efficiency``), where
    at the linear layers' efficiency the private runs read 10-15% slow, more the longer the prompt.
    And the request trace behind three system prompts (h100-trace-stairs) at 12 and 30 req/s: TPOT
    p50 within 6%."""
    from tests.support.examples import ok_runs, predicted

    runs = ok_runs("h100", "h100-prefix-long", "h100-prefix-long-128b", "h100-kv-context",
                   "h100-trace-stairs", statuses=("ok", "unsteady"))
    points = runs["point"].map(lambda point: next(iter(point.items())))
    error = pd.DataFrame({"param": [k for k, _ in points], "value": [v for _, v in points],
                          "error": [predicted(run)["tpot_p50"] / run["tpot_p50"] - 1
                                    for _, run in runs.iterrows()]})
    trace = error[error["param"] == "load.shape.level"]
    long_prompts = error.drop(trace.index)
    assert len(long_prompts) == 14 and long_prompts["error"].abs().max() <= 0.05, error
    private = long_prompts[(long_prompts["param"] == "workload.input.mean")
                           | (long_prompts["value"] == 64)]
    assert len(private) == 6 and private["error"].max() - private["error"].min() <= 0.02, error
    steady = trace[trace["value"] < 48]  # at 48 req/s the API server sets the pace (TPOT 17.4 ms, steps 14.3)
    assert len(steady) == 2 and steady["error"].abs().max() <= 0.06, error


def test_fidelity_on_reference_files():
    points = [load_point(f) for f in sorted(REFERENCE.glob("*.json"))]
    assert len(points) == 8, f"the reference measurements are missing from {REFERENCE}"
    rows = compare(points, H200, MODEL)
    for metric in ("output_throughput", "p50_ttft_ms", "p50_tpot_ms"):
        errs = sorted(abs(r["error"]) for r in rows if r["metric"] == metric)
        assert np.median(errs) <= 0.10, metric
        assert errs[-1] <= 0.25, metric


def test_bench_mode_c1_is_one_request_at_a_time():
    p = bench_serve({}, H200, MODEL, 10, 512, 128, max_concurrency=1)
    df = p.requests
    assert (df.send_s.iloc[1:].values >= df.finish_s.iloc[:-1].values - 1e-12).all()
    assert p.tpot["p50"] == pytest.approx(4.9e-3, rel=0.1)


def test_direction_max_num_seqs():
    few, many = _p({"max-num-seqs": 16}), _p({"max-num-seqs": 256})
    assert few.ttft["p50"] > 2 * many.ttft["p50"]
    assert few.tpot["p50"] < many.tpot["p50"]
    assert few.output_throughput < many.output_throughput


def test_direction_kv_short_preempts_and_peaks():
    short = {"gpu-memory-utilization": 0.2, "max-model-len": 8192}
    roomy, tight = _p({"max-model-len": 8192}), _p(short)
    assert tight.kv_cache_tokens < roomy.kv_cache_tokens / 5
    assert roomy.num_preemptions == 0 < tight.num_preemptions
    mid, high = _p({**short, "max-num-seqs": 128}), _p({**short, "max-num-seqs": 512})
    assert mid.num_preemptions < high.num_preemptions
    # Past the peak more sequences buy no throughput: the recomputing preemptions cost what the
    # larger batch gains (within 2%: the two sides differ by a fraction of a percent).
    assert mid.output_throughput > 0.98 * high.output_throughput


def test_direction_enforce_eager_and_long_prompts():
    assert _p({"enforce-eager": True}).tpot["p50"] > 1.1 * _p({}).tpot["p50"]
    long = [PredictRequest(6000, 32) for _ in range(60)]
    small = _p({"max-num-batched-tokens": 512, "max-num-seqs": 256}, long, users=32)
    big = _p({"max-num-batched-tokens": 8192}, long, users=32)
    assert small.ttft["p50"] > 1.3 * big.ttft["p50"]
    assert not math.isnan(small.itl["p99"])


def test_api_server_processes_queue_requests_and_share_tokens():
    """One API-server process is a FIFO queue: requests and streamed tokens wait their turn;
    N processes take requests in turn and share a step's tokens."""
    from vllm_lab.twin.frontend import Frontend

    one = Frontend(token_cost_s=0.001, request_cost_s=0.0, servers=1, chat_cost_s=0.004)
    assert one.admit(0.0) == 0.0  # completions: no admission cost in this profile
    assert one.admit(0.0, chat=True) == pytest.approx(0.004)
    assert one.admit(0.001, chat=True) == pytest.approx(0.008)  # queued behind the first
    assert one.release(0.010, 4) == pytest.approx(0.014)
    assert one.busy_s == pytest.approx(0.012)  # two chat admissions and four tokens: its CPU
    four = Frontend(token_cost_s=0.001, servers=4, chat_cost_s=0.004)
    assert [four.admit(0.0, chat=True) for _ in range(4)] == pytest.approx([0.004] * 4)
    assert four.release(0.010, 4) == pytest.approx(0.011)
    assert four.busy_s == pytest.approx(0.020)  # the same work, on four processes


def test_api_server_pays_per_prompt_token_and_catches_up_by_merging_chunks():
    """A prompt's tokens cost its admission time; a process behind the engine pays the
    per-chunk part of a token's cost once for every step that waited, so it catches up."""
    from vllm_lab.twin.frontend import Frontend

    fe = Frontend(token_cost_s=0.0, prompt_token_cost_s=1e-5)
    assert fe.admit(0.0, prompt_tokens=500) == pytest.approx(0.005)
    keeping_up = Frontend(token_cost_s=0.001, delivery_share=0.5)
    assert keeping_up.release(0.0, 4) == pytest.approx(0.004)
    assert keeping_up.release(0.010, 4) == pytest.approx(0.014)  # caught up: the full cost
    behind = Frontend(token_cost_s=0.001, delivery_share=0.5)
    assert behind.release(0.0, 20) == pytest.approx(0.020)
    # 10 ms later it is 10 ms behind: two steps' tokens go out together, half the chunk cost
    assert behind.release(0.010, 20) == pytest.approx(0.020 + 20 * (0.0005 + 0.0005 / 2))
    plain = Frontend(token_cost_s=0.001)
    plain.release(0.0, 20)
    assert plain.release(0.010, 20) == pytest.approx(0.040)  # no share: every token in full
    # A new request crosses the loop admission_hops times, each after at most one chunk.
    busy = Frontend(token_cost_s=0.001, admission_hops=3)
    busy.release(0.0, 1000)  # a second of streaming ahead of it
    assert busy.admit(0.0) == pytest.approx(3 * Frontend.OUTPUT_CHUNK * 0.001)


def test_one_api_server_caps_chat_traffic_on_the_h200_and_four_lift_it():
    """The H200 measurement (reports/examples/autotune-h200): at 38 req/s of chat one API-server
    process breaks TTFT p99 < 300 ms while the engine keeps up; four processes hold it."""
    from vllm_lab import autotune
    from vllm_lab.backends import PredictBackend
    from vllm_lab.scenarios import resolve

    chat = resolve("realtime-chat", "h200")
    base = autotune.open_loop(autotune.defaults_scenario(chat, autotune.load_space(None, chat)), 30)
    point = lambda flags: stress.staircase_points(autotune.with_flags(base, flags), [38.0])[0].scenario
    one = PredictBackend().measure(point({}), None, Path("."))
    four = PredictBackend().measure(point({"api-server-count": 4}), None, Path("."))
    assert one.summary["ttft_p99"] > 0.3 and not one.summary["meets_slo"]
    assert four.summary["ttft_p99"] < 0.15 and four.summary["meets_slo"]


def test_the_api_servers_cpu_is_vllms_process_cpu_on_the_h200_chat_staircase():
    """vLLM's API-server process used 0.47, 0.58 and 0.69 of a core at 23, 28 and 33 req/s of
    realtime-chat (process_cpu_seconds_total in reports/examples/autotune-h200, the defaults'
    staircase `-c`): the modelled API server is as busy, within 10%."""
    from vllm_lab.audit import server_view
    from vllm_lab.backends import PredictBackend
    from vllm_lab.store import Store

    store_path = Path(__file__).resolve().parent.parent / "reports/examples/autotune-h200/lab.db"
    with Store(store_path) as store:
        runs = store.runs("autotune-realtime-chat-h200-c-defaults")
        levels = {float(r.point["load.shape.level"]): (r.scenario_json, server_view(
            store.server_metrics(r.experiment_id, r.run_key)).api_cpu) for r in runs.itertuples()}
    for level, measured in ((23.273, 0.471), (28.26, 0.584), (33.247, 0.687)):
        scenario_json, cpu = levels[level]
        assert cpu == pytest.approx(measured, abs=0.001)
        scenario = Scenario.model_validate(json.loads(scenario_json))
        predicted = PredictBackend().measure(scenario, None, Path(".")).summary["server_api_cpu"]
        assert predicted == pytest.approx(cpu, rel=0.10), level


def test_the_loops_cpu_is_read_while_the_run_was_under_way():
    """The parity script's samples of the API server's event loop cover the tool's start and the
    drain too: the rate is read where the run went on, not over the whole call."""
    from vllm_lab.twin.reference import loop_cpu

    idle = [[t, 0.01 * t] for t in range(10)]                       # 0.01 of a core idling
    busy = [[10 + t, 0.09 + 0.8 * t] for t in range(1, 21)]            # 0.8 of a core for 20 s
    drain = [[31 + t, busy[-1][1] + 0.01 * t] for t in range(1, 10)]
    assert loop_cpu({"server_api_busiest_thread_series": idle + busy + drain}) == pytest.approx(0.8, rel=0.02)
    assert loop_cpu({"server_api_busiest_thread_series": idle}) is None  # under half a CPU second
    assert loop_cpu({}) is None


def test_enforce_eager_cuts_saturated_ttft_through_the_waiting_queue():
    # The held-out H200 closed loop (512/128 fixed, reference/h200-vllm0.26/lab-closed-loop-*): at
    # 256 users eager cut TTFT p50 1668 -> 768 ms (-54%) because the server's waiting queue emptied
    # (queue mean 0.92 -> 0.29 s) while prefill stayed 0.36 s: CPU-bound decode steps keep each user
    # in decode longer, so the closed loop offers the scheduler fewer prompts at a time.
    reqs = [PredictRequest(512, 128)] * 1536
    dflt, eager = _p({}, reqs), _p({"enforce-eager": True}, reqs)
    steady = slice(512, None)
    q_d = dflt.requests["queue_s"].iloc[steady].mean()
    q_e = eager.requests["queue_s"].iloc[steady].mean()
    pf_d = dflt.requests["prefill_s"].iloc[steady].mean()
    pf_e = eager.requests["prefill_s"].iloc[steady].mean()
    cut = eager.ttft["p50"] / dflt.ttft["p50"] - 1
    assert -0.75 < cut < -0.4
    assert q_e < 0.4 * q_d                      # the queue is where the cut comes from
    assert pf_e == pytest.approx(pf_d, rel=0.1)  # prefill steps are GPU-bound either way
    assert eager.tpot["p50"] > 1.4 * dflt.tpot["p50"]
    # The eager decode step is CPU-bound (64 users: TPOT 8.9 -> 28.4 ms measured), and a prefill
    # step of 8192 tokens costs what it costs with CUDA graphs: launches overlap the GPU's work.
    at64 = _p({"enforce-eager": True}, [PredictRequest(512, 128)] * 384, users=64)
    assert at64.tpot["p50"] == pytest.approx(0.0284, rel=0.15)
    graphed, launched = (Engine.from_flags(f, H200, MODEL).stm for f in ({}, {"enforce-eager": True}))
    big = {"num_tokens": 8192, "num_seqs": 16, "num_sampled": 16, "attn_pairs": 16 * 512 * 256.0,
           "kv_tokens": 8192}
    assert launched.step_time(**big) == pytest.approx(graphed.step_time(**big))
    # At light load (16 users, short chat prompts) every step is small and CPU-bound: eager adds TTFT.
    light = sharegpt_like(160, seed=3)
    assert _p({"enforce-eager": True}, light, users=16).ttft["p50"] > 1.3 * _p({}, light, users=16).ttft["p50"]


def test_async_scheduling_moves_a_step_from_the_queue_to_prefill():
    # vLLM 0.26 turns async scheduling on by default: at the end of step N the engine core takes
    # new requests in and plans step N+2 while N+1 already runs. Its histograms start the queue when
    # the request is taken in (queued_ts, at a step boundary, not at the socket) and count prefill
    # from the planning (scheduled_ts) to the first token: a new request's prefill spans the step in
    # flight plus its own. Held-out H200 closed loop, 64 users 512/128: queue mean 0.05 s, prefill
    # 0.28 s (the twin had 0.28 / 0.19 timing the queue from the socket and planning synchronously).
    def engine(flags):
        from vllm_lab.twin.engine import EngineRequest
        eng = Engine.from_flags(flags, H200, MODEL)
        eng.add_request(EngineRequest("a", [], 16, ignore_eos=True, num_prompt_tokens=512))
        first = eng.step(0.0)                               # "a" prefills alone: nothing in flight
        assert first.outputs[0].queue_time_s == 0.0 and first.outputs[0].scheduled_s == 0.0
        t = first.duration_s
        eng.add_request(EngineRequest("b", [], 16, ignore_eos=True, num_prompt_tokens=512,
                                      arrival_time=t - 0.001))   # reached the socket mid-step
        steps = [eng.step(t)]
        t += steps[-1].duration_s
        steps.append(eng.step(t))
        b = next((s, o) for s in steps for o in s.outputs if o.request_id == "b")
        return steps, b[0], b[1], t - steps[0].duration_s

    steps, step_b, out, t0 = engine({})
    assert step_b is steps[1]                     # "b" joins the step after the one in flight
    assert out.queue_time_s == 0.0                # taken in and planned at the same boundary
    assert out.scheduled_s == pytest.approx(t0)   # planned when the step in flight started
    steps, step_b, out, _t0 = engine({"async-scheduling": False})
    assert step_b is steps[0] and out.queue_time_s == 0.0
    # The held-out closed loop: the queue/prefill split of vLLM's histograms.
    at64 = _p({}, [PredictRequest(512, 128)] * 384, users=64).requests.iloc[128:]
    assert at64["queue_s"].mean() == pytest.approx(0.055, abs=0.03)
    assert at64["prefill_s"].mean() > at64["queue_s"].mean() * 2
    sync = _p({"async-scheduling": False}, [PredictRequest(512, 128)] * 384, users=64).requests
    assert at64["prefill_s"].mean() > sync["prefill_s"].iloc[128:].mean() + 0.02


def test_a_clients_turnaround_keeps_identical_users_out_of_lockstep():
    # 64 users of identical 512/128 requests: with a client that sends again the instant a reply
    # ends, the twin locks them into the same four prefill batches wave after wave and TTFT takes
    # four values. A real client's millisecond of turnaround reshuffles the batches from wave to
    # wave. (On the H200 each batch's TTFTs also spread over ~150 ms, which the twin does not.)
    reqs = [PredictRequest(512, 128)] * 768
    locked = predict({}, H200, MODEL, reqs, Closed(64, turnaround_s=0.0)).requests
    real = predict({}, H200, MODEL, reqs, Closed(64)).requests
    def distinct_ttfts(df) -> int:  # past the first waves, to the millisecond
        return len(np.unique(df[df.send_s > df.send_s.quantile(0.3)].ttft_s.round(3)))

    assert distinct_ttfts(locked) <= 6 and distinct_ttfts(real) > 20
    # Each user's next send follows its previous end by the turnaround, 1.5 ms on average.
    gaps = closed_loop_gaps(real.send_s, real.finish_s, 64)
    assert 0.001 < gaps.mean() < 0.002 and (gaps >= 0).all()


def _bench_twin():
    """scripts/bench_twin.py as a module (a script, not part of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts/bench_twin.py"
    spec = importlib.util.spec_from_file_location("bench_twin", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_held_out_h200_runs_are_predicted_within_the_goals(capsys):
    # Closed loops of 64-512 users with and without --enforce-eager, never fitted on: median
    # |error| <= 10% and worst <= 25% on output throughput, TTFT p50 and TPOT p50.
    errs = _bench_twin().held_out(H200, MODEL)
    for metric in ("output_throughput", "ttft_p50", "tpot_p50"):
        assert len(errs[metric]) == 12
        assert np.median(errs[metric]) <= 0.10 and max(errs[metric]) <= 0.25, (metric, errs[metric])


def test_the_traffic_measurement_is_predicted_by_kind():
    """The 2026-12-01 H200 measurement re-predicted request for request, runs the fit never saw
    (vllm_lab/twin/reference.py chose them before fitting). Open loops and chat, where prefill
    chunks and decodes share steps all the time, were the twin's weakest part (TTFT -36 to -42%,
    TPOT -27 to -29% on Poisson; reference.py's measurement reproduces it with the older step model);
    the launch floor of a step past the largest CUDA graph and the API server's chunked output
    loop bring them within these bounds. Closed loops of variable lengths are not there yet
    (TTFT p50 -56% median: at 256 users vLLM's API server held new requests 1.3-1.8 s, the twin
    0.4 s; at that limit which state a run takes is chance, reference/README.md), and are
    checked only for throughput and TPOT."""
    from vllm_lab.twin import reference

    table = reference.by_kind(reference.errors(reference.held_out_set(), H200, MODEL))
    got = {(r.kind, r.metric): (r.median, r.worst) for r in table.itertuples()}
    for kind in ("closed fixed", "closed variable", "open", "chat"):
        assert got[(kind, "output_throughput")][0] <= 0.10 and got[(kind, "p50_tpot_ms")][0] <= 0.10
        assert got[(kind, "output_throughput")][1] <= 0.25 and got[(kind, "p50_tpot_ms")][1] <= 0.25
    median, worst = got[("open", "p50_ttft_ms")]
    assert median <= 0.15 and worst <= 0.25 and got[("open", "p99_ttft_ms")][0] <= 0.25
    median, worst = got[("chat", "p50_ttft_ms")]
    assert median <= 0.20 and worst <= 0.25
    assert got[("closed fixed", "p50_ttft_ms")][0] <= 0.15


# Every held-out run of every measurement (162: seven hosts, the lab's sweeps, make calibrate's
# plan), pooled by kind: (median, worst) |error| no larger than the shipped profile's, rounded up.
# Where a goal of reference.GOALS holds it is the bound; where it does not yet (TTFT p50 outside
# the closed fixed kind, the open kind's TPOT worst and TTFT p99) the bound is today's figure,
# so a change to the twin can only keep or narrow them. The reference README says why they are open.
POOLED_BOUNDS = {
    "closed fixed": {"output_throughput": (0.10, 0.25), "p50_ttft_ms": (0.10, 0.50),
                     "p50_tpot_ms": (0.10, 0.25), "p99_ttft_ms": (0.15, None)},
    "closed variable": {"output_throughput": (0.10, 0.36), "p50_ttft_ms": (0.15, 0.85),
                        "p50_tpot_ms": (0.10, 0.35), "p99_ttft_ms": (0.15, None)},
    "open": {"output_throughput": (0.10, 0.25), "p50_ttft_ms": (0.14, 0.70),
             "p50_tpot_ms": (0.10, 0.50), "p99_ttft_ms": (0.20, None)},
    # Chat's TTFT p50 read 22.9% (worst 120%) before L2 served a shared prompt's repeated reads:
    # the faster engine moves the twin's API-server cliff on -02c (44-52 req/s) further off. With
    # L2 serving them at its bandwidth (52% of their HBM time saved on an H200, not 80%) the
    # median run (-02c's 48 req/s at four API servers) reads 25.6% (23.7%), TPOT p50 7.0% (7.3%).
    "chat": {"output_throughput": (0.10, 0.25), "p50_ttft_ms": (0.26, 1.40),
             "p50_tpot_ms": (0.10, 0.42), "p99_ttft_ms": (0.16, None)},
}


@pytest.fixture(scope="module")
def held_out_errors():
    """Every held-out run of the reference re-predicted, with its folder (162 runs, and the 18 of
    the point repeated in ``reference.REPEATS``): ~9 s, taken once for the tests below."""
    from vllm_lab.twin import reference

    return reference.held_out_errors((reference.TRAFFIC, *reference.LATER, *reference.REPEATS),
                                     H200, MODEL)


@pytest.mark.fidelity  # 180 replays, ~9 s: make test runs it, test-fast does not
def test_every_held_out_run_is_predicted_no_worse_than_today_by_kind(held_out_errors):
    """All the measurements' held-out runs, pooled by traffic kind, within POOLED_BOUNDS."""
    from vllm_lab.twin import reference

    pooled = held_out_errors[~held_out_errors["folder"].isin([f.name for f in reference.REPEATS])]
    table = reference.by_kind(pooled)
    assert (pooled["metric"] == "output_throughput").sum() == 162  # one row a run and metric
    assert set(table.kind) == set(POOLED_BOUNDS)
    for r in table.itertuples():
        median, worst = POOLED_BOUNDS[r.kind][r.metric]
        assert r.median <= median and (worst is None or r.worst <= worst), (
            r.kind, r.metric, round(r.median, 3), round(r.worst, 3))


@pytest.mark.fidelity
def test_the_twins_error_is_read_beside_the_measurements_own_spread(held_out_errors):
    """What the READMEs say of the spread: on open loops and chat the twin is closer to each host
    than the hosts are to one another in TTFT p50, and on closed loops of variable lengths it is
    not; away from the API server's limit a point repeats within 10% on one host, while at the
    limit (the ShareGPT file at 256 users, 18 runs) a run lies over 20% from its runs' median."""
    from vllm_lab.twin import reference

    hosts = reference.host_spread(held_out_errors).set_index(["kind", "metric"])
    for kind in ("open", "chat"):
        assert hosts.loc[(kind, "p50_ttft_ms"), "twin"] < hosts.loc[(kind, "p50_ttft_ms"), "spread"]
    assert (hosts.loc[("closed variable", "p50_ttft_ms"), "twin"]
            > hosts.loc[("closed variable", "p50_ttft_ms"), "spread"])
    repeats = reference.repeat_spread(held_out_errors).set_index(["kind", "metric"])
    assert (repeats.xs("p50_ttft_ms", level="metric")["spread"] < 0.10).all()
    limit = held_out_errors[held_out_errors["folder"] == reference.REPEATS[0].name]
    assert reference.repeat_spread(limit).set_index("metric").loc["p50_ttft_ms", "spread"] > 0.20


@pytest.mark.fidelity
def test_the_twin_says_where_its_ttft_is_least_sure_by_its_own_api_server_load(held_out_errors):
    """Where the twin predicts vLLM's API server busy 0.6 of a core or more (frontend.LIMIT_CPU),
    the run may settle at the API server's limit, which the twin does not reach: held out, its
    TTFT p50 is off by 46% (median) there and 11% below it (180 runs); predicted again at that
    limit (``profile.at_api_limit``), the two bound what vLLM read."""
    from vllm_lab.twin import reference

    below, past = reference.by_api_load(held_out_errors).to_dict("records")
    assert below["runs"] + past["runs"] == 180 and past["runs"] >= 40
    assert below["median"] <= 0.12 and past["median"] >= 0.35 and past["past 25%"] > 0.5
    assert "open" in below["kinds"] and "open" not in past["kinds"]  # no Poisson run nears it
    # There the twin's TTFT at the engine's limit and at the API server's (all the excess waiting
    # for admission) bound the measured one on 40 of the 48 runs, 10% either side.
    band = reference.api_limit_band(held_out_errors, (reference.TRAFFIC, *reference.LATER,
                                                      *reference.REPEATS), H200, MODEL)
    assert len(band) == past["runs"] and band["inside"].mean() >= 0.75


def test_a_points_repeats_and_its_hosts_give_the_spread_a_prediction_is_judged_against():
    """repeat_spread: a run's distance from its point's median, and the twin's from that median,
    over the points run three times or more in one folder, a point in two folders being two
    points; host_spread: a folder's median of a point against the folders' median."""

    from vllm_lab.twin import reference

    def runs(folder, point, measured, predicted):
        return [{"folder": folder, "point": point, "kind": "closed variable", "metric": "p50_ttft_ms",
                 "measured": m, "predicted": predicted, "error": predicted / m - 1}
                for m in measured]

    errs = pd.DataFrame(runs("a", "p", [90, 100, 130], 100) + runs("b", "p", [200, 200, 200], 150)
                        + runs("a", "twice", [1, 5], 3)
                        + [{"folder": "a", "point": "p", "kind": "closed variable",
                            "metric": "api_ms", "measured": 1, "predicted": 1, "error": 0}] * 3)
    table = reference.repeat_spread(errs)
    assert table.to_dict("records") == [{"kind": "closed variable", "metric": "p50_ttft_ms",
                                         "points": 2, "runs": 6, "spread": pytest.approx(0.0),
                                         "twin": pytest.approx(0.125)}]
    assert reference.repeat_spread(errs, min_runs=4).empty

    # Across folders: a's median of p is 100, b's 200, over both 150; "twice" is in one folder.
    hosts = reference.host_spread(errs)
    assert hosts.to_dict("records") == [{"kind": "closed variable", "metric": "p50_ttft_ms",
                                         "folders": 2, "spread": pytest.approx(1 / 3),
                                         "twin": pytest.approx(0.125)}]


def test_the_parts_of_ttft_are_read_by_kind_with_their_sign():
    """parts_by_kind: per kind, the median signed error of each diagnostic (the engine's prefill
    interval, the API server's part, ...) over the runs that measured it; the goals' metrics are
    not among them. The replay predicts the engine's part as its requests' mean prefill interval."""

    from vllm_lab.twin import fit, reference

    def rows(kind, metric, errors):
        return [{"point": "p", "kind": kind, "metric": metric, "measured": 1.0,
                 "predicted": 1.0 + e, "error": e} for e in errors]

    errs = pd.DataFrame(rows("open", "prefill_ms", [-0.2, -0.1, 0.3]) + rows("open", "api_ms", [0.5])
                        + rows("closed fixed", "prefill_ms", [0.1, 0.2])
                        + rows("open", "p50_ttft_ms", [0.4, 0.4]))
    table = reference.parts_by_kind(errs)
    assert {(r["kind"], r["metric"]): (r["runs"], pytest.approx(r["median"]))
            for r in table.to_dict("records")} == {
        ("open", "prefill_ms"): (3, -0.1), ("open", "api_ms"): (1, 0.5),
        ("closed fixed", "prefill_ms"): (2, 0.15)}

    point = next(p for p, _ in reference.traffic_points() if "poisson" in p.name)
    pred = fit.replay(point, H200, MODEL)
    assert fit.predicted_metrics(pred)["prefill_ms"] == pytest.approx(
        pred.requests["prefill_s"].mean() * 1e3)
    assert point.measured["prefill_ms"] > 0


def test_the_twins_engine_steps_carry_the_tokens_vllms_did():
    """step_token_shares cumulates a prediction's (tokens, steps) rows by the bucket bounds of vLLM's
    iteration-tokens histogram. At 64 users of variable lengths (the H200, traffic-2026-12-01) the
    twin plans as many steps as vLLM and the same share in every bucket within a point; at 256,
    where vLLM's API server holds requests back, vLLM runs more and smaller steps than the twin."""
    import numpy as np

    from vllm_lab.twin import reference

    rows = np.array([[1, 2], [60, 5], [600, 3]])
    assert reference.step_token_shares(rows, (1, 64, 512, 1024)) == [0.2, 0.7, 0.7, 1.0]

    table = reference.step_sizes(reference.TRAFFIC, H200, MODEL, ("lab sharegpt 64", "lab sharegpt 256"))
    at64 = table[table["point"] == "lab sharegpt 64"].set_index("tokens")
    assert at64.loc["steps", "twin"] == pytest.approx(at64.loc["steps", "vLLM"], rel=0.02)
    shares = at64.drop("steps")
    assert (shares["twin"] - shares["vLLM"]).abs().max() < 0.01
    assert shares["vLLM"].sum() == pytest.approx(1.0) and shares["twin"].sum() == pytest.approx(1.0)
    at256 = table[table["point"] == "lab sharegpt 256"].set_index("tokens")
    assert at256.loc["steps", "vLLM"] > 1.2 * at256.loc["steps", "twin"]


def test_a_bursts_cost_is_read_by_the_requests_sent_just_before():
    """ttft_by_recent_sends: each request's TTFT, measured and predicted, grouped by how many
    requests were sent in the window before it (itself not counted), the last group open-ended."""
    from vllm_lab.twin import reference

    send = [0.0, 0.01, 0.02, 0.5, 1.0, 1.001, 1.002, 1.003, 1.004, 1.005]
    measured = [0.1, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.9]
    predicted = [m * 2 for m in measured]
    table = reference.ttft_by_recent_sends(send, measured, predicted, window_s=0.05, most=4)
    assert table["requests"].to_dict() == {0: 3, 1: 2, 2: 2, 3: 1, 4: 2}
    assert table.loc[4, "measured"] == pytest.approx(600.0)     # 0.3 and 0.9 s: median 0.6 s
    assert table.loc[0, "twin"] == pytest.approx(400.0)         # 0.2, 0.4 and 0.6 s


def test_vllms_api_server_loop_holds_poisson_arrivals_under_a_millisecond_and_saturates_at_256():
    """The probed H200 runs (reference.PROBED): at 40 req/s of 512-token prompts a callback waits
    under 1 ms on the API server's event loop, while vLLM counts 29-39 ms of each TTFT before its
    engine's queue: the loop is not where arrivals wait or gather. At 256 users of the ShareGPT
    file the loop is saturated: over one core, a callback waiting over 10 ms."""
    from vllm_lab.twin import reference

    probe = reference.api_server_probe().set_index("run")
    points = {p.name: p for p, _ in reference.traffic_points(reference.PROBED)}
    for run in ("bench poisson 40", "lab poisson 40"):
        assert probe.loc[run, "loop_mean_ms"] < 1.0 and probe.loc[run, "cores"] < 0.7
        assert 25 < points[run].measured["api_ms"] < 45
    for run in ("bench sharegpt 256", "lab sharegpt 256"):
        assert probe.loc[run, "cores"] > 1.0 and probe.loc[run, "loop_mean_ms"] > 10
        assert probe.loc[run, "gc_share"] > 0.04


def test_one_steps_prompts_are_the_requests_whose_first_tokens_came_together():
    """first_token_groups: requests whose first tokens arrived within the tolerance of each other
    are one group (one step's prompts); their sends' spread, and what the first sent waited."""
    from vllm_lab.twin import reference

    send = [0.0, 0.004, 0.010, 0.100]
    ttft = [0.050, 0.0465, 0.040, 0.030]  # the first three's first tokens at 50-50.5 ms
    got = reference.first_token_groups(send, ttft, tolerance_s=0.001)
    assert got["per_group"] == 2.0 and got["grouped"] == 0.75
    assert got["spread_ms"] == pytest.approx(10.0)
    assert got["first_ms"] == pytest.approx(50.0) and got["later_ms"] == pytest.approx(43.25)
    # On the H200, Poisson at 40 req/s (traffic-2026-12-01): vLLM gathers arrivals over a longer
    # span than the twin (12.7 against 9.2 ms, the 90th percentiles 41.8 against 19.8 ms).
    pt, run = next((p, r) for (p, _), r in zip(reference.traffic_points(reference.TRAFFIC),
                                                reference.runs_of(reference.TRAFFIC))
                   if p.name == "bench poisson 40")

    from vllm_lab.twin import fit

    rq = pd.read_csv(reference.TRAFFIC / "requests.csv.gz")
    rq = rq[rq.tag == run["tag"]].sort_values("start_s")
    measured = reference.first_token_groups(rq.start_s, rq.ttft_s)
    predicted = fit.replay(pt, H200, MODEL).requests
    twin = reference.first_token_groups(predicted.send_s, predicted.ttft_s)
    assert measured["spread_ms"] > 1.2 * twin["spread_ms"]
    assert measured["per_group"] > twin["per_group"]
    # Its tail: a tenth of vLLM's groups span three steps or more (some requests held for steps,
    # before vLLM's first-token stamp or after it).
    assert measured["spread_p90_ms"] > 1.5 * twin["spread_p90_ms"]


def test_what_comes_after_vllms_first_token_stamp_grows_with_the_first_tokens_a_step_hands_out():
    """The reference runs: the client's TTFT less vLLM's own (its histogram is observed before the
    API server streams the token) is a few ms for one user and grows with the first tokens a
    closed loop of identical requests gets in one step, about 0.6 ms each; vLLM's own histogram
    puts more of a Poisson run's requests under 100 ms than the client sees."""
    from vllm_lab.twin import reference

    after = reference.after_first_token_stamp((reference.TRAFFIC, *reference.LATER))
    closed = after[after.case == "closed"].groupby("level")["after_ms"].median()
    assert closed[1] < 5 and 100 < closed[256] < 250 and closed[1024] > 500
    run = next(r for r in reference.runs_of(reference.TRAFFIC)
               if r["case"] == "poisson" and r["level"] == 40)
    stamp = reference.server_shares(reference.TRAFFIC, run["tag"], (0.1, 0.25))
    assert stamp[1] == pytest.approx(1.0) and 0.6 < stamp[0] < 0.9
    assert reference.server_shares(reference.ROOT / "traffic-2026-12-04", "any", (0.1,)) is None


def test_the_api_server_measurement_replays_a_scenarios_shared_prefixes():
    """traffic-2026-12-02b: the realtime-chat runs are replayed as that scenario's workload built
    them (prefixes shared as token ids, the chat template around each message), and only the runs
    chosen before fitting the API server's terms are marked fitted."""
    from vllm_lab.twin import reference

    points = reference.traffic_points(reference.FRONTEND)
    chat = [p for p, _ in points if p.name.startswith("lab realtime-chat/poisson")]
    assert len(chat) == 4 and all(p.chat and p.kind == "chat" for p in chat)
    prompts = chat[0].prompt_lens
    assert all(isinstance(t, list) for t in prompts)
    assert len({tuple(t[:20]) for t in prompts}) < len(prompts) / 2  # a few prefixes, shared
    fitted = {p.name for p, f in points if f}
    assert fitted == {"bench sharegpt 256", "bench sharegpt 512", "bench poisson 60",
                      "lab realtime-chat/poisson 36"}
    assert any(p.flags == {"long-prefill-token-threshold": 256} for p, _ in points)


@pytest.mark.fidelity  # 10 runs at 11 scales, ~10 s: make test runs it, test-fast does not
def test_a_fast_hosts_runs_are_one_cpu_scale_from_the_profile():
    """`-03`'s and `-03b`'s Poisson hosts ran 30-60% faster than the profile's (TTFT and TPOT at
    light load): fitted on the other runs of its host, one scale on the host's CPU terms (below 1)
    puts each run's TTFT p50 and TPOT p50 closer than the one profile does (reference/README.md,
    "The host's CPU")."""
    from vllm_lab.twin import reference
    from vllm_lab.twin.fit import HOST_METRICS, best_host_scale, host_log_errors

    profile = load_profile("h200-llama-3-8b")
    model = load_model_shape(profile.model)
    scales = tuple(round(0.6 + 0.05 * i, 2) for i in range(11))
    for folder in ("traffic-2026-12-03", "traffic-2026-12-03b"):
        runs = [p for p in reference.held_out_set((reference.ROOT / folder,)) if "poisson" in p.name]
        logs = host_log_errors(runs, profile, model, scales)  # [scale, run, metric]
        one = scales.index(1.0)
        for j in range(len(runs)):
            others = [i for i in range(len(runs)) if i != j]
            scale = best_host_scale(logs[:, others], scales)
            assert 0.65 <= scale <= 0.85, (folder, scale)
            at = scales.index(scale)
            assert np.abs(logs[at, j]).mean() < 0.5 * np.abs(logs[one, j]).mean(), (
                folder, runs[j].name, dict(zip(HOST_METRICS, logs[at, j])))


def test_a_profile_on_another_host_moves_its_cpu_terms_only():
    from vllm_lab.twin.profile import HOST_CPU_TERMS, on_host

    base = load_profile("h200-llama-3-8b")
    moved = on_host(base, 0.5)
    for name, value in base.coefficients.model_dump().items():
        expected = value * 0.5 if name in HOST_CPU_TERMS else value
        assert getattr(moved.coefficients, name) == expected, name
    with pytest.raises(ValueError, match="positive"):
        on_host(base, 0)


@pytest.mark.fidelity  # 7 capacity predictions, ~6 s
def test_autotunes_predicted_capacities_on_the_h200_are_within_five_percent():
    """`make autotune`'s H200 runs (`-d` held out, `-e` and `-f` predicted before they ran): the
    predictor's SLO capacity of vLLM's defaults and of the picks within 5% of measured (`-f`'s c2,
    its pick as the search found it, reads +6%: README), read from the stored
    staircases' own scenarios (`-e`'s defaults broke on the client's keep-alive race, not here).
    The picks keep their KV cache in fp8, which vLLM reads in 0.8 of a 16-bit cache's time
    (`fp8_kv_read_share`, fitted to `-c`'s pick alone); as half the bytes, `-d`'s picks read +7%
    and +16%. The stored runs name the host's model folder, read here as its shape."""
    from vllm_lab.autotune.ranking import predicted_slo_capacity
    from vllm_lab.store import Store

    measured = {"d-defaults": 35.844, "d-c1": 49.972, "d-c2": 47.983, "c-c1": 50.124,
                "e-c1": 32.858, "f-defaults": 35.845, "f-c1": 52.427}
    with Store(Path(__file__).resolve().parents[1] / "reports/examples/autotune-h200/lab.db") as store:
        runs = store.runs()
    for exp, capacity in measured.items():
        first = runs[runs["experiment_id"] == f"autotune-realtime-chat-h200-{exp}"].sort_values("started")
        scenario = Scenario.model_validate_json(first.iloc[0]["scenario_json"])
        predicted = predicted_slo_capacity(scenario, capacity, 30.0).value
        assert abs(predicted / capacity - 1) <= 0.05, (exp, predicted, capacity)


@pytest.mark.fidelity  # one capacity prediction, ~3 s
def test_autotunes_predicted_capacity_of_the_defaults_on_the_h100_is_within_five_percent():
    """`make autotune` on the H100 (reports/examples/h100), its staircases held out of the H100
    profile (fitted to that GPU's calibration): vLLM's defaults, bound by the one API server's
    CPU, predicted within 5%. Its picks are not (+25% and +32%: the README's open question)."""
    from vllm_lab.autotune.ranking import predicted_slo_capacity
    from vllm_lab.store import Store

    with Store(Path(__file__).resolve().parents[1] / "reports/examples/h100/lab.db") as store:
        runs = store.runs("autotune-realtime-chat-h100-defaults").sort_values("started")
    scenario = Scenario.model_validate_json(runs.iloc[0]["scenario_json"])
    assert scenario.hardware.twin_profile == "h100-llama-3-8b"
    predicted = predicted_slo_capacity(scenario, 32.378, 30.0).value
    assert abs(predicted / 32.378 - 1) <= 0.05, predicted


@pytest.mark.fidelity  # the host's fit and two predictions on it, ~20 s
def test_the_second_h100_hosts_defaults_name_its_host(tmp_path):
    """`make autotune` on a second H100 host (reports/examples/h100, `-b`): its defaults measured
    49.36 … 55.17 req/s against 31.40 predicted. The predictor puts them there on a host whose CPU
    takes about 0.66 of the profile's host's time; on it, c1 (fp8, four API-server processes) is
    predicted about 59 req/s, where the defaults' error scaled it to 78 and centred its staircase
    there: its lowest level, 54.6, broke, and three levels left it between 43.4 and 56.6."""
    from vllm_lab.analysis.autotune import load_record, measured_capacity
    from vllm_lab.autotune import host, open_loop
    from vllm_lab.search import storage_url

    db = Path(__file__).resolve().parents[1] / "reports/examples/h100/lab.db"
    exp = "autotune-realtime-chat-h100-b"
    plan = load_record(db, exp, storage_url(None, db)).plan
    base = open_loop(Scenario.model_validate(plan.defaults), plan.step_s)
    seen = host.middle(measured_capacity(db, f"{exp}-defaults"))
    scale = host.fitted_scale(base, seen, plan.candidates[0].predicted, seen, plan.step_s, tmp_path)
    assert 0.6 <= scale <= 0.72, scale
    c1 = plan.candidate("c1")
    assert c1.centre > 77 and c1.flags == {"kv-cache-dtype": "fp8", "api-server-count": 4}
    on_host = host.predicted_on_host(base, [c1.flags], scale, seen, plan.step_s, tmp_path)[0]
    assert 55 <= on_host <= 62, on_host


@pytest.mark.fidelity  # the host's fit and two predictions on it, ~15 s
def test_the_third_h100_hosts_defaults_name_its_host_and_c1_is_found_there(tmp_path):
    """`-g` (reports/examples/h100): its defaults measured 37.84 … 40.30 req/s against 31.40
    predicted. The predictor puts them there on a host at about 0.8 of the profile's host's CPU
    time, and on it c1 (fp8, two API-server processes) at 52-57 req/s: it measured 52.37 … 54.73.
    Four processes are predicted the same there (the GPU's limit); they measured 42.45."""
    from vllm_lab.analysis.autotune import load_record, measured_capacity
    from vllm_lab.autotune import host, open_loop
    from vllm_lab.search import storage_url

    db = Path(__file__).resolve().parents[1] / "reports/examples/h100/lab.db"
    exp = "autotune-realtime-chat-h100-g"
    plan = load_record(db, exp, storage_url(None, db)).plan
    base = open_loop(Scenario.model_validate(plan.defaults), plan.step_s)
    seen = host.middle(measured_capacity(db, f"{exp}-defaults"))
    scale = host.fitted_scale(base, seen, plan.candidates[0].predicted, seen, plan.step_s, tmp_path)
    assert 0.76 <= scale <= 0.86, scale
    flags = [plan.candidate(n).flags for n in ("c1", "c2")]
    assert [f["api-server-count"] for f in flags] == [2, 4]
    c1, c2 = host.predicted_on_host(base, flags, scale, seen, plan.step_s, tmp_path)
    assert 52 <= c1 <= 57 and c2 >= c1 * 0.98, (c1, c2)


H100_EXAMPLE = Path(__file__).resolve().parents[1] / "reports/examples/h100"


def _h100_staircases_compared(profile, exp: str, candidates: tuple[str, ...]) -> list[dict]:
    """``fit.compare``'s rows for the staircases of an H100 autotune's ``candidates``, each level
    replayed request for request on ``profile`` and named "<candidate> #<level>"."""
    from vllm_lab import calibrate
    from vllm_lab.store import Store

    with Store(H100_EXAMPLE / "lab.db") as store:
        points = [p for c in candidates for p in calibrate.replayed_runs(store, f"{exp}-{c}", c)]
    return compare(points, profile, load_model_shape(profile.model))


def _errors(rows: list[dict], metric: str) -> list[float]:
    return [r["error"] for r in rows if r["metric"] == metric]


def _median_abs(rows: list[dict], metric: str) -> float:
    import statistics

    return statistics.median(abs(e) for e in _errors(rows, metric))


@pytest.mark.fidelity  # 14 staircase levels replayed, ~3 s
def test_the_fourth_h100_hosts_staircases_are_held_out_within_a_few_percent_but_ttft():
    """`-h` (reports/examples/h100), a host whose CPU is the profile's: its 14 staircase levels of
    Poisson chat, replayed request for request on the H100 profile (never fitted to them), read
    throughput and TPOT p50 within a few percent. TTFT p50 reads high at each candidate's lowest
    level, the API server's constant hold the README names (vLLM's engine part is right there)."""
    rows = _h100_staircases_compared(load_profile("h100-llama-3-8b"), "autotune-realtime-chat-h100-h",
                                     ("defaults", "c1", "c2"))
    assert len(_errors(rows, "output_throughput")) == 14
    assert _median_abs(rows, "output_throughput") <= 0.02
    assert _median_abs(rows, "p50_tpot_ms") <= 0.05
    lowest = {r["point"]: r["error"] for r in rows
              if r["metric"] == "p50_ttft_ms" and r["point"].endswith("#1")}
    assert all(0.15 <= e <= 0.4 for e in lowest.values()), lowest


@pytest.mark.fidelity  # 10 staircase levels replayed, ~3 s
def test_the_fifth_h100_hosts_picks_read_right_on_the_host_its_defaults_named_but_ttft():
    """`-i` (reports/examples/h100): its defaults' staircase read a host at 0.862 of the profile's
    CPU time. On the profile moved there, as autotune aimed them, the picks' ten levels (held out
    of that reading) read throughput and TPOT p50 within 1-2%; TTFT p50 reads high by about the
    same 13-18 ms at every level, the constant hold the README names, not a share of the load."""
    from vllm_lab.twin.profile import on_host

    exp = "autotune-realtime-chat-h100-i"
    scale = json.loads((H100_EXAMPLE / exp / "summary.json").read_text())["host_scale"]
    rows = _h100_staircases_compared(on_host(load_profile("h100-llama-3-8b"), scale), exp, ("c1", "c2"))
    assert len(_errors(rows, "output_throughput")) == 10
    assert _median_abs(rows, "output_throughput") <= 0.01
    assert _median_abs(rows, "p50_tpot_ms") <= 0.02
    excess_ms = [r["predicted"] - r["measured"] for r in rows if r["metric"] == "p50_ttft_ms"]
    assert all(12 <= ms <= 18 for ms in excess_ms), excess_ms


def test_a_model_folder_of_another_host_is_read_as_the_shape_it_is_named_for():
    assert load_model_shape("/models/llama-3-8b").name == "llama-3-8b"
    with pytest.raises(ValueError, match="not a known shape"):
        load_model_shape("/models/my-own-finetune")


def test_the_engine_stepped_alone_is_set_beside_the_twins_step(capsys):
    """`make bench NAME=twin ARGS=steps`: vLLM's engine stepped alone on the H200 and an H100
    (scripts/bench_step_times.py) beside the twin's step. A prompt alone reads within a tenth
    (median); a decode batch reads short by what the synchronous loop adds and the served engine
    overlaps, the same on both hosts (about 1.7 ms and 20-25 µs a sequence)."""
    import re

    _bench_twin().steps()
    out = capsys.readouterr().out
    prefill = [float(v) for v in re.findall(r"prefill (\d+\.\d)%", out)]
    added = [(float(a), float(b)) for a, b in re.findall(r"adds to a decode batch (\S+) ms and (\S+) µs", out)]
    assert len(prefill) == len(added) == 2 and max(prefill) < 10
    assert all(1.5 < ms < 1.9 and 18 < us < 28 for ms, us in added), added
