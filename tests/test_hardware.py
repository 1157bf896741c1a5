"""The one hardware schema: a preset, a profile's GPU, and the bridge to a twin server."""

import pytest

from vllm_lab import scenarios
from vllm_lab.hardware import ENV_VAR, Hardware
from vllm_lab.twin.profile import Profile, load_profile, on_hardware


def test_a_preset_reaches_the_twin_as_the_same_gpu():
    preset = scenarios.resolve("default", "a100-80g").hardware
    env = preset.environment()
    assert list(env) == [ENV_VAR]
    assert Hardware.from_environment(env).model_dump() == preset.model_dump()
    assert Hardware.from_environment({}) is None


def test_a_preset_record_keeps_its_keys():
    record = scenarios.resolve("default", "h200").to_record()["hardware"]
    assert list(record) == ["name", "gpu", "gpu_count", "memory_gib", "bandwidth_gbs", "tflops_bf16",
                            "tflops_fp16", "tflops_fp32", "interconnect_gbs", "twin_profile"]


def test_a_profile_written_with_a_tflops_mapping_still_loads():
    data = load_profile("h200-llama-3-8b").model_dump(mode="json")
    hw = data["hardware"]
    hw["tflops"] = {d: hw.pop(f"tflops_{d}") for d in ("bf16", "fp16", "fp32", "fp8")}
    del hw["gpu_count"], hw["interconnect_latency_us"]
    profile = Profile.model_validate(data)
    assert profile.hardware.tflops("fp8") == 1979.0 and profile.hardware.tflops("int4") is None
    assert profile.hardware.gpu_count == 8 and profile.hardware.interconnect_latency_us == 8.0


def test_on_hardware_takes_the_preset_and_keeps_what_it_leaves_out():
    profile = load_profile("h200-llama-3-8b")
    preset = scenarios.resolve("default", "a100-80g").hardware.model_copy(
        update={"interconnect_gbs": 0})
    hw = on_hardware(profile, preset).hardware
    assert hw.memory_gib == preset.memory_gib and hw.gpu_count == preset.gpu_count
    assert hw.interconnect_gbs == profile.hardware.interconnect_gbs
    # An A100 has no fp8 tensor cores: no fp8 peak to scale the profile's to.
    assert hw.tflops("fp8") is None and hw.fp8_compute is False
    h100 = on_hardware(profile, scenarios.resolve("default", "h100-80g").hardware).hardware
    assert h100.tflops("fp8") == 1979.0 / 989.0 * h100.tflops_bf16


def test_a_profile_with_the_retired_l2_share_still_loads_and_reads_l2_by_its_bandwidth():
    """``shared_kv_hit_share`` (profiles of 2026-12-05 to -07) is now the GPU's L2 bandwidth: a
    profile that names it loads, and a GPU whose L2 no preset gives takes 2.5x its HBM's."""
    from vllm_lab.models import load_model_shape
    from vllm_lab.twin.steptime import L2_OVER_HBM, StepTimeModel

    data = load_profile("h100-llama-3-8b").model_dump(mode="json")
    data["coefficients"]["shared_kv_hit_share"] = 0.8
    profile = Profile.model_validate(data)
    assert profile.hardware.l2_bandwidth_gbs == 8500.0
    model = load_model_shape("llama-3-8b")
    a100 = on_hardware(profile, scenarios.resolve("default", "a100-80g").hardware)
    assert a100.hardware.l2_bandwidth_gbs is None
    stm = StepTimeModel(a100, model, 2, 2)
    co = a100.coefficients
    assert stm.kv_l2_s_per_token == pytest.approx(
        stm.kv_s_per_token * (co.kv_bandwidth_efficiency or co.bandwidth_efficiency) / L2_OVER_HBM)


def test_the_kv_cache_is_read_at_its_own_efficiency_and_the_weights_at_theirs():
    """Attention streams the KV cache at ``kv_bandwidth_efficiency`` of the HBM's bandwidth (the
    H100's probe: a fixed decode batch, the context swept), the linear layers read their weights
    at ``bandwidth_efficiency``; a profile that leaves the first unset reads both at the second."""
    from vllm_lab.models import load_model_shape
    from vllm_lab.twin.steptime import StepTimeModel

    model = load_model_shape("llama-3-8b")
    h100 = load_profile("h100-llama-3-8b")
    co = h100.coefficients
    unset = h100.model_copy(update={"coefficients": co.model_copy(update={"kv_bandwidth_efficiency": None})})
    own, same = StepTimeModel(h100, model, 2, 2), StepTimeModel(unset, model, 2, 2)
    assert own.weights_s == same.weights_s
    assert own.kv_s_per_token == pytest.approx(same.kv_s_per_token * co.bandwidth_efficiency
                                               / co.kv_bandwidth_efficiency)
    # Llama-3-8B's 128 KiB a token at the H100's 3.35 TB/s, block visits aside.
    assert own.kv_s_per_token == pytest.approx(131072 / (3350e9 * co.kv_bandwidth_efficiency))
