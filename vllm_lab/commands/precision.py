"""PRECISION=: how narrow each point's 95% intervals must be (half-width over the mean, per
metric), and the most runs a point may take to get there; judged over a point's ok runs so far.
An ``Experiment`` takes its points in rounds until they are this precise."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from vllm_lab import plans, stats
from vllm_lab.run_summary import RunSummary

# The metrics PRECISION may name, and the short names it takes for them.
PRECISION_METRICS = ("output_throughput", "request_throughput", "goodput", "ttft_p50", "tpot_p50",
                     "itl_p50", "e2e_p50", "ttft_p99", "tpot_p99", "e2e_p99")
_PRECISION_ALIASES = {"throughput": "output_throughput", "ttft": "ttft_p50", "tpot": "tpot_p50",
                      "itl": "itl_p50", "e2e": "e2e_p50"}


class PrecisionError(ValueError):
    """A PRECISION the lab cannot take."""


@dataclass(frozen=True)
class Precision:
    """How narrow each point's 95% intervals must be (half-width over the mean, per metric), and
    the most runs a point may take to get there."""

    targets: dict[str, float] = field(default_factory=lambda: {
        "output_throughput": 0.02, "ttft_p50": 0.05, "tpot_p50": 0.05})
    max_repeats: int = 10
    min_repeats: int = 3  # two runs give a t-interval 12.7 standard errors wide

    @classmethod
    def parse(cls, text: str) -> Precision:
        """``default`` (or 1/on), or items like ``throughput=2%,ttft=5%,max=8``."""
        rule = ("write PRECISION=default (±2% throughput, ±5% TTFT and TPOT p50, at most 10 runs) "
                "or items like throughput=2%,ttft_p50=5%,max=8 (metrics: "
                + ", ".join(PRECISION_METRICS) + ")")
        if text.strip().lower() in ("default", "1", "on", "yes", "true"):
            return cls()
        targets, cap = {}, cls.max_repeats
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, sep, value = item.partition("=")
            name = _PRECISION_ALIASES.get(name.strip(), name.strip())
            try:
                if name == "max" and sep:
                    cap = int(value)
                    if cap < 2:
                        raise ValueError
                    continue
                share = float(value.strip().removesuffix("%")) / (100 if value.strip().endswith("%") else 1)
            except ValueError:
                raise PrecisionError(f"PRECISION={text!r}: {item!r} is not allowed; {rule}") from None
            if not sep or name not in PRECISION_METRICS or not 0 < share < 1:
                raise PrecisionError(f"PRECISION={text!r}: {item!r} is not allowed; {rule}")
            targets[name] = share
        if not targets:
            raise PrecisionError(f"PRECISION={text!r} names no metric; {rule}")
        return cls(targets=targets, max_repeats=cap, min_repeats=min(cls.min_repeats, cap))

    def judge(self, runs, base: dict[str, plans.Point], rounds: int) -> dict[str, dict]:
        """Each point's interval half-widths (share of the mean) over its ok runs so far, and
        whether every one is within its target."""
        out = {}
        for i, point in base.items():
            keys = {dataclasses.replace(point, repeat=r).key for r in range(rounds)}
            mine = runs[runs["run_key"].isin(keys) & (runs["status"] == "ok")]
            verdict: dict[str, Any] = {"runs": len(mine)}
            for m in self.targets:
                values = [float(v) for v in mine[m]] if m in mine else \
                    [v for x in mine["summary"] if (v := RunSummary.of(x).figure(m)) is not None]
                verdict[m] = stats.mean_ci(values).relative
                verdict[f"{m}_cv"] = stats.cv(values)
            verdict["reached"] = all(verdict[m] <= t for m, t in self.targets.items())
            out[i] = verdict
        return out

    def noise(self, reached: dict[str, dict]) -> dict[str, float]:
        """The host's run-to-run spread: the median CV over points, per metric."""
        out = {}
        for m in self.targets:
            cvs = [v[f"{m}_cv"] for v in reached.values() if not math.isnan(v[f"{m}_cv"])]
            if cvs:
                out[m] = statistics.median(cvs)
        return out
