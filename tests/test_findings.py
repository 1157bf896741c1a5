"""Troubleshooting findings: each pattern of the tuning guide, the numbers it cites, the flag to try."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_lab.analysis import findings
from vllm_lab.store import Store


def _row(serve: dict | None = None, load: dict | None = None, **figures) -> dict:
    base = {"experiment_id": "e", "run_key": "k", "scenario_name": "default", "status": "ok",
            "error": "", "requests": 200.0, "gpu_util_mean": 92.0, "queue_len_mean": 0.2,
            "queue_len_max": 2.0, "ttft_p50": 0.1, "ttft_p99": 0.3, "preemptions": 0.0,
            "kv_usage_max": 0.6, "output_throughput": 2500.0,
            "scenario_json": json.dumps({"serve": {"model": "m", **(serve or {})},
                                         **({"load": load} if load else {})})}
    return {**base, **figures}


def kinds(row) -> list[str]:
    return [f.kind for f in findings.findings(row)]


def test_a_healthy_run_has_no_finding():
    assert kinds(_row()) == []


def test_small_token_budget_under_80_percent_gpu_raises_the_budget():
    [f] = findings.findings(_row({"max-num-batched-tokens": 1024}, gpu_util_mean=58.0,
                                 queue_len_mean=6.5, queue_len_max=20.0, output_throughput=900.0))
    assert f.kind == "budget"
    assert "58%" in f.evidence and "6.5 requests waiting" in f.evidence and "1024" in f.evidence
    assert f.flags == {"max-num-batched-tokens": 2048}
    # GPU under 80% with nothing waiting is a light load, not a budget problem.
    assert kinds(_row(gpu_util_mean=40.0, queue_len_mean=0.0)) == []


def test_requests_waiting_behind_a_full_batch_raise_max_num_seqs_not_the_budget():
    """The H200's max-num-seqs sweep at 256 users (`reports/examples/h200-llama8b`): at 64, GPU
    66% busy with 92 waiting, where a bigger budget schedules nothing more."""
    waiting = {"gpu_util_mean": 66.0, "queue_len_mean": 91.8, "queue_len_max": 192.0,
               "output_throughput": 7464.0}
    closed = {"mode": "closed", "shape": {"kind": "constant", "level": 256}}
    [f] = findings.findings(_row({"max-num-seqs": 64}, load=closed, **waiting))
    assert f.kind == "batch-cap" and f.flags == {"max-num-seqs": 128}
    assert f.evidence.endswith("at max-num-seqs=64, a closed loop of 256 users")
    # vLLM's own count of running requests, where the run kept it, decides.
    [f] = findings.findings(_row({"max-num-seqs": 64}, summary={"running_max": 64.0}, **waiting))
    assert f.kind == "batch-cap" and "64 running at most" in f.evidence
    [f] = findings.findings(_row({"max-num-seqs": 64}, load=closed, summary={"running_max": 40.0},
                                 **waiting))
    assert f.kind == "budget"
    # Fewer users than the cap (or an open loop): the budget it is.
    assert kinds(_row({"max-num-seqs": 512}, load=closed, **waiting)) == ["budget"]


def test_latency_swing_with_long_prompts_caps_long_prefills():
    [f] = findings.findings(_row(ttft_p50=0.08, ttft_p99=1.2, prompt_p50=150.0, prompt_p99=3800.0))
    assert f.kind == "long-prefill"
    assert "15.0x" in f.evidence and "3800" in f.evidence
    assert f.flags["long-prefill-token-threshold"] == 2048  # a quarter of the default 8192 budget
    # Not V0's max-num-partial-prefills: vLLM's V1 engine refuses to start with it above 1.
    assert set(f.flags) == {"long-prefill-token-threshold"}
    # A swing without long prompts or a queue has another cause.
    assert kinds(_row(ttft_p50=0.08, ttft_p99=1.2, prompt_p50=150.0, prompt_p99=300.0,
                      queue_len_max=0.0)) == []


def test_oom_at_high_memory_utilization_lowers_it():
    row = _row({"gpu-memory-utilization": 0.95}, status="oom",
               error="oom: torch.OutOfMemoryError: CUDA out of memory\nTraceback ...")
    [f] = findings.findings(row)
    assert f.kind == "oom" and "0.95" in f.evidence and "CUDA out of memory" in f.evidence
    assert f.flags == {"gpu-memory-utilization": 0.9}
    # vLLM's default 0.92 counts as high; a low setting that OOMs is another problem.
    assert kinds(_row(status="oom")) == ["oom"]
    assert kinds(_row({"gpu-memory-utilization": 0.7}, status="oom")) == []


def test_preemption_storm_lowers_max_num_seqs_or_raises_memory():
    [f] = findings.findings(_row({"max-num-seqs": 512, "gpu-memory-utilization": 0.85},
                                 preemptions=180.0, kv_usage_max=0.99))
    assert f.kind == "preemption-storm"
    assert "180 preemptions over 200 requests" in f.evidence and "99%" in f.evidence
    assert f.flags == {"max-num-seqs": 256, "gpu-memory-utilization": 0.9}
    # A few preemptions are normal under load.
    assert kinds(_row(preemptions=5.0, kv_usage_max=0.99)) == []


def test_describe_names_the_flag_to_try():
    [f] = findings.findings(_row(preemptions=100.0, kv_usage_max=1.0))
    text = findings.describe(f)
    # Half of vLLM's default on a large GPU (1024, from the flag catalog).
    assert "--max-num-seqs 512" in text and "Preemption storm" in text


def test_a_figure_not_measured_is_left_out_never_printed_as_nan():
    [f] = findings.findings(_row(ttft_p50=0.08, ttft_p99=1.2, prompt_p50=150.0, prompt_p99=3800.0,
                                 queue_len_max=None))
    assert f.kind == "long-prefill" and "nan" not in f.evidence and "waiting" not in f.evidence
    [f] = findings.findings(_row(ttft_p50=0.08, ttft_p99=1.2, prompt_p50=150.0, prompt_p99=3800.0))
    assert "up to 2 requests waiting" in f.evidence
    [f] = findings.findings(_row(gpu_util_mean=58.0, queue_len_mean=6.5, queue_len_max=None,
                                 output_throughput=None))
    assert f.kind == "budget" and "nan" not in f.evidence
    assert "(max" not in f.evidence and "output not measured" in f.evidence


def test_a_host_whose_cpu_quota_stalled_the_run_is_named_and_fewer_api_servers_tried():
    """A run records its host's cores and the time its CPU quota stalled it (in its summary, no
    column): past 2% of the sending, the figures are the host's, and a pick with several
    API-server processes is told to try half."""
    stalled = {"client_host_cpus": 16.0, "client_host_throttled_s": 1.8, "send_span_s": 30.0}
    [f] = findings.findings(_row({"api-server-count": 4}, summary=stalled))
    assert f.kind == "starved-host" and f.flags == {"api-server-count": 2}
    assert "16 cores" in f.evidence and "1.8 s of 30 s" in f.evidence and "(6%)" in f.evidence
    assert "4 API-server processes" in f.evidence
    [smt] = findings.findings(_row(summary={**stalled, "client_host_physical_cores": 8.0}))
    assert "16 cores (8 physical)" in smt.evidence
    [one] = findings.findings(_row(summary=stalled))
    assert one.flags == {} and "fewer API-server" not in one.advice
    assert findings.describe(one).splitlines()[1].strip().startswith("vLLM's engine core")
    # Under 2% of the sending, or with no count (no quota, another kernel), nothing is said.
    assert kinds(_row(summary={**stalled, "client_host_throttled_s": 0.5})) == []
    assert kinds(_row(summary={"client_host_cpus": 16.0, "send_span_s": 30.0})) == []


def test_a_ttft_that_vllm_puts_in_its_api_server_asks_for_more_api_server_processes():
    """vLLM's account of the ShareGPT file at 256 users on an H200 (`traffic-2026-12-05b`): a mean
    TTFT of 1.54 s, 27 ms of it queued and 139 ms from scheduling to first token; the rest is the
    API server's, whose process used a core."""
    held = {"server_ttft_mean": 1.54, "server_queue_mean": 0.027, "server_prefill_mean": 0.139,
            "server_api_cpu": 1.03}
    [f] = findings.findings(_row(summary=held))
    assert f.kind == "api-server" and f.flags == {"api-server-count": 2}
    assert "1,374 ms of its 1,540 ms mean TTFT" in f.evidence
    assert "27 ms queued, 139 ms from scheduling" in f.evidence
    assert "one API-server process using 1.03 of a core" in f.evidence
    [two] = findings.findings(_row({"api-server-count": 2}, summary=held))
    assert two.flags == {"api-server-count": 4} and "2 API-server processes" in two.evidence
    # An engine that holds the TTFT (its queue), or an API server's part under 0.1 s, is not it.
    assert kinds(_row(summary={**held, "server_queue_mean": 1.2})) == []
    assert kinds(_row(summary={**held, "server_ttft_mean": 0.25})) == []
    assert kinds(_row(summary={k: v for k, v in held.items() if k != "server_prefill_mean"})) == []
    # At that limit the API server, not the budget, leaves the GPU idle while a few requests wait.
    busy = {"gpu_util_mean": 75.0, "queue_len_mean": 2.5, "queue_len_max": 35.0}
    assert kinds(_row(summary=held, **busy)) == ["api-server"]
    assert kinds(_row(summary={**held, "server_queue_mean": 1.2}, **busy)) == ["budget"]
    # A host whose quota stalled the run is short of cores: more processes would starve it more.
    starved = {"client_host_cpus": 16.0, "client_host_throttled_s": 1.8, "send_span_s": 30.0}
    assert kinds(_row(summary={**held, **starved})) == ["starved-host"]


def test_the_api_server_finding_named_the_pick_an_h100_then_measured():
    """`make autotune` on the fourth H100 host (`reports/examples/h100`, `-h`): at the level that
    broke vLLM's defaults (31.4 req/s of chat), vLLM's own histograms put 121 of a 151-ms mean TTFT
    outside its engine, and the finding asks for two API-server processes. The pick the search
    made, fp8 with two processes, then held 48.1 req/s (+55%), and its staircase has no finding."""
    db = Path(__file__).resolve().parents[1] / "reports/examples/h100/lab.db"
    exp = "autotune-realtime-chat-h100-h"
    with Store(db) as store:
        said = {c: [(row["point"]["load.shape.level"], f)
                    for row in store.runs(f"{exp}-{c}").to_dict("records")
                    for f in findings.findings(row)] for c in ("defaults", "c1")}
    [(level, f)] = said["defaults"]
    assert level == 31.401 and f.kind == "api-server" and f.flags == {"api-server-count": 2}
    assert "121 ms of its 151 ms mean TTFT" in f.evidence
    assert said["c1"] == []
