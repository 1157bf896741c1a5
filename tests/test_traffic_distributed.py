"""Distributed load over SSH: a Locust master here, workers on two hosts of the network-namespace
fleet (tests/support/fleet.py) provisioned as load generators by provision.yml, against a twin
served here. Every worker's raw samples come back, are merged, and the percentiles are the pooled
samples' own."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import urllib.request

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.support import require
from tests.support.fleet import (
    REPO,
    TWIN_MODEL,
    NetnsFleet,
    fleet_unavailable_reason,
    host_side_address,
    lab_source_snapshot,
    make_loadgen,
    route_to_this_machine,
    shared_site_vars,
)
from tests.support.processes import TwinProcess
from vllm_lab import serving
from vllm_lab.traffic import Lengths, Load, Workload, run_load
from vllm_lab.traffic import samples as samples_mod
from vllm_lab.traffic.arrivals import client_overloaded
from vllm_lab.traffic.runner import LAB_HOST_ROOT_DEFAULT, WorkerHost, _worker_cmd, loadgen_workers

pytestmark = pytest.mark.integration

SHORT = Workload(source="synthetic", input=Lengths(mean=64), output=Lengths(mean=16))


def test_loadgen_hosts_run_the_provisioned_venv(tmp_path):
    # Variables as Ansible renders them: group_vars' templates, role defaults where none is set.
    shutil.copytree(REPO / "inventory/group_vars", tmp_path / "group_vars")
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {
        "vllm_servers": {"hosts": {"gpu-1": {"ansible_host": "10.0.0.1"}}},
        "loadgen": {"hosts": {
            "load-1": {"ansible_host": "10.0.0.31", "ansible_user": "lab", "ansible_port": 2222,
                       "ansible_ssh_private_key_file": "/k/id", "lab_host_root": "/srv/lab",
                       "ansible_ssh_common_args": "-o StrictHostKeyChecking=no"},
            "load-2": {"ansible_host": "10.0.0.32"},
            "load-3": {"ansible_host": "10.0.0.33", "lab_host_lab_install": False,
                       "lab_host_python": "/usr/local/bin/python3.11"},
            "here": {"ansible_connection": "local"}}}}}}))
    w = {h.name: h for h in loadgen_workers(inv)}
    assert sorted(w) == ["here", "load-1", "load-2", "load-3"]
    assert w["load-1"] == WorkerHost(
        name="load-1", address="10.0.0.31", python="/srv/lab/venv/bin/python", user="lab",
        port=2222, key="/k/id", ssh_args=("-o", "StrictHostKeyChecking=no"), root="/srv/lab")
    defaults = yaml.safe_load((REPO / "playbooks/roles/lab_host/defaults/main.yml").read_text())
    assert defaults["lab_host_root"] == LAB_HOST_ROOT_DEFAULT
    assert w["load-2"].python == f"{LAB_HOST_ROOT_DEFAULT}/venv/bin/python"
    assert w["load-3"].python == "/usr/local/bin/python3.11"  # the lab is not provisioned there
    assert w["here"].local and not w["load-1"].local
    cmd = _worker_cmd(w["load-1"], "10.0.0.9", 5557, "/srv/lab/traffic/r/traffic_config.json", 1)
    assert cmd[:2] == ["ssh", "-o"] and "lab@10.0.0.31" in cmd and cmd[cmd.index("-p") + 1] == "2222"
    assert "exec /srv/lab/venv/bin/python -m locust" in cmd[-1] and "python3 " not in cmd[-1]
    # The lab deals each host its first share of an open loop's schedule (ssh passes no environment).
    assert "VLLM_LAB_FIRST_SHARE=0 " in cmd[-1]
    assert "VLLM_LAB_FIRST_SHARE=4 " in _worker_cmd(w["load-1"], "10.0.0.9", 5557, "c", 2, 4)[-1]
    # The container inventory: the lab is not installed there, its one load generator is here.
    (box,) = loadgen_workers(REPO / "inventory/container.yml")
    assert box.local and _worker_cmd(box, "127.0.0.1", 1, "c", 1)[0] == sys.executable


@pytest.fixture(scope="module")
def loadgen_fleet(tmp_path_factory):
    require(fleet_unavailable_reason())
    tmp = tmp_path_factory.mktemp("loadgen-fleet")
    fleet = NetnsFleet(tmp, size=2)
    try:
        fleet.up({**shared_site_vars(),
                  "lab_host_lab_source": str(lab_source_snapshot(tmp / "lab-src"))})
        make_loadgen(fleet)
        route_to_this_machine(fleet)
        began = time.monotonic()
        serving.provision(fleet.inventory, timeout=240)
        fleet.provision_s = time.monotonic() - began
        yield fleet
    finally:
        fleet.down()


def successes(url: str) -> float:
    """Requests the twin says it served (vllm:request_success_total over its labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    counts = re.findall(r"^vllm:request_success_total\S* (\S+)$", text, re.MULTILINE)
    return sum(float(m) for m in counts)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_workers_on_two_hosts_over_ssh_merge_raw_samples(loadgen_fleet, tmp_path):
    fleet = loadgen_fleet
    workers = loadgen_workers(fleet.inventory)
    assert [w.name for w in workers] == ["fleet-1", "fleet-2"]
    for w, host in zip(workers, fleet.hosts):
        assert not w.local and w.address == host.address
        assert w.python == str(host.root / "venv" / "bin" / "python")  # what provision.yml made

    # cpu-demo: slow steps, light on CPU; served on one host's link address, so every host reaches it.
    twin = TwinProcess(tmp_path, model=TWIN_MODEL, host=host_side_address(fleet.hosts[0]),
                       startup_s=0.2, health_timeout_s=30)
    began = time.monotonic()
    try:
        load = Load(mode="closed", shape={"level": 4}, stop={"duration_s": 60, "max_requests": 40},
                    request_timeout_s=30)
        r = run_load(twin.url, TWIN_MODEL, SHORT, load, tmp_path / "run", workers_hosts=workers,
                     scrape_interval_s=1.0)
        served = successes(twin.url)
    finally:
        twin.stop()
    took = time.monotonic() - began

    # Every worker ran on its host, from the venv provision.yml made, and sent its share.
    assert r.stop_reason == "max_requests", (tmp_path / "run" / "locust.stdout").read_text()[-3000:]
    by_host = {s["host"]: s for s in r.workers}
    assert sorted(by_host) == ["fleet-1", "fleet-2"]
    for host in fleet.hosts:
        assert by_host[host.name]["python"] == str(host.root / "venv" / "bin" / "python")
    df = r.samples
    df_host = df.worker.str.rsplit("-", n=1).str[0]
    assert set(df_host) == {"fleet-1", "fleet-2"}
    assert set(df.worker) == {s["worker"] for s in r.workers}

    # Counts add up: the merged frame, each host's raw file and the server agree.
    files = sorted((tmp_path / "run" / "samples").glob("*.jsonl"))
    per_file = {f.stem: samples_mod.read_worker_file(f) for f in files}
    assert sorted(per_file) == sorted(set(df.worker))
    assert len(df) == sum(len(x) for x in per_file.values()) == 40
    assert all(len(x) > 0 for x in per_file.values())
    # One pool across hosts: the master deals the first 40 of the seed's sequence, once each, to
    # whichever user is free, on either host.
    assert sorted(df["index"]) == list(range(40)) and df.request_id.is_unique
    assert (df.status == "ok").all() and served == 40
    # Locust's master table heard from the workers, never more than was sent. Not all of it: a
    # master that quits waits half a second for the last reports, which a busy host can miss
    # (34 of 40 was seen), so the lab's counts come from the raw samples.
    stats = pd.read_csv(tmp_path / "run" / "locust_stats.csv").set_index("Name")
    assert 0 < stats.loc["Aggregated", "Request Count"] <= 40
    assert stats.loc["Aggregated", "Failure Count"] == 0

    # Percentiles come from the pooled raw samples, not from per-worker figures.
    pooled = np.concatenate([x.ttft_s.to_numpy(float) for x in per_file.values()])
    summary = samples_mod.summarize(df)
    assert summary["ttft_p99_s"] == pytest.approx(np.percentile(pooled, 99), rel=1e-12)
    assert summary["ttft_p50_s"] == pytest.approx(np.percentile(pooled, 50), rel=1e-12)

    # Each host's run folder is gone once its samples are here.
    for host in fleet.hosts:
        assert not list((host.root / "traffic").glob("*")), list((host.root / "traffic").iterdir())
    # The client's health is the merged workers' (the worst worker decides); whether this shared
    # machine kept up is not this test's to say.
    assert r.loop_lag_p99_s == max(w["loop_lag"]["p99"] for w in r.workers)
    assert r.cpu_fraction_max == max(w["cpu_fraction"] for w in r.workers)
    assert r.client_overloaded == client_overloaded(r.schedule_lag_p99_s, r.loop_lag_p99_s,
                                                    r.cpu_fraction_max, load.max_schedule_lag_s)
    print(json.dumps({"provision_s": round(fleet.provision_s, 1), "load_s": round(took, 1),
                      "per_host": df_host.value_counts().to_dict(),
                      "ttft_p50_s": round(summary["ttft_p50_s"], 4),
                      "ttft_p99_s": round(summary["ttft_p99_s"], 4)}))
