"""PRECISION=: how narrow each point's 95% intervals must be, and the rounds that get them there.

A point is repeated, round after round, until its intervals are as narrow as asked or it hits the
cap; round r takes the r-th repeat of every point still open, so a drift of the host over time
lands on every point alike instead of passing for an effect. Which points reached the precision,
and the host's run-to-run noise, are kept in the experiment's meta.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_lab import plans, stats
from vllm_lab.backends import Backend
from vllm_lab.progress import Progress, point_label
from vllm_lab.store import Store

if TYPE_CHECKING:  # an Experiment takes its rounds here
    from vllm_lab.commands.experiment import Experiment

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
                    [float(x[m]) for x in mine["summary"] if x.get(m) is not None]
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


def identity(point: plans.Point) -> str:
    """A point apart from its repeat index."""
    return dataclasses.replace(point, repeat=0).key


def take_rounds(exp: Experiment, backend: Backend, hosts: Sequence[str | None], shown: Progress,
                say: Callable[[str], Any]) -> dict[str, int]:
    """Repeat each point of ``exp``, round after round, until its intervals are as narrow as
    PRECISION asks or the cap is hit; return the counts by status of the runs taken."""
    s, target = exp.settings, exp.settings.precision
    base: dict[str, plans.Point] = {}
    for point in exp.points:
        base.setdefault(identity(point), dataclasses.replace(point, repeat=0))
    planned = max(max(p.repeat for p in exp.points) + 1, target.min_repeats)
    counts: dict[str, int] = {}
    still, reached = list(base), {}
    for r in range(target.max_repeats):
        round_points = [dataclasses.replace(base[i], repeat=r) for i in still]
        plan = plans.Plan(exp.id, exp.step, round_points, exp.meta)
        for status, n in plans.execute(plan, backend, s.store_path, s.out / ".work", hosts,
                                       progress=shown).items():
            counts[status] = counts.get(status, 0) + n
        if r + 1 < planned:
            continue
        with Store(s.store_path) as store:
            reached = target.judge(store.runs(exp.id), base, r + 1)
        still = [i for i in still if not reached[i]["reached"]]
        if not still:
            break
    record(exp, base, reached, say)
    return counts


def record(exp: Experiment, base: dict[str, plans.Point], reached: dict[str, dict],
           say: Callable[[str], Any]) -> None:
    """Say which points reached the precision and which hit the cap; keep it, with the host's
    run-to-run noise, in the experiment's meta."""
    target = exp.settings.precision
    for i, verdict in reached.items():
        widths = ", ".join(f"±{verdict[m]:.1%} {m}" for m in target.targets if m in verdict)
        how = "reached" if verdict["reached"] else f"cap of {target.max_repeats} runs hit"
        say(f"precision {how}: {point_label(base[i].values)}: {widths} "
            f"after {verdict['runs']} runs")
    noise = target.noise(reached)
    with Store(exp.settings.store_path) as store:
        store.update_meta(exp.id, precision={"targets": target.targets,
                                             "max_repeats": target.max_repeats,
                                             "points": {point_label(base[i].values): v
                                                        for i, v in reached.items()}},
                          host_noise_cv=noise)
    if noise:
        say("host noise (run-to-run CV, median over points): "
            + ", ".join(f"{m} {v:.1%}" for m, v in noise.items()))
