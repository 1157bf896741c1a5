"""Where a model's weights live and in what bytes: --quantization fp8, --cpu-offload-gb (on the
model runner that offloads) and --kv-cache-memory-bytes move memory between the weights and the
KV cache, and time into or out of every step, for the reasons vLLM's do."""

from __future__ import annotations

import pytest

from vllm_lab import scenarios
from vllm_lab.models import load_model_shape
from vllm_lab.twin.engine import Engine, EngineStartError
from vllm_lab.twin.profile import HOST_LINK_GBS, load_profile, on_hardware

GiB = 1024**3
H200 = load_profile("h200-llama-3-8b")
MODEL = load_model_shape("llama-3-8b")


def engine(profile=H200, environ=None, **flags) -> Engine:
    return Engine.from_flags({k.replace("_", "-"): v for k, v in flags.items()}, profile, MODEL,
                             environ)


def decode_ms(e: Engine, batch: int = 64, context: int = 1000) -> float:
    return float(e.stm.decode_times(batch, batch * context, 1)[0]) * 1e3


def prefill_ms(e: Engine, tokens: int = 4096) -> float:
    return e.stm.step_time(tokens, 1, 1, tokens * (tokens + 1) / 2, tokens) * 1e3


def test_fp8_weights_take_half_the_linear_bytes_and_give_the_cache_the_rest():
    bf16, fp8 = engine(), engine(quantization="fp8")
    # The linear layers in one byte; the embeddings and the LM head stay 16-bit.
    saved = bf16.memory.weights_bytes - fp8.memory.weights_bytes
    assert saved == MODEL.linear_params
    assert fp8.memory.kv_bytes - bf16.memory.kv_bytes == saved
    assert fp8.memory.num_gpu_blocks > bf16.memory.num_gpu_blocks


def test_fp8_steps_read_fewer_bytes_and_multiply_faster_where_the_gpu_has_fp8():
    bf16, fp8 = engine(), engine(quantization="fp8")
    # A decode step of 64 reads the weights: it saves the linear layers' second byte and pays the
    # kernels that quantize each layer's input (measured on an H100: 0.70 ms a step for 32 layers).
    read_saved = bf16.stm.weights_s - fp8.stm.weights_s
    bandwidth = H200.hardware.bandwidth_gbs * 1e9 * H200.coefficients.bandwidth_efficiency
    assert read_saved == pytest.approx(MODEL.linear_params / bandwidth)
    assert fp8.stm.quantize_s == pytest.approx(MODEL.num_layers * H200.coefficients.fp8_layer_overhead_s)
    assert decode_ms(bf16) - decode_ms(fp8) == pytest.approx((read_saved - fp8.stm.quantize_s) * 1e3)
    # A long prefill multiplies: at the H200's fp8 peak, twice the 16-bit one.
    assert prefill_ms(fp8) < 0.7 * prefill_ms(bf16)
    # An A100 has no fp8 arithmetic: vLLM dequantizes to 16 bits, so only the reads shrink.
    a100 = on_hardware(H200, scenarios.resolve("default", "a100-80g").hardware)
    a_bf16, a_fp8 = engine(a100), engine(a100, quantization="fp8")
    assert prefill_ms(a_fp8) == pytest.approx(prefill_ms(a_bf16), rel=0.02)
    assert decode_ms(a_fp8) < 0.85 * decode_ms(a_bf16)


def test_a_method_that_needs_a_quantized_checkpoint_is_refused_as_vllm_refuses_it():
    with pytest.raises(EngineStartError, match="Cannot find the config file for awq") as err:
        engine(quantization="awq")
    assert err.value.cause == "refused-flag"


def test_vllms_default_model_runner_keeps_every_weight_on_the_gpu_whatever_cpu_offload_gb_says():
    # vLLM 0.26 runs dense models on its V2 runner, which never installs the weight offloader:
    # an H100 read the same KV cache (462,944 tokens) and TPOT p50 (7.53 and 7.52 ms) at 0 and
    # 1 GiB (reports/examples/h100, the eleventh host).
    base = engine()
    for environ in (None, {}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}):
        off = engine(environ=environ, cpu_offload_gb=4)
        assert off.memory == base.memory
        assert decode_ms(off) == decode_ms(base) and prefill_ms(off) == prefill_ms(base)


def test_offloaded_weights_free_gpu_memory_and_cost_every_step_the_host_link_on_the_v1_runner():
    base, off = engine(), engine(environ={"VLLM_USE_V2_MODEL_RUNNER": "0"}, cpu_offload_gb=4)
    assert base.memory.weights_bytes - off.memory.weights_bytes == 4 * GiB
    assert off.memory.num_gpu_blocks > base.memory.num_gpu_blocks
    link_ms = 4 * GiB / (HOST_LINK_GBS * 1e9) * 1e3
    # Every step streams them, whatever its batch: a decode step and a prefill alike.
    assert decode_ms(off) - decode_ms(base) == pytest.approx(link_ms, rel=1e-6)
    assert decode_ms(off, batch=1) - decode_ms(base, batch=1) == pytest.approx(link_ms, rel=1e-6)
    assert prefill_ms(off) - prefill_ms(base) == pytest.approx(link_ms, rel=1e-6)


def test_a_kv_cache_given_in_bytes_ignores_the_memory_utilization():
    e = engine(kv_cache_memory_bytes=20 * GiB, max_model_len=8192)
    per_block = MODEL.kv_bytes_per_token(2) * e.cfg.block_size
    assert e.memory.num_gpu_blocks == 20 * GiB // per_block
    assert engine(kv_cache_memory_bytes=20 * GiB, max_model_len=8192,
                  gpu_memory_utilization=0.5).memory.num_gpu_blocks == e.memory.num_gpu_blocks
    with pytest.raises(EngineStartError, match="CUDA out of memory. Tried to allocate 200.00 GiB") as err:
        engine(kv_cache_memory_bytes=200 * GiB)
    assert err.value.cause == "oom"
