"""The simulated GPU's power draw: a model, and named as one wherever its figures are shown.

A GPU that serves and has nothing to run still draws power (clocks held up, memory refreshed); a
busy one draws more the more of its time is arithmetic rather than waiting on memory. The twin
prices each step's energy as its duration times the busy power at the step's compute share (the
share of its linear layers' time spent on arithmetic: small decode batches read weights, big
prefill chunks multiply), and the time between steps at the idle power. Measured on one H200
(reference/h200-vllm0.26/traffic-2026-12-01/power.csv, NVML): 79 W with no server, 121 W serving
with nothing to run, about 290 W decoding for one user (memory-bound steps back to back), the
700 W board limit with prefills of thousands of tokens. A GPU without measurements gets those
shares of its board power (``Hardware.tdp_w``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Shares of the board power an H200 drew: serving with nothing to run, busy on memory-bound steps.
IDLE_SHARE = 121.0 / 700.0
MEMORY_SHARE = 290.0 / 700.0
# Board power of the shipped presets' GPUs (a preset's ``gpu`` key), for one that sets no tdp_w.
TDP_W = {"h200": 700.0, "h100": 700.0, "a100": 400.0, "rtx3090": 350.0, "cpu-demo": 150.0}
DEFAULT_TDP_W = 700.0


@dataclass(frozen=True)
class PowerModel:
    """Idle, memory-bound busy and compute-bound busy power of one GPU, in watts."""

    idle_w: float
    memory_w: float
    max_w: float

    @classmethod
    def of(cls, hardware) -> PowerModel:
        """The model for a `Hardware` (its measured powers, else shares of its board power)."""
        key = str(getattr(hardware, "gpu", None) or "")
        by_key = next((w for k, w in TDP_W.items() if key.startswith(k)), DEFAULT_TDP_W)
        tdp = float(getattr(hardware, "tdp_w", None) or by_key)
        idle = getattr(hardware, "power_idle_w", None)
        memory = getattr(hardware, "power_memory_w", None)
        return cls(float(idle if idle is not None else IDLE_SHARE * tdp),
                   float(memory if memory is not None else MEMORY_SHARE * tdp), tdp)

    def busy_w(self, compute_share: float) -> float:
        """Power while a step runs whose linear layers are ``compute_share`` arithmetic-bound."""
        share = min(1.0, max(0.0, compute_share))
        return self.memory_w + (self.max_w - self.memory_w) * share
