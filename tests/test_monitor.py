"""make monitor: scrape targets from the inventory; a real Prometheus (Debian's package) deployed by
playbooks/monitor.yml against a running twin; promtool on the rendered config and alert rules."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import require
from tests.support.processes import TwinProcess, free_port
from vllm_lab import monitor

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "playbooks/roles/grafana/files/dashboards/vllm-lab-overview.json"
ALERTS = {"VllmInstanceDown", "VllmGpuUtilizationLow", "VllmKvCacheNearlyFull",
          "VllmPreemptionsRising", "VllmQueueGrowing", "VllmTtftP99OverSlo", "VllmTpotP99OverSlo"}
ON_A = '{severity: warning, host: a, instance: "a:8000"}'
# What each alert says when it fires on the test series below: labels, summary, description.
EXPECTED_ALERTS = [
    ("VllmInstanceDown", '{severity: critical, job: vllm, instance: "a:8000", host: a}',
     "vLLM instance a:8000 (a) does not answer /metrics",
     "The scrape has failed for a minute: the server is down or unreachable."),
    ("VllmGpuUtilizationLow", "{severity: warning, host: a}", "GPU utilization 40% under load on a",
     ("Below 80% while requests run: the token budget per step may be too small; "
     "try a larger --max-num-batched-tokens.")),
    ("VllmKvCacheNearlyFull", ON_A, "KV cache 99% full on a:8000",
     ("Above 0.95: new requests wait and running ones get preempted; lower --max-num-seqs or "
     "raise --gpu-memory-utilization.")),
    ("VllmPreemptionsRising", ON_A, "1.00 preemptions/s on a:8000",
     ("Requests are being preempted and recomputed: lower --max-num-seqs or give the KV cache "
     "more memory.")),
    ("VllmQueueGrowing", ON_A, "40 requests waiting and growing on a:8000",
     "Arrivals outpace the server: it is past its knee; add capacity or shed load."),
    ("VllmTtftP99OverSlo", ON_A, "TTFT p99 4.96s on a:8000", "Over the SLO of 1.0 s for 5m."),
    ("VllmTpotP99OverSlo", ON_A, "TPOT p99 297.5ms on a:8000", "Over the SLO of 0.05 s for 5m."),
]



def stop_by_pid_file(path: Path) -> None:
    """Stop a daemon the playbook started: its process group, from its pid file."""
    if not path.exists():
        return
    pid = int(path.read_text().split()[0])
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)


@pytest.mark.integration
def test_scrape_targets_from_the_example_fleet():
    targets = monitor.scrape_targets(REPO / "inventory/example-fleet.yml")
    gpu1 = [t for t in targets if t.host == "gpu-1.lab.example"]
    assert [t.url for t in gpu1] == [f"http://10.20.0.11:{p}" for p in (8000, 8001, 8002, 8003)]
    twin = [t for t in targets if t.host == "cpu-1.lab.example"]
    assert [(t.name, t.url) for t in twin] == [("main", "http://10.20.0.21:8000")]


def test_dashboard_covers_what_the_method_watches():
    dash = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "vllm:kv_cache_usage_perc",
                 "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:num_preemptions_total"):
        assert name in exprs
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {"vllm-lab-prometheus"}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """The twin, then monitor.yml on a one-host inventory: node exporter, Prometheus, Grafana skipped."""
    require(None if shutil.which("prometheus") else
            "Debian's prometheus package is not installed (scripts/install-system-deps.sh)")
    tmp = tmp_path_factory.mktemp("monitor")
    twin = TwinProcess(tmp)
    prom_port, node_port = free_port(), free_port()
    inventory = tmp / "inventory.yml"
    inventory.write_text(textwrap.dedent(f"""\
        all:
          vars:
            lab_host_root: {tmp}/root
            prometheus_port: {prom_port}
            prometheus_listen_host: 127.0.0.1
            prometheus_scrape_interval_s: 1
            prometheus_evaluation_interval_s: 1
            prometheus_service_manager: process
            node_exporter_service_manager: process
            node_exporter_port: {node_port}
            node_exporter_listen_host: 127.0.0.1
          children:
            vllm_servers:
              hosts:
                localhost:
                  ansible_connection: local
                  ansible_python_interpreter: "{{{{ ansible_playbook_python }}}}"
                  vllm_backend: twin
                  vllm_advertise_host: 127.0.0.1
                  vllm_instances: [{{name: main, port: {twin.port}}}]
            monitoring:
              hosts:
                localhost: {{}}
        """))
    pid_files = [tmp / "root/prometheus/run/prometheus.pid", tmp / "root/node-exporter/node-exporter.pid"]
    try:
        first = monitor.deploy(inventory)
        yield {"tmp": tmp, "twin": twin, "inventory": inventory, "first": first,
               "prom": monitor.Prometheus(f"http://127.0.0.1:{prom_port}")}
    finally:
        for pid_file in pid_files:
            stop_by_pid_file(pid_file)
        twin.stop()


@pytest.mark.integration
def test_prometheus_scrapes_the_twin_and_reads_back_through_its_api(deployed):
    prom, twin = deployed["prom"], deployed["twin"]
    assert deployed["first"].prometheus[0]["prometheus_url"].endswith(str(prom.url.rsplit(":", 1)[1]))
    blocks = prom.wait_for('vllm:cache_config_info{job="vllm", host="localhost"}', timeout_s=30)
    text = urllib.request.urlopen(twin.url + "/metrics", timeout=5).read().decode()
    # The value Prometheus stored is the one the twin serves: its KV cache size in blocks.
    assert f'num_gpu_blocks="{blocks[0][0]["num_gpu_blocks"]}"' in text
    assert blocks[0][0]["instance"] == f"127.0.0.1:{twin.port}"
    util = prom.wait_for('DCGM_FI_DEV_GPU_UTIL{host="localhost"}')
    assert 0 <= util[0][1] <= 100
    # Every job's target answers: the twin, the node exporter, Prometheus itself.
    deadline = time.monotonic() + 20
    while {labels["job"] for labels, _ in prom.query("up == 1")} != {"vllm", "node", "prometheus"}:
        assert time.monotonic() < deadline, prom.targets()
        time.sleep(0.5)
    assert {t["labels"]["job"] for t in prom.targets()} == {"vllm", "node", "prometheus"}


@pytest.mark.integration
def test_promtool_passes_on_the_deployed_config_and_rules(deployed):
    info = deployed["first"].prometheus[0]
    for kind, path in (("config", info["config"]), ("rules", info["rules"])):
        out = subprocess.run(["promtool", "check", kind, path], capture_output=True, text=True,
                             check=False)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.integration
def test_every_alert_is_loaded_and_healthy(deployed):
    rules = deployed["prom"].rules()
    alerts = {r["name"]: r for r in rules if r["type"] == "alerting"}
    assert ALERTS <= set(alerts)
    # Recording rules and alerts evaluate without error against the twin's series.
    time.sleep(2)
    assert all(r.get("health") in ("ok", "unknown") for r in deployed["prom"].rules()), rules


@pytest.mark.integration
def test_dashboard_panels_show_the_twins_series(deployed):
    """Every panel's query is valid PromQL (a bad one raises MonitorError) and finds the twin's
    series, labelled with its instance; the gauges hold values they can hold."""
    prom, instance = deployed["prom"], f"127.0.0.1:{deployed['twin'].port}"
    dash = json.loads(DASHBOARD.read_text())
    exprs = {t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p["targets"]}
    deadline = time.monotonic() + 30  # a rate() needs two scrapes inside its window
    while True:
        results = {expr: prom.query(expr) for expr in exprs}
        empty = sorted(expr for expr, series in results.items() if not series)
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, f"panels with no data from the twin: {empty}"

    def values(fragment: str) -> list[float]:
        return [v for expr, series in results.items() if fragment in expr for _, v in series]

    assert values('up{job="vllm"}') == [1.0]
    assert values("DCGM_FI_DEV_GPU_UTIL") and all(0 <= v <= 100 for v in values("DCGM_FI_DEV_GPU_UTIL"))
    assert all(0 <= v <= 1 for v in values("vllm:kv_cache_usage_perc"))
    assert all(v >= 0 for v in values("vllm:num_requests_") + values("vllm:num_preemptions_total"))
    per_instance = {labels.get("instance") for expr, series in results.items()
                    if "by (instance)" in expr for labels, _ in series}
    assert per_instance == {instance}


@pytest.mark.integration
def test_alert_rules_fire_on_the_conditions_they_watch(deployed):
    rules = deployed["first"].prometheus[0]["rules"]
    tests = deployed["tmp"] / "alerts-test.yml"
    tests.write_text(textwrap.dedent(f"""\
        rule_files: [{rules}]
        evaluation_interval: 1m
        tests:
          - interval: 1m
            input_series:
              - series: 'up{{job="vllm", instance="a:8000", host="a"}}'
                values: '0x10'
              - series: 'DCGM_FI_DEV_GPU_UTIL{{host="a", gpu="0"}}'
                values: '40x20'
              - series: 'vllm:num_requests_running{{host="a", instance="a:8000"}}'
                values: '32x20'
              - series: 'vllm:kv_cache_usage_perc{{host="a", instance="a:8000"}}'
                values: '0.99x20'
              - series: 'vllm:num_preemptions_total{{host="a", instance="a:8000"}}'
                values: '0+60x20'
              - series: 'vllm:num_requests_waiting{{host="a", instance="a:8000"}}'
                values: '10+2x20'
              - series: 'vllm:time_to_first_token_seconds_bucket{{host="a", instance="a:8000", le="1.0"}}'
                values: '0+1x20'
              - series: 'vllm:time_to_first_token_seconds_bucket{{host="a", instance="a:8000", le="5.0"}}'
                values: '0+100x20'
              - series: 'vllm:time_to_first_token_seconds_bucket{{host="a", instance="a:8000", le="+Inf"}}'
                values: '0+100x20'
              - series: 'vllm:inter_token_latency_seconds_bucket{{host="a", instance="a:8000", le="0.05"}}'
                values: '0+1x20'
              - series: 'vllm:inter_token_latency_seconds_bucket{{host="a", instance="a:8000", le="0.3"}}'
                values: '0+100x20'
              - series: 'vllm:inter_token_latency_seconds_bucket{{host="a", instance="a:8000", le="+Inf"}}'
                values: '0+100x20'
            alert_rule_test:
        """) + "".join(
        f"      - {{eval_time: 15m, alertname: {name}, exp_alerts: [{{exp_labels: {labels}, "
        f"exp_annotations: {{summary: {json.dumps(summary)}, description: {json.dumps(desc)}}}}}]}}\n"
        for name, labels, summary, desc in EXPECTED_ALERTS)
        # Not yet: the condition holds, but for less than the alert's `for:`.
        + "      - {eval_time: 3m, alertname: VllmKvCacheNearlyFull, exp_alerts: []}\n")
    out = subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.integration
def test_grafana_is_skipped_with_a_reason_where_no_package_source_offers_it(deployed):
    if shutil.which("grafana-server") or Path("/usr/sbin/grafana-server").exists():
        pytest.skip("Grafana is installed here")
    assert deployed["first"].grafana_skipped == ["localhost"]


@pytest.mark.integration
def test_a_second_run_changes_nothing(deployed):
    again = monitor.deploy(deployed["inventory"])
    assert again.changed == 0, again.changed_tasks()
    assert deployed["prom"].ready()
