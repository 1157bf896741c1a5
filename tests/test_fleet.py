"""A fleet of three hosts on this machine (network namespaces, veth pairs, one sshd each), provisioned
over SSH and serving the twin; one host is cut off mid-run, is reported, and the others finish."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import require
from tests.support.fleet import (
    TWIN_MODEL,
    NetnsFleet,
    fleet_unavailable_reason,
    lab_source_snapshot,
    shared_site_vars,
)
from vllm_lab import serving

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def fleet(tmp_path):
    require(fleet_unavailable_reason())
    fleet = NetnsFleet(tmp_path, size=3)
    try:
        fleet.up({**shared_site_vars(),
                  "lab_host_lab_source": str(lab_source_snapshot(tmp_path / "lab-src")),
                  "vllm_twin_startup_seconds": 0.5, "vllm_health_timeout_s": 30,
                  "vllm_instances": [{"name": "main", "port": 8000, "gpus": ""}]})
        yield fleet
    finally:
        fleet.down()


def _health(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=3) as resp:
        return resp.status


def test_fleet_provisions_serves_and_survives_a_lost_host(fleet, caplog):
    inv = fleet.inventory
    first = serving.run_playbook("provision.yml", inventory=inv)
    assert first.returncode == 0, first.stdout[-3000:]
    assert set(first.recap) == {h.name for h in fleet.hosts}
    assert all(c["failed"] == 0 and c["unreachable"] == 0 for c in first.recap.values())
    again = serving.run_playbook("provision.yml", inventory=inv)
    assert again.returncode == 0 and again.changed == 0, again.stdout[-3000:]

    lost = fleet.hosts[2]
    conf = lost.root / "serve" / "conf" / "main.yaml"
    cutter_done = threading.Event()

    def cut_when_configured():
        # Mid-run: once serve.yml has rendered the lost host's config, its link and sshd go.
        deadline = time.monotonic() + 60
        while not conf.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.cut(lost)
        cutter_done.set()

    cutter = threading.Thread(target=cut_when_configured, daemon=True)
    cutter.start()
    caplog.set_level(logging.WARNING, logger="vllm_lab.serving")
    began = time.monotonic()
    instances = serving.start({"model": TWIN_MODEL, "max-num-seqs": 32}, inventory=inv, backend="twin")
    took = time.monotonic() - began
    cutter.join(timeout=5)
    assert cutter_done.is_set()

    assert sorted(i.host for i in instances) == ["fleet-1", "fleet-2"]
    assert list(instances.unreachable) == [lost.name]
    assert any(lost.name in r.getMessage() and "unreachable" in r.getMessage() for r in caplog.records)
    for inst in instances:
        host = next(h for h in fleet.hosts if h.name == inst.host)
        assert inst.url == f"http://{host.address}:8000"
        assert _health(inst.url) == 200
        assert Path(inst.log_path).exists()
    assert took < 120, f"serve.yml took {took:.0f} s with one host lost"

    run = serving.stop(inv)
    assert lost.name in run.unreachable
    for host in fleet.hosts[:2]:
        assert not list((host.root / "serve" / "run").glob("*.pid"))
        with pytest.raises(OSError):
            _health(f"http://{host.address}:8000")
    print(json.dumps({"serve_s": round(took, 1), "recap": run.recap}))
