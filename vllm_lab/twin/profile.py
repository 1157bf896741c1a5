"""Step-time profiles: one small YAML per (GPU, model) with hardware, fitted coefficients, provenance.

The hardware block and the roofline terms carry a profile to other model shapes; the fitted
coefficients say how far the real engine falls short of the roofline and what it costs per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_lab.hardware import Hardware
from vllm_lab.inputs import load_yaml, read_text

PROFILE_DIR = Path(__file__).parent / "profiles"
# What a profile's GPU leaves out: an eight-GPU host with an NVLink-class interconnect.
GPU_COUNT = 8
INTERCONNECT_GBS = 450.0
INTERCONNECT_LATENCY_US = 8.0
# What a GPU reads host memory at when no preset says: PCIe 5.0 x16 carries 64 GB/s a direction,
# about 50 in practice (not measured here).
HOST_LINK_GBS = 50.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Coefficients(_Strict):
    """Fitted numbers: efficiencies against the roofline and fixed costs."""

    gemm_efficiency: float = Field(gt=0, le=1, description="share of peak FLOP/s the linear layers reach")
    attention_efficiency: float = Field(gt=0, le=1, description="share of peak FLOP/s prefill attention reaches")
    bandwidth_efficiency: float = Field(gt=0, le=1, description=(
        "share of HBM bandwidth the linear layers reach reading their weights (many short kernels "
        "a layer, each with its ramp and tail)"))
    kv_bandwidth_efficiency: float | None = Field(default=None, gt=0, le=1, description=(
        "share of HBM bandwidth attention reaches reading the KV cache (one long kernel a layer "
        "streams every sequence's blocks); unset, bandwidth_efficiency. Read where the context "
        "alone changes: a fixed decode batch, each sequence its own cached prompt, its length swept"))
    step_overhead_s: float = Field(ge=0, description="fixed cost of one engine step (schedule, launch, sample)")
    seq_overhead_s: float = Field(ge=0, description="cost per scheduled sequence (inputs, sampling, output)")
    token_overhead_s: float = Field(default=0.0, ge=0, description="cost per scheduled token")
    block_overhead_s: float = Field(default=2e-8, ge=0, description="attention cost per KV block visited")
    eager_layer_overhead_s: float = Field(ge=0, description=(
        "CPU time per layer per step to launch its kernels under --enforce-eager (no torch.compile, "
        "no CUDA graph); it overlaps the GPU's work"))
    compiled_layer_launch_s: float = Field(default=0.0003, ge=0, description=(
        "CPU time per layer per step to launch a compiled step too large for a CUDA graph; it "
        "overlaps the GPU's work"))
    mixed_step_launch_s: float = Field(default=0.0, ge=0, description=(
        "extra time of a step that carries a prompt chunk beside its decodes and fits a CUDA "
        "graph: it runs as a piecewise graph, attention launched layer by layer"))
    fp8_kv_read_share: float = Field(default=0.5, gt=0, le=1, description=(
        "the time attention takes to read an fp8 KV cache, as a share of a 16-bit one's: 0.5 if "
        "halving the bytes halved the time; vLLM's fp8 kernels also quantize the query and "
        "scale what they read"))
    fp8_layer_overhead_s: float = Field(default=2.2e-5, ge=0, description=(
        "GPU time per layer per step that --quantization fp8 adds: the kernels that quantize each "
        "linear layer's input to fp8 with its per-token scales (four a layer), whatever the batch. "
        "Measured on an H100: realtime-chat's TPOT p50 with fp8 weights is 0.70-0.73 of the 16-bit "
        "one at 10 and 25 req/s (reports/examples/h100, h100-chat-fp8 against h100-chat-defaults-c "
        "and -d); halving the weights' bytes alone would make it 0.62"))
    frontend_latency_s: float = Field(ge=0, description="API server path of a request: HTTP, tokenize, detokenize")
    frontend_token_s: float = Field(default=0.0, ge=0, description=(
        "API server CPU per streamed token (detokenize, SSE); one process serves all streams"))
    frontend_request_s: float = Field(default=0.0, ge=0, description=(
        "API server CPU per request (HTTP, chat template, tokenize, hand-off), part of "
        "frontend_latency_s; with --api-server-count N, N processes share the requests"))
    frontend_chat_s: float = Field(default=0.0, ge=0, description=(
        "API server CPU a chat request adds (chat template, larger SSE chunks)"))
    frontend_prompt_token_s: float = Field(default=0.0, ge=0, description=(
        "API server CPU per prompt token of a request (tokenizing, validating and shipping it "
        "to the engine core), paid where frontend_request_s is"))
    frontend_delivery_share: float = Field(default=0.0, ge=0, le=1, description=(
        "the part of frontend_token_s paid per SSE chunk rather than per token: when the API "
        "server is behind, a stream's waiting tokens go out in one chunk, so it catches up"))
    frontend_admission_hops: int = Field(default=1, ge=1, le=64, description=(
        "times a new request crosses the API server's event loop before the engine core has it, "
        "each after at most one output chunk's streaming (about 14 in vLLM 0.26)"))
    cuda_graph_memory_gib: float = Field(ge=0, description="memory CUDA graphs take (none with enforce-eager)")
    non_torch_memory_gib: float = Field(ge=0, description="NCCL, CUDA context and other memory outside torch")
    cuda_graph_max_tokens: int = Field(default=512, ge=0, description="largest batch (tokens) run as a CUDA graph")

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        # shared_kv_hit_share (profiles of 2026-12-05 to -07) is now the GPU's L2 bandwidth
        # (Hardware.l2_bandwidth_gbs): a profile that carries it still loads.
        if isinstance(data, dict) and "shared_kv_hit_share" in data:
            data = {k: v for k, v in data.items() if k != "shared_kv_hit_share"}
        return data


class Provenance(_Strict):
    """Where the coefficients came from."""

    fitted_on: list[str] = Field(default_factory=list)
    fitted_at: str = ""
    method: str = ""
    vllm_version: str = ""
    notes: str = ""
    errors: dict[str, float] = Field(default_factory=dict, description="median abs. relative error per metric")


class Profile(_Strict):
    """A step-time profile: hardware + the model it was fitted on + coefficients + provenance."""

    name: str
    hardware: Hardware
    model: str = Field(description="model shape the coefficients were fitted on")
    coefficients: Coefficients
    provenance: Provenance = Field(default_factory=Provenance)

    @field_validator("hardware")
    @classmethod
    def _host_known(cls, hw: Hardware) -> Hardware:
        # The roofline of tensor parallelism needs these; a profile that leaves them out gets ours.
        return hw.model_copy(update={
            "gpu_count": hw.gpu_count if "gpu_count" in hw.model_fields_set else GPU_COUNT,
            "interconnect_gbs": hw.interconnect_gbs or INTERCONNECT_GBS,
            "interconnect_latency_us": (INTERCONNECT_LATENCY_US if hw.interconnect_latency_us is None
                                        else hw.interconnect_latency_us)})

    def to_yaml(self) -> str:
        """The profile as the YAML text ``load_profile`` reads."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, width=100)


# What is measured on a GPU and holds for that GPU only: its powers (twin/power.py) and the
# bandwidth its L2 serves a shared prompt's repeated reads at.
MEASURED_KEYS = ("power_idle_w", "power_memory_w", "power_compute_w", "power_cap_w", "l2_bandwidth_gbs")


def measured_on(profile: Profile, hardware: Hardware) -> bool:
    """Whether the profile was fitted on the GPU of ``hardware`` (a lab preset): its key, h200 of
    h200 or h100 of h100-80g, is in the name of the profile's own GPU."""
    return (hardware.gpu or "").split("-")[0] in profile.hardware.name.lower().replace(" ", "")


def on_hardware(profile: Profile, hardware: Hardware) -> Profile:
    """The profile's fitted coefficients on another GPU: the roofline takes that GPU's numbers.

    ``hardware`` is a lab hardware preset, as the lab passes it in ``VLLM_TWIN_HARDWARE``; the
    overheads stay those measured on the profile's own GPU, and so do what the preset leaves out
    (the interconnect, the fp8 peak scaled by the bf16 peaks).
    """
    own = profile.hardware
    fp8 = hardware.tflops_fp8
    if hardware.fp8_compute is False:
        fp8 = None  # no fp8 arithmetic to scale to
    elif fp8 is None and own.tflops_fp8 is not None:
        fp8 = own.tflops_fp8 / own.tflops_bf16 * hardware.tflops_bf16
    # What was measured on the profile's own GPU holds only for that GPU: a preset of another
    # keeps the model's shares of its board power (twin/power.py) and the twin's L2 default.
    same = measured_on(profile, hardware)
    hw = hardware.model_copy(update={
        "tflops_fp8": fp8,
        "tdp_w": hardware.tdp_w or (own.tdp_w if same else None),
        **{key: getattr(hardware, key) if getattr(hardware, key) is not None else (
            getattr(own, key) if same else None) for key in MEASURED_KEYS},
        "interconnect_gbs": hardware.interconnect_gbs or own.interconnect_gbs,
        "interconnect_latency_us": (own.interconnect_latency_us if hardware.interconnect_latency_us is None
                                    else hardware.interconnect_latency_us)})
    return profile.model_copy(update={"hardware": hw})


# The coefficients that are the host's CPU time, not the GPU's: the engine core's scheduling, input
# preparation, sampling and kernel launches, and all of the API server's work. The same H200 on
# another host runs them faster or slower together: on the reference set's hosts, one factor of
# 0.75-1.1 on these alone puts light-load TPOT and TTFT within a few percent on each host, where
# they spread 30% between hosts (reference/README.md, "The host's CPU").
HOST_CPU_TERMS = ("step_overhead_s", "seq_overhead_s", "token_overhead_s", "eager_layer_overhead_s",
                  "compiled_layer_launch_s", "mixed_step_launch_s", "frontend_latency_s",
                  "frontend_token_s", "frontend_request_s", "frontend_chat_s",
                  "frontend_prompt_token_s")


def on_host(profile: Profile, cpu_scale: float) -> Profile:
    """The profile on another host of its GPU: its host-CPU terms (``HOST_CPU_TERMS``) times
    ``cpu_scale`` (below 1, a faster host), the GPU's terms as they were."""
    if cpu_scale <= 0:
        raise ValueError(f"cpu_scale must be positive, not {cpu_scale}")
    co = profile.coefficients
    scaled = co.model_copy(update={k: getattr(co, k) * cpu_scale for k in HOST_CPU_TERMS})
    return profile.model_copy(update={"coefficients": scaled})


# vLLM's API server at its own limit, as one H200 host measured it (reference/README.md, "Where the
# API server holds a request": one process carried 12,500 streamed tokens a second at most, about
# 80 µs a token and 2 ms a request). A run the twin has near that limit (frontend.LIMIT_CPU) may
# settle there, where the profile's fitted costs keep it at the engine's limit.
API_LIMIT_TOKEN_S, API_LIMIT_REQUEST_S = 80e-6, 2e-3


def at_api_limit(profile: Profile) -> Profile:
    """The profile with its API server's costs as they are at the server's own limit
    (``API_LIMIT_*``, the larger of those and its own), a chat request's total cost kept."""
    co = profile.coefficients
    request = max(co.frontend_request_s, API_LIMIT_REQUEST_S)
    limit = co.model_copy(update={
        "frontend_token_s": max(co.frontend_token_s, API_LIMIT_TOKEN_S),
        "frontend_request_s": request,
        "frontend_chat_s": max(0.0, co.frontend_chat_s - (request - co.frontend_request_s))})
    return profile.model_copy(update={"coefficients": limit})


def available_profiles() -> list[str]:
    """Names of the profiles shipped with the twin."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a profile by shipped name (``h200-llama-3-8b``) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"twin profile {name_or_path!r}: no such file and not a shipped profile "
                         f"(shipped: {', '.join(available_profiles())})")
    try:  # a profile may be any file a scenario names: read within bounds (InputError)
        data = load_yaml(read_text(path, what="twin profile"), str(path))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: broken YAML ({str(e).splitlines()[0]})") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path}: key {key!r}: {first['msg']}") from None
