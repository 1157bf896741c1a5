"""How sure a figure is: intervals over repeats, within-run batch means, warm-up truncation, and
effects judged against noise.

Every function takes plain numbers and returns plain numbers, so a plan, a report or a search can
ask "is this point better than that one, or is it noise?" the same way. The intervals are
Student-t intervals on the mean (repeats of a point are few: 2-10), the warm-up rule is MSER-5
(White 1997: truncate where the marginal standard error of the remaining batch means is least),
and an effect between two points is Welch's difference of means relative to the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import (  # what scipy.stats' norm.ppf and t.ppf call (its import: ~0.9 s)
    ndtri,
    stdtrit,
)

LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    """A mean with its two-sided interval; ``n`` values went into it."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    @property
    def relative(self) -> float:
        """Half the interval as a share of the mean (inf when the mean is 0 or unknown)."""
        return self.half_width / abs(self.mean) if self.mean else math.inf

    def overlaps(self, other: Estimate) -> bool:
        return self.low <= other.high and other.low <= self.high


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Estimate:
    """The mean of ``values`` and its Student-t interval; one value gives an unbounded interval."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if x.size == 0:
        return Estimate(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if x.size == 1:
        return Estimate(mean, -math.inf, math.inf, 1)
    half = float(stdtrit(x.size - 1, (1 + level) / 2) * x.std(ddof=1) / math.sqrt(x.size))
    return Estimate(mean, mean - half, mean + half, int(x.size))


def t_quantile(dof: int, level: float = LEVEL) -> float:
    """The two-sided Student-t quantile an interval of ``dof`` degrees of freedom uses."""
    return float(stdtrit(dof, (1 + level) / 2))


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (sample standard deviation over the mean): a host's noise."""
    x = np.asarray(values, dtype=float)
    if x.size < 2 or not x.mean():
        return math.nan
    return float(x.std(ddof=1) / abs(x.mean()))


def batch_means_ci(series: Sequence[float], batches: int = 10, level: float = LEVEL) -> Estimate:
    """A within-run interval: the series cut into ``batches`` consecutive batches whose means are
    treated as independent (true once a batch is longer than the series' correlation time), for
    when repeats cost a server start each."""
    x = np.asarray(series, dtype=float)
    batches = min(batches, x.size)
    if batches < 2:
        return mean_ci(x.tolist(), level)
    size = x.size // batches
    means = x[: size * batches].reshape(batches, size).mean(axis=1)
    return mean_ci(means.tolist(), level)


def mser_truncation(series: Sequence[float], batch: int = 5) -> int:
    """How many leading values of ``series`` are warm-up, by MSER-``batch``.

    The series is averaged in batches of ``batch``; the cut is the batch boundary d that minimizes
    the squared standard error of the rest, var(rest) / len(rest), over the first half (a cut past
    half would keep too little to judge). 0 when the series is too short to tell.
    """
    x = np.asarray(series, dtype=float)
    n = x.size // batch
    if n < 4:
        return 0
    means = x[: n * batch].reshape(n, batch).mean(axis=1)
    best_d, best = 0, math.inf
    for d in range(n // 2 + 1):
        rest = means[d:]
        score = float(((rest - rest.mean()) ** 2).sum() / rest.size ** 2)
        if score < best:
            best_d, best = d, score
    return best_d * batch


def warmup_cut(series: Sequence[float], batch: int = 5, min_effect: float = 0.05) -> int:
    """Where the warm-up of ``series`` ends: the first value from which every run of ``batch``
    values stays in the steady band MSER's rest defines (its mean ± the larger of twice its batch
    means' spread and ``min_effect``), or 0 when what MSER cut ran no differently from the rest.

    MSER alone can stop late on a periodic series (a closed loop's lockstep waves) and can cut a
    trough of the waves at the start; the band test keeps only a real warm-up, and all of it.
    """
    x = np.asarray(series, dtype=float)
    cut = mser_truncation(x, batch)
    if not cut:
        return 0
    rest = x[cut:]
    n = rest.size // batch
    spread = float(rest[: n * batch].reshape(n, batch).mean(axis=1).std(ddof=1)) if n >= 2 else 0.0
    centre = float(rest.mean())
    band = max(2 * spread, min_effect * abs(centre))
    if abs(float(x[:cut].mean()) - centre) <= band:
        return 0
    rolling = np.convolve(x, np.ones(batch) / batch, mode="valid")  # rolling[i]: mean of x[i:i+batch]
    outside = np.flatnonzero(np.abs(rolling[:cut + 1] - centre) > band)
    return int(outside[-1]) + 1 if outside.size else 0


@dataclass(frozen=True)
class Effect:
    """``candidate`` against ``reference``: the relative difference of means and its interval."""

    relative: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        """The interval excludes no change."""
        return self.low > 0 or self.high < 0


def effect(candidate: Sequence[float], reference: Sequence[float], level: float = LEVEL) -> Effect:
    """Welch's interval on mean(candidate) − mean(reference), divided by mean(reference).

    With a single value on either side the interval is unbounded: one run cannot tell an effect
    from the host's noise.
    """
    a, b = np.asarray(candidate, dtype=float), np.asarray(reference, dtype=float)
    if a.size == 0 or b.size == 0 or not b.mean():
        return Effect(math.nan, math.nan, math.nan)
    diff, base = float(a.mean() - b.mean()), float(abs(b.mean()))
    if a.size < 2 or b.size < 2:
        return Effect(diff / base, -math.inf, math.inf)
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    if se == 0:
        return Effect(diff / base, diff / base, diff / base)
    # Welch-Satterthwaite degrees of freedom.
    dof = (va + vb) ** 2 / ((va ** 2) / (a.size - 1) + (vb ** 2) / (b.size - 1))
    half = float(stdtrit(dof, (1 + level) / 2) * se)
    return Effect(diff / base, (diff - half) / base, (diff + half) / base)


# A single run's spread when a point has no repeats to measure it: about what one H200 gave for
# output throughput run to run (1-2%), with room for a busier host. One run per point is judged
# against it, so a difference smaller than about 2.8 times it is not called an effect.
SINGLE_RUN_CV = 0.03


def summary_effect(a: tuple[float, float, int], b: tuple[float, float, int],
                   level: float = LEVEL, single_run_cv: float = SINGLE_RUN_CV) -> Effect:
    """``effect`` from summaries (mean, sample standard deviation, runs) of candidate ``a`` and
    reference ``b``; a side with one run, or no spread, is given ``single_run_cv`` of its mean."""
    (ma, sa, na), (mb, sb, nb) = a, b
    if not mb or na < 1 or nb < 1 or not (math.isfinite(ma) and math.isfinite(mb)):
        return Effect(math.nan, math.nan, math.nan)

    def sd(m: float, s: float, n: int) -> float:
        return s if n > 1 and math.isfinite(s) and s > 0 else single_run_cv * abs(m)
    va, vb = sd(ma, sa, na) ** 2 / na, sd(mb, sb, nb) ** 2 / nb
    se = math.sqrt(va + vb)
    if na > 1 and nb > 1 and sa > 0 and sb > 0:
        dof = (va + vb) ** 2 / ((va ** 2) / (na - 1) + (vb ** 2) / (nb - 1))
        q = float(stdtrit(dof, (1 + level) / 2))
    else:  # an assumed spread: the normal quantile
        q = float(ndtri((1 + level) / 2))
    diff, base = ma - mb, abs(mb)
    return Effect(diff / base, (diff - q * se) / base, (diff + q * se) / base)


@dataclass(frozen=True)
class Choice:
    """The pick among points: ``best`` (the cheapest within noise of the top), ``top`` (highest
    mean) and ``within_noise`` (every point indistinguishable from the top, top included)."""

    best: Hashable
    top: Hashable
    within_noise: tuple[Hashable, ...]


def choose(values: dict[Hashable, Sequence[float]], cost: Callable[[Hashable], float],
           higher_is_better: bool = True, level: float = LEVEL) -> Choice | None:
    """The cheapest point statistically indistinguishable from the top one.

    A point is within noise of the top when their Welch interval includes no difference; with one
    run per point every point is (nothing can be told apart), so the cheapest one is named and the
    report must say the runs were too few.
    """
    means = {k: float(np.mean(v)) for k, v in values.items() if len(v)}
    if not means:
        return None
    sign = 1 if higher_is_better else -1
    top = max(means, key=lambda k: sign * means[k])
    close = tuple(k for k in means if k == top or not effect(values[k], values[top], level).significant)
    best = min(close, key=lambda k: (cost(k), -sign * means[k]))
    return Choice(best=best, top=top, within_noise=close)


def interleaved(points: Sequence[Hashable], repeats: int) -> list[tuple[Hashable, int]]:
    """(point, repeat) in the order that spreads drift over every point: all points' first
    repeats, then all second ones, ..., so a slow drift of the host cannot pass for an effect."""
    return [(p, r) for r in range(repeats) for p in points]


def precise_enough(values: Sequence[float], target: float, level: float = LEVEL) -> bool:
    """Whether the interval's half-width is within ``target`` (a share of the mean, e.g. 0.02)."""
    return mean_ci(values, level).relative <= target
