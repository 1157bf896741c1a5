"""The simulated GPU's power draw: a model, and named as one wherever its figures are shown.

A GPU that serves and has no kernel to run still draws power (clocks held up, memory refreshed):
``idle_w``, 121 W on an H200 with the server up (reference/h200-vllm0.26/traffic-2026-12-01,
NVML). It draws the rest only while its kernels run, and not while it waits on the host: the
engine's own work each step, and the kernel launches no CUDA graph covers, which under
--enforce-eager are most of a decode step. So each step's energy is its whole time at the idle
power plus its kernel time (the step time model's roofline terms) at what kernels add; between
steps, the idle power.

What a second of kernel time draws grows with the share of it that is arithmetic (``compute
share``: a decode batch mostly reads the weights and the cache, a long prompt chunk multiplies)
and stops at the board's limit, where the GPU lowers its clocks. vLLM's batched steps sit near
that limit: one H200 drew 600-690 W over whole runs of batched traffic, an H100 550-670 W.

The three figures a second of kernel time draws are fitted to measured energy (NVML's energy
counter over each run's steady window, vllm_lab.energy), not read off a datasheet, and they are
what the twin's kernel time needs, not what a kernel draws: the twin counts the roofline's time,
and the GPU also runs sampling and copies in what it counts as the host's (utilization measured
78% where the twin reads 69% on the H200's batched runs), so a second of the twin's kernel time
carries more than a second of the board at its limit; over a step the board's limit (``tdp_w``)
holds. Fitted on the H200's claims and sweeps (`reports/examples/claims-h200`, `h200-llama8b`) and
read on its autotunes and repeats, held out (`autotune-h200`, `baseline-h200`): median 5.2%, worst
11.9% of the measured power; the H100's on its three calibration plans and read on its 109 other
runs (`reports/examples/h100`): median 1.7%, and on a request trace replayed later, traffic no fit
saw, within 2.5% (CUDA graphs) and 12% (--enforce-eager). A GPU without measurements gets the
H200's figures as shares of its board power (``tdp_w``); `make calibrate` fits them on its plan's
runs that carry the energy counter (``fit``; the H100's three plans give 500 / 1,612 / 918 W from
those shares, and read its 109 other runs within 2.4%, the trace within 0.9%, medians).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# Shares of the H200's 700 W board power: serving with nothing to run (measured), and what a second
# of the twin's kernel time draws memory-bound, all arithmetic before the cap, and at most (fitted).
IDLE_SHARE = 121.0 / 700.0
MEMORY_SHARE = 614.0 / 700.0
COMPUTE_SHARE = 1338.0 / 700.0
CAP_SHARE = 876.0 / 700.0
# Board power of the shipped presets' GPUs (a preset's ``gpu`` key), for one that sets no tdp_w.
TDP_W = {"h200": 700.0, "h100": 700.0, "a100": 400.0, "rtx3090": 350.0, "cpu-demo": 150.0}
DEFAULT_TDP_W = 700.0


@dataclass(frozen=True)
class PowerModel:
    """One GPU's idle power, and what a second of the twin's kernel time draws, in watts."""

    idle_w: float
    memory_w: float
    compute_w: float
    cap_w: float
    board_w: float  # the board's power limit: no stretch of time draws more on average

    @classmethod
    def of(cls, hardware) -> PowerModel:
        """The model for a `Hardware` (its measured powers, else shares of its board power)."""
        key = str(getattr(hardware, "gpu", None) or "")
        by_key = next((w for k, w in TDP_W.items() if key.startswith(k)), DEFAULT_TDP_W)
        tdp = float(getattr(hardware, "tdp_w", None) or by_key)

        def measured(name: str, share: float) -> float:
            value = getattr(hardware, name, None)
            return float(value if value is not None else share * tdp)

        return cls(measured("power_idle_w", IDLE_SHARE), measured("power_memory_w", MEMORY_SHARE),
                   measured("power_compute_w", COMPUTE_SHARE), measured("power_cap_w", CAP_SHARE), tdp)

    def kernel_w(self, compute_share):
        """Power while kernels run whose time is ``compute_share`` arithmetic-bound (a number, or
        an array of them)."""
        share = np.clip(compute_share, 0.0, 1.0)
        return np.minimum(self.cap_w, self.memory_w + (self.compute_w - self.memory_w) * share)

    def step_j(self, duration_s, kernel_s, compute_share):
        """A step's energy (or each of an array of steps'): its whole time at the idle power, its
        kernel time at what kernels add, never more than the board's limit over the step."""
        drawn = duration_s * self.idle_w + kernel_s * (self.kernel_w(compute_share) - self.idle_w)
        return np.minimum(drawn, duration_s * self.board_w)

    def counter(self, step_log: np.ndarray, gpus: int, end: float) -> np.ndarray:
        """The energy counter of a run whose engine stepped ``step_log`` (rows of start, seconds,
        kernel seconds, compute share, from a start at 0): rows of (seconds, joules since then) at
        each step's start and end and at ``end``, the time between steps at the idle power."""
        start, dur, kernel, share = step_log.reshape(-1, 4).T
        energy = self.step_j(dur, kernel, share) * gpus
        stepped = np.cumsum(dur) - dur                       # the engine's seconds before each step
        at_start = np.cumsum(energy) - energy + (start - stepped) * self.idle_w * gpus
        rows = np.column_stack([np.column_stack([start, start + dur]).ravel(),
                                np.column_stack([at_start, at_start + energy]).ravel()])
        total = float(energy.sum()) + max(0.0, end - float(dur.sum())) * self.idle_w * gpus
        return np.vstack([rows, [end, total]])


@dataclass(frozen=True)
class WindowSteps:
    """A run's steps inside its steady window (each step's part of it) and the power measured there."""

    seconds: np.ndarray   # each step's seconds inside the window
    kernel_s: np.ndarray  # of them, its kernels' (the same share of the step)
    share: np.ndarray     # its kernels' compute share
    window_s: float
    measured_w: float     # every GPU's together, as the energy counters read it
    gpus: int

    @classmethod
    def of(cls, step_log: np.ndarray, t0: float, t1: float, measured_w: float, gpus: int) -> WindowSteps:
        """From a predicted run's step log (rows of start, seconds, kernel seconds, compute share)."""
        start, dur, kernel, share = step_log.T
        inside = np.clip(np.minimum(start + dur, t1) - np.maximum(start, t0), 0.0, None)
        part = np.divide(inside, dur, out=np.zeros_like(dur), where=dur > 0)
        keep = inside > 0
        return cls(inside[keep], (kernel * part)[keep], share[keep], t1 - t0, measured_w, gpus)

    def power_w(self, model: PowerModel) -> float:
        """The run's mean power over its window on ``model``."""
        steps = model.step_j(self.seconds, self.kernel_s, self.share).sum()
        idle = max(0.0, self.window_s - float(self.seconds.sum())) * model.idle_w
        return (float(steps) + idle) * self.gpus / self.window_s


def fit(runs: list[WindowSteps], start: PowerModel) -> PowerModel:
    """``start`` with the three figures of a second of kernel time fitted to measured runs (a soft
    L1 loss on the log of each run's power: a few runs off by their own noise do not pull it);
    the idle power and the board's limit are kept."""
    from scipy.optimize import least_squares

    measured = np.log([r.measured_w for r in runs])

    # Arithmetic draws more than waiting on memory: compute as memory plus a rise of 0 or more.
    def model(x: np.ndarray) -> PowerModel:
        return replace(start, memory_w=float(x[0]), compute_w=float(x[0] + x[1]), cap_w=float(x[2]))

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log([r.power_w(model(x)) for r in runs]) - measured

    low, high = start.idle_w + 1.0, 5.0 * start.board_w
    x0 = [min(max(start.memory_w, low + 1.0), high - 1.0), max(start.compute_w - start.memory_w, 1.0),
          min(max(start.cap_w, low + 1.0), high - 1.0)]
    result = least_squares(residuals, x0, loss="soft_l1", f_scale=0.05,
                           bounds=([low, 0.0, low], [high, high, high]))
    return model(result.x)
