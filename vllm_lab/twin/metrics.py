"""The twin's /metrics: vLLM's Prometheus series, simulated DCGM GPU series, and the twin's own lag.

Names, types, labels (``model_name``, ``engine``) and histogram buckets follow vLLM 0.26's
``vllm/v1/metrics/loggers.py``. Gauges and counters that mirror engine state are read from
``engine.stats`` at scrape time (a custom collector), so the hot path only observes histograms.
GPU series use the DCGM exporter's names and labels (``gpu``, ``UUID``, ``device``, ``modelName``,
``Hostname``) so dashboards built for a GPU host read the twin unchanged.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# The twin's own event-loop lag: fine below a step (ms) up to clearly broken (s).
LAG_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``, as vLLM builds its token-count buckets."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _StateCollector:
    """Scrape-time gauges and counters read from the engine and the GPU simulation."""

    def __init__(self, metrics: TwinMetrics):
        self.m = metrics

    def collect(self):
        m = self.m
        # At the scrape's moment on the engine's clock (perf_counter): an idle GPU reads idle.
        s = m.engine.stats_at(max(m.engine.clock, time.perf_counter()))
        labels = ["model_name", "engine"]
        values = [m.model_name, "0"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    s.num_waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints.",
            labels=labels + ["reason"])
        by_reason.add_metric(values + ["capacity"], float(s.num_waiting))
        by_reason.add_metric(values + ["deferred"], 0.0)
        yield by_reason
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state.",
                                  labels=labels + ["sleep_state"])
        for state, v in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            sleep.add_metric(values + [state], v)
        yield sleep
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.num_preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      s.prompt_tokens_total)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source",
                                        "Number of prompt tokens by source.",
                                        labels=labels + ["source"])
        hits = min(s.prefix_cache_hits, s.prompt_tokens_total)
        by_source.add_metric(values + ["local_compute"], float(s.prompt_tokens_total - hits))
        by_source.add_metric(values + ["local_cache_hit"], float(hits))
        by_source.add_metric(values + ["external_kv_transfer"], 0.0)
        yield by_source
        yield counter("vllm:prompt_tokens_cached",
                      "Number of cached prompt tokens (local + external).", hits)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      s.generation_tokens_total)
        yield m.cache_config_family()
        yield from m.gpu_families(s)
        yield from m.lag_families()
        if m.frontend is not None and m.frontend.processes == 1:
            # As vLLM's one API-server process exports its CPU: here the modelled API server's
            # busy time (twin/frontend.py), not this process's own.
            yield CounterMetricFamily("process_cpu_seconds", "Total user and system CPU time spent "
                                      "in seconds.", value=m.frontend.busy_s)


class TwinMetrics:
    """All series of the twin's /metrics, with the hooks the server calls as requests progress."""

    def __init__(self, engine: Any, model_name: str, max_model_len: int,
                 cache_config: dict[str, Any], gpu: dict[str, Any]):
        self.engine = engine
        self.model_name = model_name
        self.cache_config = cache_config
        self.gpu = gpu  # name, count, power_idle_w, power_max_w
        self.lag_current_s = 0.0
        self.lag_max_s = 0.0
        self.frontend: Any = None  # the API server the engine loop models, once it runs
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StateCollector(self))
        ln = ["model_name", "engine"]
        lv = (model_name, "0")
        tokens_buckets = build_1_2_5_buckets(max_model_len)

        def hist(name, doc, buckets):
            return Histogram(name, doc, ln, buckets=buckets, registry=self.registry).labels(*lv)

        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ln + ["finished_reason"], registry=self.registry)
        self.request_success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        self.prompt_tokens_req = hist("vllm:request_prompt_tokens",
                                      "Number of prefill tokens processed.", tokens_buckets)
        self.generation_tokens_req = hist("vllm:request_generation_tokens",
                                          "Number of generation tokens processed.", tokens_buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.max_num_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens_buckets)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                             [1, 2, 5, 10, 20])
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.",
                                      tokens_buckets)
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot_req = hist("vllm:request_time_per_output_token_seconds",
                             "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.prefill_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens_buckets)
        self.lag = Histogram("twin:event_loop_lag_seconds",
                             "How late the twin released a step's outputs against its ideal "
                             "timeline (real clock minus planned time).",
                             buckets=LAG_BUCKETS, registry=self.registry)
        self.coalesced = Counter("twin:coalesced_tokens",
                                 "Tokens sent in the same SSE event as an earlier token because "
                                 "the host fell behind (as --stream-interval would).",
                                 registry=self.registry)
        self.sse_events = Counter("twin:sse_events", "SSE data events carrying tokens.",
                                  registry=self.registry)

    def observe_step(self, num_tokens: int, lag_s: float) -> None:
        """One engine step released: its scheduled tokens and how late the release was."""
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        self.lag.observe(lag_s)
        self.lag_current_s = lag_s
        self.lag_max_s = max(self.lag_max_s, lag_s)

    def observe_request_start(self, max_tokens: int) -> None:
        """A request was accepted."""
        self.params_n.observe(1)
        self.params_max_tokens.observe(max_tokens)
        self.max_num_generation_tokens.observe(max_tokens)

    def observe_finished(self, reason: str, e2e_s: float, queue_s: float, prefill_s: float,
                         decode_s: float, num_prompt: int, num_cached: int,
                         num_generated: int) -> None:
        """A request finished; times on the twin's ideal timeline."""
        self.request_success[reason].inc()
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        self.prefill.observe(prefill_s)
        self.decode.observe(decode_s)
        self.inference.observe(prefill_s + decode_s)
        self.prompt_tokens_req.observe(num_prompt)
        self.generation_tokens_req.observe(num_generated)
        self.prefill_kv_computed.observe(max(0, num_prompt - num_cached))
        if num_generated > 1:
            self.tpot_req.observe(decode_s / (num_generated - 1))

    def cache_config_family(self) -> GaugeMetricFamily:
        """vllm:cache_config_info: a gauge fixed at 1 whose labels are the cache config."""
        keys = list(self.cache_config) + ["engine"]
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig", labels=keys)
        info.add_metric([str(v) for v in self.cache_config.values()] + ["0"], 1.0)
        return info

    def gpu_families(self, s) -> list[GaugeMetricFamily]:
        """Simulated GPU telemetry under the DCGM exporter's names, one sample per GPU."""
        labels = ["gpu", "UUID", "device", "modelName", "Hostname"]
        host = socket.gethostname()
        count = max(1, int(self.gpu.get("count", 1)))
        util = max(0.0, min(1.0, float(s.gpu_utilization)))
        used_mib = s.gpu_memory_used_bytes / 2**20 / count
        free_mib = max(0.0, (s.gpu_memory_total_bytes - s.gpu_memory_used_bytes) / 2**20 / count)
        fams = {
            "DCGM_FI_DEV_GPU_UTIL": ("GPU utilization (in %).", util * 100.0),
            "DCGM_FI_DEV_FB_USED": ("Framebuffer memory used (in MiB).", used_mib),
            "DCGM_FI_DEV_FB_FREE": ("Framebuffer memory free (in MiB).", free_mib),
            # The twin's power model (twin/power.py), not a measurement.
            "DCGM_FI_DEV_POWER_USAGE": ("Power draw (in W), modelled.", s.gpu_power_w / count),
        }
        out = []
        for name, (doc, value) in fams.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            for i in range(count):
                uuid = f"GPU-7717a1b0-0000-4000-8000-{i:012d}"
                g.add_metric([str(i), uuid, f"nvidia{i}", self.gpu.get("name", "NVIDIA H200"),
                              host], value)
            out.append(g)
        # DCGM's name as it has it, no "_total" (prometheus_client adds one to a counter family).
        energy = GaugeMetricFamily("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                                   "Total energy consumption since the server started (in mJ), "
                                   "modelled.", labels=labels)
        for i in range(count):
            uuid = f"GPU-7717a1b0-0000-4000-8000-{i:012d}"
            energy.add_metric([str(i), uuid, f"nvidia{i}", self.gpu.get("name", "NVIDIA H200"), host],
                              s.gpu_energy_j * 1000.0 / count)
        out.append(energy)
        return out

    def lag_families(self) -> list[GaugeMetricFamily]:
        """The current and worst event-loop lag, for a quick look without histogram maths."""
        cur = GaugeMetricFamily("twin:event_loop_lag_current_seconds",
                                "Lag of the most recent step release.", value=self.lag_current_s)
        worst = GaugeMetricFamily("twin:event_loop_lag_max_seconds",
                                  "Worst step-release lag since start.", value=self.lag_max_s)
        return [cur, worst]

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
