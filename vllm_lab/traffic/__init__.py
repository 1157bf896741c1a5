"""The traffic layer: Locust users that time streamed responses, workloads, arrivals and shapes.

The names below are loaded on first use: every Locust process imports this package for the
modules its users need (arrivals, workloads, sse), and the runner's imports (pandas among them)
would add most of a second to each run's start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_lab.traffic.runner import LoadResult, TrafficError, run_load
    from vllm_lab.traffic.sizing import plan_processes
    from vllm_lab.traffic.spec import Lengths, Load, Shape, Stop, Workload

_WHERE = {"LoadResult": "runner", "TrafficError": "runner", "run_load": "runner",
          "plan_processes": "sizing", "Lengths": "spec", "Load": "spec", "Shape": "spec",
          "Stop": "spec", "Workload": "spec"}

__all__ = ["Lengths", "Load", "LoadResult", "Shape", "Stop", "TrafficError", "Workload", "plan_processes",
           "run_load"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
