"""The traffic layer: Locust users that time streamed responses, workloads, arrivals and shapes."""

from vllm_lab.traffic.runner import LoadResult, TrafficError, run_load
from vllm_lab.traffic.sizing import plan_processes
from vllm_lab.traffic.spec import Lengths, Load, Shape, Stop, Workload

__all__ = ["Lengths", "Load", "LoadResult", "Shape", "Stop", "TrafficError", "Workload", "plan_processes",
           "run_load"]
