"""Step-time profiles: one small YAML per (GPU, model) with hardware, fitted coefficients, provenance.

The hardware block and the roofline terms carry a profile to other model shapes; the fitted
coefficients say how far the real engine falls short of the roofline and what it costs per step.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROFILE_DIR = Path(__file__).parent / "profiles"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hardware(_Strict):
    """One GPU as the roofline sees it."""

    name: str
    memory_gib: float = Field(gt=0, description="GPU memory visible to torch, GiB")
    bandwidth_gbs: float = Field(gt=0, description="HBM bandwidth, GB/s")
    tflops: dict[str, float] = Field(description="dense peak TFLOP/s per dtype (bf16, fp16, fp32, fp8)")
    interconnect_gbs: float = Field(default=450.0, gt=0, description="per-GPU all-reduce bandwidth, GB/s")
    interconnect_latency_us: float = Field(default=8.0, ge=0, description="latency of one all-reduce")
    gpu_count: int = Field(default=8, ge=1, description="GPUs per host, the ceiling for tensor parallelism")


class Coefficients(_Strict):
    """Fitted numbers: efficiencies against the roofline and fixed costs."""

    gemm_efficiency: float = Field(gt=0, le=1, description="share of peak FLOP/s the linear layers reach")
    attention_efficiency: float = Field(gt=0, le=1, description="share of peak FLOP/s prefill attention reaches")
    bandwidth_efficiency: float = Field(gt=0, le=1, description="share of HBM bandwidth reached")
    step_overhead_s: float = Field(ge=0, description="fixed cost of one engine step (schedule, launch, sample)")
    seq_overhead_s: float = Field(ge=0, description="cost per scheduled sequence (inputs, sampling, output)")
    token_overhead_s: float = Field(default=0.0, ge=0, description="cost per scheduled token")
    block_overhead_s: float = Field(default=2e-8, ge=0, description="attention cost per KV block visited")
    eager_layer_overhead_s: float = Field(ge=0, description="kernel-launch cost per layer per step without CUDA graphs")
    frontend_latency_s: float = Field(ge=0, description="API server path of a request: HTTP, tokenize, detokenize")
    frontend_token_s: float = Field(default=0.0, ge=0, description=(
        "API server CPU per streamed token (detokenize, SSE); one process serves all streams"))
    cuda_graph_memory_gib: float = Field(ge=0, description="memory CUDA graphs take (none with enforce-eager)")
    non_torch_memory_gib: float = Field(ge=0, description="NCCL, CUDA context and other memory outside torch")
    cuda_graph_max_tokens: int = Field(default=512, ge=0, description="largest batch (tokens) run as a CUDA graph")


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

    def to_yaml(self) -> str:
        """The profile as the YAML text ``load_profile`` reads."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, width=100)


def on_hardware(profile: Profile, hardware: dict) -> Profile:
    """The profile's fitted coefficients on another GPU: the roofline takes that GPU's numbers.

    ``hardware`` is a lab hardware preset's ``hardware:`` block (memory_gib, bandwidth_gbs,
    tflops_bf16/fp16/fp32, interconnect_gbs, gpu_count), as the lab passes it in
    ``VLLM_TWIN_HARDWARE``; the overheads stay those measured on the profile's own GPU.
    """
    tflops = dict(profile.hardware.tflops)
    for dtype in ("bf16", "fp16", "fp32"):
        if f"tflops_{dtype}" in hardware:
            tflops[dtype] = float(hardware[f"tflops_{dtype}"])
    if "fp8" in tflops and "tflops_bf16" in hardware:
        tflops["fp8"] = tflops["fp8"] / profile.hardware.tflops["bf16"] * tflops["bf16"]
    hw = profile.hardware.model_copy(update={
        "name": hardware.get("name", profile.hardware.name),
        "memory_gib": float(hardware.get("memory_gib", profile.hardware.memory_gib)),
        "bandwidth_gbs": float(hardware.get("bandwidth_gbs", profile.hardware.bandwidth_gbs)),
        "interconnect_gbs": float(hardware.get("interconnect_gbs") or profile.hardware.interconnect_gbs),
        "gpu_count": int(hardware.get("gpu_count", profile.hardware.gpu_count)),
        "tflops": tflops})
    return profile.model_copy(update={"hardware": hw})


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
    data = yaml.safe_load(path.read_text())
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path}: key {key!r}: {first['msg']}") from None
