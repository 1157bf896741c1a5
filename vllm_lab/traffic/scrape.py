"""Scrape a server's Prometheus /metrics, and the host's GPU telemetry, into (ts, name, labels, value).

GPU telemetry comes from nvidia-smi when the host has it, under DCGM exporter names so the rows
look the same as the twin's simulated DCGM_* series (which arrive with /metrics itself).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request

import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

COLUMNS = ("ts", "name", "labels", "value")

# nvidia-smi query field -> (DCGM exporter metric name, factor to DCGM's unit)
_SMI_FIELDS = {
    "utilization.gpu": ("DCGM_FI_DEV_GPU_UTIL", 1.0),
    "memory.used": ("DCGM_FI_DEV_FB_USED", 1.0),  # MiB, as DCGM reports it
    "memory.free": ("DCGM_FI_DEV_FB_FREE", 1.0),
    "power.draw": ("DCGM_FI_DEV_POWER_USAGE", 1.0),
    "temperature.gpu": ("DCGM_FI_DEV_GPU_TEMP", 1.0),
    "clocks.sm": ("DCGM_FI_DEV_SM_CLOCK", 1.0),
}


def parse_metrics(text: str, ts: float) -> list[tuple[float, str, str, float]]:
    """Turn a Prometheus text page into rows; labels are a sorted JSON object string."""
    rows = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rows.append((ts, s.name, json.dumps(dict(sorted(s.labels.items()))), float(s.value)))
    return rows


# The GPU's own energy counter since the driver loaded, in mJ as DCGM reports it: what a run's
# energy is the difference of (power samples every few seconds would miss its bursts).
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"


def _nvml_energy(ts: float) -> list[tuple[float, str, str, float]]:
    """Each GPU's total energy counter through NVML (nvidia-ml-py), when the host has it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        rows = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mj = float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            rows.append((ts, ENERGY, json.dumps({"gpu": str(i), "source": "nvml"}), mj))
        return rows
    except Exception:  # noqa: BLE001 - no NVML, no GPU, or a GPU without the counter: no rows
        return []


def gpu_rows(ts: float, smi: str | None = None) -> list[tuple[float, str, str, float]]:
    """Query nvidia-smi (if on PATH) for each GPU's telemetry as DCGM-named rows, and NVML for
    its energy counter; else none."""
    smi = smi or shutil.which("nvidia-smi")
    if not smi:
        return []
    fields = list(_SMI_FIELDS)
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index," + ",".join(fields), "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        labels = json.dumps({"gpu": parts[0], "source": "nvidia-smi"})
        for field, raw in zip(fields, parts[1:], strict=False):
            name, factor = _SMI_FIELDS[field]
            try:
                rows.append((ts, name, labels, float(raw) * factor))
            except ValueError:
                continue  # "[N/A]" on GPUs that do not report the field
    return rows + _nvml_energy(ts)


class Scraper:
    """A background thread scraping /metrics (and GPU telemetry) every `interval_s` seconds."""

    def __init__(self, base_url: str, interval_s: float = 2.0, gpu: bool = True):
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.gpu = gpu
        self.rows: list[tuple[float, str, str, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)

    def scrape_once(self) -> None:
        """Take one scrape now."""
        ts = time.time()
        try:
            with urllib.request.urlopen(self.url, timeout=min(5.0, self.interval_s * 2)) as r:
                self.rows += parse_metrics(r.read().decode(), ts)
        except (OSError, ValueError):
            self.errors += 1
        if self.gpu:
            self.rows += gpu_rows(ts)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.scrape_once()
            self._stop.wait(self.interval_s)

    def start(self) -> Scraper:
        """Start scraping in the background."""
        self._thread.start()
        return self

    def stop(self) -> pd.DataFrame:
        """Stop, take a last scrape and return all rows as a DataFrame."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.scrape_once()
        return frame(self.rows)


def frame(rows: list[tuple[float, str, str, float]]) -> pd.DataFrame:
    """Return rows as a (ts, name, labels, value) DataFrame."""
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype(
        {"ts": "float64", "name": "string", "labels": "string", "value": "float64"}
    )
