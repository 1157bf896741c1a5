"""Step 4, stress: how a configuration holds up under more load than it was tuned for.

Shapes and how they are measured:

- ``ramp`` and ``step``: a staircase of runs, one constant open-loop run per offered load (req/s).
  Why runs and not one long Locust ramp: each level then starts from an empty queue, so a queue
  (and TTFT) that grows *within* a run is the level's own doing, not the backlog of the levels
  before it, which would put the knee too low; the levels are also resumable, spreadable over
  hosts and run on the predictor in seconds. ``ramp`` refines the bracket around the knee with
  extra levels; ``step`` keeps the given levels.
- ``spike`` and ``soak``: one run with Locust's spike or constant shape, read as a time series.

Only an open loop has an offered load: a closed loop's users wait for their answers, so its queue
can never grow without bound. Stress runs are therefore open-loop (Poisson unless the scenario says
gamma). What the runs say (a level's growth, the knee, a spike's recovery, a soak's drift) is read
by ``analysis.stress``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd

from vllm_lab import plans
from vllm_lab.analysis.stress import SERVED_TOLERANCE, find_knee
from vllm_lab.scenarios import Scenario, ScenarioError

SHAPES = ("ramp", "step", "spike", "soak")
FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.35, 1.7)  # of the predicted capacity
# A level just under the capacity fills its queue for longer than a short run lasts (the time to
# steady state grows as 1 / (1 - load)^2), and the fill reads as serving less than is sent. So the
# first level called unbounded whose shortfall is under CONFIRM_BELOW x SERVED_TOLERANCE of what it
# sent runs again CONFIRM_FACTOR times as long; at a level measured more than once the longest
# run decides.
CONFIRM_BELOW = 2.0
CONFIRM_FACTOR = 3.0


def stress_scenario(scenario: Scenario, shape: str) -> Scenario:
    """The scenario as a stress run: open loop, and the shape (constant for staircase levels)."""
    if shape not in SHAPES:
        raise ScenarioError(f"SHAPE={shape!r}: allowed values are {', '.join(SHAPES)}")
    kind = "constant" if shape in ("ramp", "step") else shape
    # A trace is stressed as itself: its own arrival pattern, scaled to each level's mean rate.
    s = scenario if scenario.load.mode == "replay" else plans.apply_value(scenario, "load.mode", "open")
    return plans.apply_value(s, "load.shape.kind", kind)


def predicted_capacity(scenario: Scenario, backend: Any = None, workdir: Any = None) -> float:
    """Requests/s a backend (the predictor by default) serves with a queue that never empties
    (closed loop, many users)."""
    from vllm_lab.backends import PredictBackend

    seqs = int(scenario.serve.get("max-num-seqs") or 256)
    users = min(2 * seqs, 2048)
    if backend is None:
        # The predictor sends 8 requests a user: with 2 x 8 users the middle half is 64 completions,
        # whose mean length (hence req/s) is off by up to 10% for a long-tailed workload. Users
        # past max-num-seqs only wait, so more of them change nothing but the sample: >= 2048.
        users = max(users, 256)
    s = plans.apply_value(plans.apply_value(scenario, "load.mode", "closed"), "load.shape.level", users)
    s = plans.apply_value(s, "load.shape.kind", "constant")
    m = (backend or PredictBackend()).measure(s, None, workdir)
    if m.samples is None or m.samples.empty:  # it did not start; the middle half is read below
        raise ScenarioError(f"the configuration does not start on the predictor ({m.error.splitlines()[0]}); "
                            f"stress a configuration that starts, or give LEVELS=a,b,c")
    # In a closed loop with more users than slots every freed slot is refilled at once: the
    # completions per second in the middle half of the run (no start-up, no drain) are the capacity.
    ends = (m.samples["start_ts"] + m.samples["e2e_s"]).dropna().sort_values().to_numpy()
    lo, hi = ends[len(ends) // 4], ends[3 * len(ends) // 4]
    return float((3 * len(ends) // 4 - len(ends) // 4) / (hi - lo)) if hi > lo else \
        float(m.summary.request_throughput)


def staircase_levels(scenario: Scenario, levels: list[float] | None) -> list[float]:
    """LEVELS if given; else fractions of the predicted capacity (the predictor pre-screens)."""
    if levels:
        return sorted(float(v) for v in levels)
    try:
        capacity = predicted_capacity(scenario)
    except (ValueError, KeyError):
        capacity = scenario.load.shape.level  # no length distribution: centre on the scenario
    return [round(capacity * f, 3) for f in FRACTIONS]


def staircase_points(scenario: Scenario, levels: list[float], repeats: int = 1) -> list[plans.Point]:
    """One constant open-loop run per offered load: the serve flags are the same, one server.

    The client's in-flight cap is raised to the run's whole schedule (at most 4096): with a lower
    cap an overloaded level would queue in the client, where the server's queue and TTFT never
    see it.
    """
    points = []
    for p in plans.sweep_points(scenario, "load.shape.level", levels, repeats):
        load = p.scenario.load
        cap = max(load.max_in_flight, min(int(load.shape.level * load.stop.duration_s) + 1, 4096))
        s = plans.apply_value(p.scenario, "load.max_in_flight", cap)
        if load.mode == "replay":  # the level is the replayed trace's mean rate
            s = plans.apply_value(s, "load.replay.rate", load.shape.level)
        points.append(plans.Point(s, p.values, p.repeat))
    return points


def single_points(scenario: Scenario) -> list[plans.Point]:
    """Spike or soak: one run of the scenario's shape."""
    return [plans.Point(scenario, {"load.shape.kind": scenario.load.shape.kind}, 0)]


def confirm_points(scenario: Scenario, levels: list[float]) -> list[plans.Point]:
    """The confirmation runs of ``levels``: each level again, CONFIRM_FACTOR times as long."""
    longer = plans.apply_value(scenario, "load.stop.duration_s",
                               scenario.load.stop.duration_s * CONFIRM_FACTOR)
    return staircase_points(longer, levels)


def confirm_level(levels: pd.DataFrame) -> float | None:
    """The first unbounded level, where its verdict is marginal and no longer run has checked it."""
    t = levels[levels["ok"]].sort_values("level")
    bad = t[t["unbounded"]]
    if bad.empty:
        return None
    first = bad.iloc[0]
    marginal = first["served"] >= (1 - CONFIRM_BELOW * SERVED_TOLERANCE) * first["sent"] - first["edges"]
    return float(first["level"]) if marginal and not first.get("confirmed", False) else None


def refine_levels(levels: pd.DataFrame, tolerance: float = 0.05, count: int = 3) -> list[float]:
    """New levels inside the knee's bracket while it is wider than ``tolerance`` (a ramp's zoom)."""
    knee = find_knee(levels)
    if knee["bracket"] is None:
        top = levels[levels["ok"]]["level"].max() if levels["ok"].any() else None
        return [round(top * 1.5, 3), round(top * 2, 3)] if top else []  # never overloaded: go higher
    low, high = knee["bracket"]
    if low <= 0 or high / low - 1 <= tolerance:
        return []
    return [round(low + (high - low) * (i + 1) / (count + 1), 3) for i in range(count)]


def next_levels(levels: pd.DataFrame) -> tuple[list[float], list[float]]:
    """A ramp's next round: (levels to add, levels to confirm); a marginal verdict is checked first."""
    confirm = confirm_level(levels)
    return ([], [confirm]) if confirm is not None else (refine_levels(levels), [])


def run_staircase(scenario: Scenario, levels: list[float], rounds: int,
                  take: Callable[[list[plans.Point]], int], read_levels: Callable[[], pd.DataFrame],
                  repeats: int = 1, say: Callable[[str], Any] = print) -> int:
    """The staircase, then up to ``rounds`` rounds that confirm a marginal overload or refine the
    knee's bracket. ``take(points)`` runs the points not yet recorded and returns 0 when it could;
    ``read_levels()`` is the levels table of what is recorded. Returns the last ``take``'s code."""
    confirmed: list[float] = []
    rc = take(staircase_points(scenario, levels, repeats))
    for _ in range(rounds if rc == 0 else 0):
        extra, confirm = next_levels(read_levels())
        if not extra and not confirm:
            break
        levels, confirmed = sorted(set(levels) | set(extra)), confirmed + confirm
        say(f"ramp: refining the knee with levels {extra}" if extra else
            f"ramp: level {confirm[0]} looks overloaded by a small margin; running it "
            f"{CONFIRM_FACTOR:g}x as long")
        rc = take(staircase_points(scenario, levels, repeats) + confirm_points(scenario, confirmed))
    return rc
