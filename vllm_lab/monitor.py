"""Long-term monitoring: the scrape targets an inventory defines, ``make monitor`` (playbooks/monitor.yml)
and queries through Prometheus's HTTP API.

Prometheus, its alert rules, the node exporter and Grafana are set up by the roles ``prometheus``,
``node_exporter`` and ``grafana``; this module runs that playbook and reads Prometheus back.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_lab import serving

DEFAULT_INSTANCES = [{"name": "main", "port": 8000}]


class MonitorError(RuntimeError):
    """Monitoring cannot do what was asked; the message is one sentence for the user."""


@dataclass(frozen=True)
class Target:
    """One vLLM (or twin) instance to scrape: its inventory host, instance name and base URL."""

    host: str
    name: str
    url: str
    backend: str = "twin"

    @property
    def metrics_url(self) -> str:
        """Where its /metrics answers."""
        return self.url + "/metrics"


def _address(host: str, hostvars: dict[str, Any]) -> str:
    """The address clients use: vllm_advertise_host unless it is a template, else ansible_host."""
    advertised = str(hostvars.get("vllm_advertise_host") or "")
    if advertised and "{{" not in advertised:
        return advertised
    return str(hostvars.get("ansible_host") or host)


def scrape_targets(inventory: Path, group: str = "vllm_servers") -> list[Target]:
    """Every vllm_instances entry of every host of ``group``: what Prometheus scrapes and the watch probes."""
    exe = str(Path(serving._ansible_playbook()).with_name("ansible-inventory"))
    out = subprocess.run([exe, "-i", str(inventory), "--list"], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise MonitorError(f"{inventory}: ansible-inventory failed: {out.stderr.strip()[-300:]}")
    data = json.loads(out.stdout)
    hostvars = data.get("_meta", {}).get("hostvars", {})
    hosts = list(data.get(group, {}).get("hosts", []))
    for child in data.get(group, {}).get("children", []):
        hosts += [h for h in data.get(child, {}).get("hosts", []) if h not in hosts]
    targets = []
    for host in hosts:
        hv = hostvars.get(host, {})
        instances = hv.get("vllm_instances") or DEFAULT_INSTANCES
        for inst in instances:
            targets.append(Target(host, str(inst["name"]), f"http://{_address(host, hv)}:{int(inst['port'])}",
                                  str(hv.get("vllm_backend", "twin"))))
    if not targets:
        raise MonitorError(f"{inventory}: no hosts in group {group}: nothing to monitor")
    return targets


@dataclass
class Deployment:
    """What ``make monitor`` set up: per monitoring host, where Prometheus answers; Grafana's state."""

    prometheus: list[dict[str, Any]]
    grafana_skipped: list[str]
    changed: int
    targets: list[Target]
    log: str = ""

    def changed_tasks(self) -> list[str]:
        """The names of the tasks that changed something (for idempotency checks)."""
        lines = self.log.splitlines()
        return [lines[i - 1] for i, ln in enumerate(lines) if ln.startswith("changed:") and i]


def deploy(inventory: Path, extra_vars: dict[str, Any] | None = None,
           timeout: float | None = 600) -> Deployment:
    """Run playbooks/monitor.yml on the inventory and return where Prometheus answers."""
    targets = scrape_targets(inventory)
    with tempfile.TemporaryDirectory(prefix="vllm-lab-monitor-") as results:
        run = serving.run_playbook("monitor.yml", inventory=Path(inventory), timeout=timeout,
                                   extra_vars={**(extra_vars or {}), "prometheus_result_dir": results})
        found = [json.loads(p.read_text()) for p in sorted(Path(results).glob("*-prometheus.json"))]
    if run.returncode or not found:
        failed = [ln for ln in run.stdout.splitlines() if ln.startswith(("fatal:", "failed:"))]
        raise MonitorError(f"monitor.yml failed on {', '.join(h for h, c in run.recap.items() if c.get('failed')) or 'the inventory'}: "
                           + (failed[-1][:400] if failed else run.stdout.strip().splitlines()[-1][:400]))
    skipped = [ln.split("Grafana skipped on ", 1)[1].split(":", 1)[0]
               for ln in run.stdout.splitlines() if "Grafana skipped on " in ln]
    return Deployment(found, skipped, run.changed, targets, run.stdout)


def describe(d: Deployment) -> str:
    """What a deployment gives the user, in a few lines."""
    lines = [f"Prometheus: {p['prometheus_url']} (config {p['config']}, alert rules {p['rules']})"
             for p in d.prometheus]
    lines += [f"scraping {len(d.targets)} vLLM instance(s): "
              + ", ".join(f"{t.host}/{t.name} {t.url}" for t in d.targets)]
    lines += [f"Grafana skipped on {h}: no package source offers it (set grafana_apt_repository)"
              for h in d.grafana_skipped]
    lines.append(f"{d.changed} change(s)")
    return "\n".join(lines)


class Prometheus:
    """A Prometheus server's HTTP API (``/api/v1``)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=self.timeout) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            raise MonitorError(f"Prometheus {self.url}: {body.get('error', e.reason)}") from None
        except (urllib.error.URLError, OSError) as e:
            raise MonitorError(f"Prometheus {self.url} does not answer ({e})") from None
        if body.get("status") != "success":
            raise MonitorError(f"Prometheus {self.url}: {body.get('error', 'query failed')}")
        return body["data"]

    def ready(self) -> bool:
        """Whether /-/ready answers 200."""
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=self.timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query: (labels, value) per series."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._get("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float,
                    step: float) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """A range query: (labels, [(time, value), ...]) per series."""
        data = self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end,
                                                 "step": step})
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets with their health and last error."""
        return self._get("/api/v1/targets")["activeTargets"]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (alerting and recording) with its state."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def wait_for(self, expr: str, timeout_s: float = 30.0,
                 poll_s: float = 0.5) -> list[tuple[dict[str, str], float]]:
        """Poll ``expr`` until it returns a series; MonitorError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = self.query(expr)
            except MonitorError:
                result = []
            if result:
                return result
            if time.monotonic() > deadline:
                raise MonitorError(f"Prometheus {self.url}: no series for {expr!r} after {timeout_s:.0f} s")
            time.sleep(poll_s)
