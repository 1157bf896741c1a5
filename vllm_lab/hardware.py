"""One GPU as the lab and the twin see it: the one hardware schema.

A scenario's hardware preset (``scenarios/hardware/<name>.yaml``) and a twin profile's ``hardware:``
block are both a ``Hardware``; the lab hands the scenario's to a twin server it starts as this
class's JSON in ``VLLM_TWIN_HARDWARE``, and the server reads it back with this class.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

ENV_VAR = "VLLM_TWIN_HARDWARE"
DTYPES = ("bf16", "fp16", "fp32", "fp8")


class Hardware(BaseModel):
    """One GPU model and how many of them a host has; the twin computes step times from these."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(description="Human name, printed on every report figure.")
    gpu: str | None = Field(None, description="Short key, e.g. h200 (a preset's; a profile has none).")
    gpu_count: int = Field(1, ge=1, description="GPUs per host, the ceiling for tensor parallelism.")
    memory_gib: float = Field(gt=0, description="Memory of one GPU as the driver reports it.")
    bandwidth_gbs: float = Field(gt=0, description="HBM bandwidth, GB/s.")
    tflops_bf16: float = Field(gt=0, description="Dense peak TFLOP/s in bf16.")
    tflops_fp16: float = Field(gt=0)
    tflops_fp32: float = Field(gt=0)
    tflops_fp8: float | None = Field(None, gt=0, description="None: the twin scales its profile's by bf16.")
    fp8_compute: bool | None = Field(None, description=(
        "Whether its tensor cores multiply in fp8 (Ada, Hopper and later; None: yes). Without, vLLM "
        "runs an fp8-quantized model's layers on 16-bit arithmetic (weight-only Marlin kernels)."))
    host_link_gbs: float | None = Field(None, gt=0, description=(
        "CPU-to-GPU bandwidth one GPU reads host memory at, GB/s (None: the twin's PCIe 5.0 x16 "
        "figure): --kv-offloading-size loads KV blocks over it, and --cpu-offload-gb (on vLLM's V1 "
        "model runner) streams the offloaded weights over it every step."))
    l2_bandwidth_gbs: float | None = Field(None, gt=0, description=(
        "Bytes a second the GPU's L2 cache serves reads at, GB/s (None: the twin takes 2.5x the HBM "
        "bandwidth, as an H100 read): a KV block several running requests share (a common prompt "
        "prefix) is read from memory once a step and from L2 by the others."))
    interconnect_gbs: float = Field(0, ge=0, description="GPU-to-GPU bandwidth per direction, GB/s; 0: unknown.")
    interconnect_latency_us: float | None = Field(None, ge=0, description="Latency of one all-reduce.")
    twin_profile: str | None = Field(None, description="Twin profile (vllm_lab/twin/profiles/) for this GPU.")
    tdp_w: float | None = Field(None, gt=0, description="Board power limit, W: the twin's power model scales with it.")
    power_idle_w: float | None = Field(None, ge=0, description="Measured power serving with nothing to run, W.")
    # The next three are fitted to measured energy (twin/power.py): a second of the twin's kernel
    # time draws idle + these, read where vLLM's GPU ran them.
    power_memory_w: float | None = Field(None, ge=0, description=(
        "Power a second of the twin's kernel time draws when it waits on memory (decodes), W."))
    power_compute_w: float | None = Field(None, ge=0, description=(
        "Power a second of the twin's kernel time would draw all arithmetic, before the cap, W."))
    power_cap_w: float | None = Field(None, ge=0, description=(
        "The most a second of the twin's kernel time draws: the board's limit as that time reads it, W."))

    @model_validator(mode="before")
    @classmethod
    def _flat_tflops(cls, data: Any) -> Any:
        # Profiles written before the one schema spelled the peaks as a mapping: tflops: {bf16: 989}.
        if isinstance(data, Mapping) and isinstance(data.get("tflops"), Mapping):
            data = {**{k: v for k, v in data.items() if k != "tflops"},
                    **{f"tflops_{dtype}": value for dtype, value in data["tflops"].items()}}
        return data

    @model_serializer(mode="wrap")
    def _without_unset_optionals(self, handler: Any) -> dict[str, Any]:
        # A field left None is not written: a preset's record (and its run identity) and a profile's
        # YAML keep the keys they always had.
        return {k: v for k, v in handler(self).items() if v is not None}

    def tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for ``dtype`` (bf16, fp16, fp32, fp8), None when not known."""
        return getattr(self, f"tflops_{dtype}", None) if dtype in DTYPES else None

    def environment(self) -> dict[str, str]:
        """The environment that tells a twin server it simulates this GPU."""
        return {ENV_VAR: self.model_dump_json()}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Hardware | None:
        """The GPU ``environment()`` named, or None when none was."""
        text = (os.environ if environ is None else environ).get(ENV_VAR)
        return cls.model_validate_json(text) if text else None
