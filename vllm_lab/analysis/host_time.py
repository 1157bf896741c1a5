"""Where an experiment's time on its hosts went: server starts, warm-up, the measuring windows, the
load around them, and the lab's own.

A GPU host is booked by the minute, and only the steady windows measure anything. Each command
keeps its span in the experiment's meta (``host_time``: when it began and ended, how long
provisioning and its servers' stops took; ``commands.stopping.keep_host_time``) and each run its
parts (``server_start_s`` and ``warmup_runs_s`` before it on a server started for it; its own
warm-up cut, steady window and drain: ``summary.summarize``). What the spans hold beyond those
parts is the lab's own: provisioning, Ansible, Locust's start, reading the samples, the audit, a
client-limited run taken again. A command on several hosts counts its span once a host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from vllm_lab.run_summary import RunSummary

# The parts, in the order a page lists them, with what each holds.
PARTS: dict[str, str] = {
    "starts": "server starts and stops",
    "warmup": "warm-up: discarded runs after a start, each run's cut before its steady window",
    "measuring": "steady windows (the figures)",
    "drain": "the load after each window, until its last reply",
    "provisioning": "provisioning the hosts",
    "lab": "the lab's own between them (Ansible, Locust's start, reading, the audit)",
}


@dataclass(frozen=True)
class HostTime:
    """Seconds of host time by part (``PARTS``), over every command that took the runs."""

    parts: dict[str, float]
    spans: int  # the commands' spans (a ramp's rounds are one each, a resume one more)
    hosts: int

    @property
    def total_s(self) -> float:
        """Every part together: the commands' spans, once a host."""
        return sum(self.parts.values())

    def share(self, part: str) -> float:
        """A part's share of the total."""
        return self.parts[part] / self.total_s if self.total_s > 0 else 0.0

    @property
    def overhead_share(self) -> float:
        """The lab's own share (provisioning and between the runs) of the total."""
        return self.share("lab") + self.share("provisioning")

    def table(self) -> pd.DataFrame:
        """One row a part: minutes and share, then the total."""
        rows = [{"part": PARTS[p], "minutes": s / 60, "share": self.share(p)}
                for p, s in self.parts.items()]
        rows.append({"part": "total", "minutes": self.total_s / 60, "share": 1.0})
        return pd.DataFrame(rows)


def _run_parts(summary: Mapping[str, Any]) -> dict[str, float]:
    """A run's own parts, in seconds (absent ones 0)."""
    def get(name: str) -> float:
        value = summary.get(name)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0
    return {"starts": get("server_start_s"),
            "warmup": get("warmup_runs_s") + get("warmup_s"),
            "measuring": get("duration_s"),
            "drain": get("drain_s")}


def account(meta: Mapping[str, Any], runs: pd.DataFrame) -> HostTime | None:
    """Where the host time of an experiment (its ``meta`` and ``runs``, as the store gives them)
    went; None for an experiment on the predictor or from before its commands kept their span."""
    spans = [s for s in meta.get("host_time") or [] if isinstance(s, Mapping)]
    if not spans:
        return None
    parts = dict.fromkeys(PARTS, 0.0)
    hosts_seen: set[str] = set()
    for span in spans:
        began, ended = float(span["began"]), float(span["ended"])
        inside = runs[(runs["started"] >= began) & (runs["started"] <= ended)]
        hosts = max(1, inside["host"].nunique())
        hosts_seen.update(inside["host"])
        spent = dict.fromkeys(PARTS, 0.0)
        for row in inside.to_dict("records"):
            for part, seconds in _run_parts(RunSummary.of_row(row)).items():
                spent[part] += seconds
        spent["starts"] += float(span.get("stops_s") or 0.0)
        spent["provisioning"] = float(span.get("provisioned_s") or 0.0) * hosts
        # The rest of the span, on every host, is the lab's own (never below zero: a run's
        # window is stamped by its client, the span by the lab, a few ms apart).
        spent["lab"] = max(0.0, (ended - began) * hosts - sum(spent.values()))
        for part in PARTS:
            parts[part] += spent[part]
    return HostTime(parts, len(spans), max(1, len(hosts_seen)))
