"""The twin's engine: budgets, block conservation, preemption, prefix caching, refusals, limits."""

from __future__ import annotations

import random

import pytest

from vllm_lab.models import load_model_shape
from vllm_lab.twin.engine import Engine, EngineRequest, EngineStartError
from vllm_lab.twin.profile import load_profile

MODEL = load_model_shape("llama-3-8b")
H200 = load_profile("h200-llama-3-8b")
DEMO = load_profile("cpu-demo")


def _check_blocks(eng: Engine) -> None:
    kv = eng.kv
    assert kv.num_free + kv.num_used == kv.num_blocks
    assert kv.num_free_uncached >= 0 and kv.anon_used >= 0
    held_anon = sum(r.anon for r in eng.running)
    held_hashed = sum(len(r.hashed) for r in eng.running)
    assert held_anon == kv.anon_used
    assert held_hashed == sum(kv.refs.values())
    assert all(not r.anon and not r.hashed for r in eng.waiting)
    for r in eng.running:   # every running request holds the blocks its computed tokens need
        computed = eng._tokens(r) - 1 if r.in_group else r.num_computed
        assert (len(r.hashed) + r.anon) * eng.block_size >= computed


def _drive(eng: Engine, reqs, check=True, max_steps=200_000):
    outputs: dict[str, list] = {r.request_id: [] for r in reqs}
    finished: dict[str, int] = {}
    for r in reqs:
        eng.add_request(r)
    now = 0.0
    steps = 0
    while eng.has_unfinished_requests():
        res = eng.step(now)
        assert res.num_scheduled_tokens <= eng.cfg.max_num_batched_tokens
        assert res.num_running <= eng.cfg.max_num_seqs
        for out in res.outputs:
            outputs[out.request_id].extend(out.new_token_ids)
            assert out.num_output_tokens == len(outputs[out.request_id])
            if out.finished:
                assert out.request_id not in finished, "finished twice"
                finished[out.request_id] = out.num_output_tokens
        if check:
            _check_blocks(eng)
        now += res.duration_s
        steps += 1
        assert steps < max_steps
    return outputs, finished, now


def _random_reqs(n, seed=0, plen=(20, 600), olen=(1, 300)):
    rng = random.Random(seed)
    return [EngineRequest(f"r{i}", [rng.randrange(32000) for _ in range(rng.randint(*plen))],
                          rng.randint(*olen), ignore_eos=True) for i in range(n)]


def test_token_budget_and_blocks_under_chunked_prefill():
    eng = Engine.from_flags({"max-num-batched-tokens": 256, "max-num-seqs": 32}, H200, MODEL)
    reqs = _random_reqs(60)
    _outputs, finished, _ = _drive(eng, reqs)
    assert set(finished) == {r.request_id for r in reqs}
    for r in reqs:
        assert finished[r.request_id] == r.max_tokens


def test_no_request_lost_or_doubled_under_heavy_preemption():
    eng = Engine.from_flags({"num-gpu-blocks-override": 300, "max-model-len": 4096,
                             "max-num-seqs": 64, "max-num-batched-tokens": 2048}, H200, MODEL)
    reqs = _random_reqs(80, seed=1, plen=(50, 400), olen=(100, 500))
    outputs, finished, _ = _drive(eng, reqs)
    assert eng.stats.num_preemptions_total > 20
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    for r in reqs:
        assert len(outputs[r.request_id]) == r.max_tokens == finished[r.request_id]
    assert eng.kv.num_used == 0


def test_preempted_request_goes_to_front_of_queue():
    eng = Engine.from_flags({"num-gpu-blocks-override": 40, "max-model-len": 600}, H200, MODEL)
    a = EngineRequest("a", list(range(300)), 200, ignore_eos=True)
    b = EngineRequest("b", list(range(1000, 1300)), 200, ignore_eos=True)
    c = EngineRequest("c", list(range(2000, 2100)), 10, ignore_eos=True)
    for r in (a, b):
        eng.add_request(r)
    now = 0.0
    while eng.stats.num_preemptions_total == 0:
        now += eng.step(now).duration_s
    eng.add_request(c)
    assert eng.waiting.peek().id == "b"   # the victim (last admitted) is first in line


def test_prefix_cache_hits_on_shared_prefix():
    eng = Engine.from_flags({}, H200, MODEL)
    prefix = list(range(5000, 5000 + 160))
    r1 = EngineRequest("x", prefix + [1, 2, 3], 5, ignore_eos=True)
    r2 = EngineRequest("y", prefix + [7, 8, 9, 10], 5, ignore_eos=True)
    _drive(eng, [r1])
    eng.add_request(r2)
    cached = None
    now = 0.0
    while eng.has_unfinished_requests():
        res = eng.step(now)
        now += res.duration_s
        for o in res.outputs:
            cached = o.num_cached_tokens
    assert cached == 160
    st = eng.stats
    assert st.prefix_cache_hits == 160 and st.prefix_cache_queries == 163 + 164
    assert eng.reset_prefix_cache()
    assert eng.kv.refs == {}


def test_full_prompt_hit_recomputes_last_token():
    eng = Engine.from_flags({}, H200, MODEL)
    ids = list(range(64))
    _drive(eng, [EngineRequest("a", ids, 3, ignore_eos=True)])
    eng.add_request(EngineRequest("b", ids, 3, ignore_eos=True))
    res = eng.step(0.0)
    assert res.num_scheduled_tokens == 16          # 3 of 4 blocks hit; the last block recomputed
    assert res.outputs[0].num_cached_tokens == 48


def test_eos_min_tokens_abort():
    eng = Engine.from_flags({}, DEMO, MODEL)
    reqs = [EngineRequest("eos", [1] * 10, 50, eos_after=7),
            EngineRequest("min", [2] * 10, 50, eos_after=3, min_tokens=12),
            EngineRequest("ign", [3] * 10, 20, eos_after=3, ignore_eos=True),
            EngineRequest("gone", [4] * 10, 50)]
    for r in reqs:
        eng.add_request(r)
    reasons, counts = {}, {}
    now = 0.0
    eng.step(now)
    eng.abort_request("gone")
    while eng.has_unfinished_requests():
        res = eng.step(now)
        now += res.duration_s
        for o in res.outputs:
            if o.finished:
                reasons[o.request_id], counts[o.request_id] = o.finish_reason, o.num_output_tokens
    assert reasons == {"eos": "stop", "min": "stop", "ign": "length"}
    assert counts == {"eos": 7, "min": 12, "ign": 20}
    assert eng.kv.num_used == 0


def test_max_model_len_respected():
    eng = Engine.from_flags({"max-model-len": 256}, H200, MODEL)
    with pytest.raises(ValueError, match="maximum model length"):
        eng.add_request(EngineRequest("long", [1] * 256, 10))
    _, finished, _ = _drive(eng, [EngineRequest("r", [1] * 200, 1000, ignore_eos=True)])
    assert finished["r"] == 56


@pytest.mark.parametrize("flags,cause,words", [
    ({"tensor-parallel-size": 3}, "refused-flag", "divisible by tensor parallel size"),
    ({"tensor-parallel-size": 16}, "refused-flag", "larger than the number of available GPUs"),
    ({"max-num-batched-tokens": 64, "max-num-seqs": 128}, "refused-flag", "must be greater than"),
    ({"max-model-len": 10 ** 6}, "refused-flag", "greater than the derived max_model_len"),
    ({"dtype": "int3"}, "refused-flag", "invalid choice"),
    ({"block-size": 7}, "refused-flag", "invalid choice"),
    ({"gpu-memory-utilization": 1.5}, "refused-flag", "less than or equal to 1"),
    ({"gpu-memory-utilization": 0.1}, "oom", "No available memory for the cache blocks"),
    ({"gpu-memory-utilization": 0.2}, "oom", "estimated maximum model length is"),
    ({"dtype": "float32", "gpu-memory-utilization": 0.22}, "oom", "No available memory"),
])
def test_refused_configs(flags, cause, words):
    with pytest.raises(EngineStartError) as exc:
        Engine.from_flags(flags, H200, MODEL)
    assert exc.value.cause == cause
    assert words in exc.value.message


def test_h200_defaults_match_the_real_kv_cache():
    eng = Engine.from_flags({}, H200, MODEL)
    assert abs(eng.kv_cache_tokens - 919_824) / 919_824 < 0.01
    assert abs(eng.memory.weights_bytes / 2 ** 30 - 15.0) < 0.1
    st = eng.stats
    assert st.gpu_memory_total_bytes > st.gpu_memory_used_bytes > 0.9 * st.gpu_memory_total_bytes
    smaller = Engine.from_flags({"gpu-memory-utilization": 0.5}, H200, MODEL)
    assert smaller.kv_cache_tokens < eng.kv_cache_tokens
    fp8 = Engine.from_flags({"kv-cache-dtype": "fp8"}, H200, MODEL)
    assert fp8.kv_cache_tokens > 1.9 * eng.kv_cache_tokens
    tp2 = Engine.from_flags({"tensor-parallel-size": 2}, H200, MODEL)
    assert tp2.kv_cache_tokens > 2 * eng.kv_cache_tokens


def test_step_time_knobs():
    def decode_step(flags):
        eng = Engine.from_flags(flags, H200, MODEL)
        for i in range(8):
            eng.add_request(EngineRequest(f"r{i}", [i] * 500, 50, ignore_eos=True))
        eng.step(0.0)
        return eng.step(1.0).duration_s

    base = decode_step({})
    assert decode_step({"enforce-eager": True}) > base * 1.3
    assert decode_step({"dtype": "float32", "max-model-len": 8192}) > 1.5 * base
    assert decode_step({"tensor-parallel-size": 2}) < base


def test_gpu_utilization_is_the_share_of_time_kernels_run():
    def stepped(flags):
        eng = Engine.from_flags(flags, H200, MODEL)
        eng.add_request(EngineRequest("a", [1] * 100, 10000, ignore_eos=True))
        now = 0.0
        while now < 2.0:
            now += eng.step(now).duration_s
        return eng, now

    eng, now = stepped({})
    busy = eng.stats_at(now).gpu_utilization
    # Back-to-back steps, but each has the engine's own work in it, when no kernel runs.
    assert busy == pytest.approx(eng.kernel_s / eng.busy_s, rel=0.02) and 0.7 < busy < 0.97
    assert eng.stats_at(now + 0.5).gpu_utilization == pytest.approx(busy / 2, abs=0.05)
    assert eng.stats_at(now + 5).gpu_utilization == 0.0
    # Under --enforce-eager a decode step waits on its kernel launches: the GPU mostly idles, as
    # nvidia-smi read the H200's eager arms (21-34%), and draws less.
    eager, later = stepped({"enforce-eager": True})
    assert eager.stats_at(later).gpu_utilization < 0.6 * busy
    assert eager.stats_at(later).gpu_power_w < eng.stats_at(now).gpu_power_w


def _first_scheduled_after(policy: str) -> list[str]:
    """Requests admitted one at a time (max-num-seqs 1): a, then b and c that arrive while a runs,
    c with priority -1 (vLLM's extension: smaller is served sooner). The order they first run in."""
    eng = Engine.from_flags({"max-num-seqs": 1, "scheduling-policy": policy}, H200, MODEL)
    reqs = [EngineRequest("a", list(range(100)), 20, ignore_eos=True, arrival_time=0.0),
            EngineRequest("b", list(range(200, 300)), 20, ignore_eos=True, arrival_time=0.001),
            EngineRequest("c", list(range(400, 500)), 20, ignore_eos=True, arrival_time=0.002,
                          priority=-1)]
    eng.add_request(reqs[0])
    res = eng.step(0.0)
    order, now = [o.request_id for o in res.outputs if o.scheduled_s is not None], res.duration_s
    for r in reqs[1:]:
        eng.add_request(r)
    while eng.has_unfinished_requests():
        res = eng.step(now)
        order += [o.request_id for o in res.outputs if o.scheduled_s is not None]
        now += res.duration_s
    return order


def test_priority_policy_serves_the_smaller_priority_first_and_fcfs_ignores_it():
    assert _first_scheduled_after("fcfs") == ["a", "b", "c"]
    assert _first_scheduled_after("priority") == ["a", "c", "b"]


def test_priority_policy_preempts_the_largest_priority_even_if_already_scheduled():
    # A cache too small for both: under fcfs the last admitted is preempted; under priority the
    # one of largest (priority, arrival), here the first admitted, whose decode was scheduled
    # this step already and goes back to the budget.
    def victim(policy):
        eng = Engine.from_flags({"num-gpu-blocks-override": 40, "max-model-len": 600,
                                 "scheduling-policy": policy}, H200, MODEL)
        eng.add_request(EngineRequest("low", list(range(300)), 200, ignore_eos=True,
                                      arrival_time=0.0, priority=5))
        eng.add_request(EngineRequest("high", list(range(1000, 1300)), 200, ignore_eos=True,
                                      arrival_time=0.001, priority=0))
        now = 0.0
        while eng.stats.num_preemptions_total == 0:
            now += eng.step(now).duration_s
            _check_blocks(eng)
        return eng.waiting.peek().id

    assert victim("fcfs") == "high"
    assert victim("priority") == "low"


def test_no_request_lost_under_priority_preemption():
    eng = Engine.from_flags({"num-gpu-blocks-override": 300, "max-model-len": 4096,
                             "max-num-seqs": 64, "max-num-batched-tokens": 2048,
                             "scheduling-policy": "priority"}, H200, MODEL)
    reqs = _random_reqs(80, seed=1, plen=(50, 400), olen=(100, 500))
    for i, r in enumerate(reqs):
        r.priority = i % 3
    outputs, finished, _ = _drive(eng, reqs)
    assert eng.stats.num_preemptions_total > 20
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    assert all(len(outputs[r.request_id]) == r.max_tokens for r in reqs)
    assert eng.kv.num_used == 0


def _cached_after_eviction(**flags) -> tuple[int, float]:
    """A 2,000-token prompt, then three others that push its blocks out of a GPU cache of 200
    blocks, then the first prompt again with a new ending: the tokens the last one found computed,
    and the time until its first token."""
    eng = Engine.from_flags({"num-gpu-blocks-override": 200, "max-model-len": 3000, **flags},
                            H200, MODEL)
    prefix = list(range(10_000, 12_000))
    now = 0.0
    for i, prompt in enumerate([prefix + [1] * 10, *[list(range(20_000 + 3000 * k, 22_000 + 3000 * k))
                                                     for k in range(3)]]):
        eng.add_request(EngineRequest(f"r{i}", prompt, 4, ignore_eos=True, arrival_time=now))
        while eng.has_unfinished_requests():
            now += eng.step(now).duration_s
    eng.add_request(EngineRequest("again", prefix + [2] * 20, 1, ignore_eos=True, arrival_time=now))
    start, cached = now, None
    while eng.has_unfinished_requests():
        res = eng.step(now)
        now += res.duration_s
        cached = next((o.num_cached_tokens for o in res.outputs if o.request_id == "again"), cached)
    return cached, now - start


def test_kv_offloading_keeps_evicted_prefixes_in_host_memory_and_loads_them_back():
    gpu_only, slow = _cached_after_eviction()
    offloaded, fast = _cached_after_eviction(**{"kv-offloading-size": 1})
    assert gpu_only == 0 and offloaded == 2000 // 16 * 16
    # Loading 125 blocks over the host link (16 MiB at 50 GB/s) beats computing 2,000 tokens.
    assert fast < 0.5 * slow
    with pytest.raises(EngineStartError, match="No module named 'lmcache'"):
        Engine.from_flags({"kv-offloading-size": 1, "kv-offloading-backend": "lmcache"}, H200, MODEL)
