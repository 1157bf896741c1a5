"""The GPU host autotune measures on, as the predictor sees it, once vLLM's defaults are measured.

A twin profile's host-CPU terms (``twin.profile.HOST_CPU_TERMS``: the engine core's scheduling and
kernel launches, all of the API server's work) are those of the host it was fitted on, and the same
GPU on another host runs them faster or slower together (twin/reference/README.md, "The host's
CPU"). On the chat traffic that moves what binds: vLLM's defaults carried 32.4 req/s within the
SLO on one H100 host, where their one API-server process was the limit, and 49.4 on another, whose
API server spent 32 µs of CPU a streamed token against 60 and left the limit to the GPU
(reports/examples/h100). Scaling every candidate by the defaults' error then aims wrong: a
candidate that lifts the API server's limit (``--api-server-count``) does not share an error that
was the API server's.

So the defaults' measured capacity names the host: the one factor on those terms
(``twin.profile.on_host``) at which the predictor puts the defaults where they measured. The
ranked candidates are then predicted on that host and their staircases centred there.
"""

from __future__ import annotations

from pathlib import Path

from vllm_lab.analysis.autotune import NOISE, Capacity
from vllm_lab.autotune.candidates import aim
from vllm_lab.autotune.ranking import predicted_slo_capacity, processes
from vllm_lab.autotune.space import with_flags
from vllm_lab.scenarios import Scenario

# Backends that run the profile itself: their host is the profile's, and nothing is fitted.
PROFILE_HOSTS = ("predict", "twin")
# The factors tried first (below 1: a host faster than the profile's), then eight between the two
# that bracket the defaults' measured capacity: a factor to about 1%, in two batches of predictions.
SCALES = (0.45, 0.55, 0.65, 0.75, 0.85, 1.0, 1.2, 1.45)
FINE = 8


def middle(found: Capacity) -> float | None:
    """A measured capacity as the one figure a host is fitted to: the middle of its interval where
    a level broke above it (a staircase's last level held is as much as a step below the truth,
    the predictor's bisection a few percent), else ``candidates.aim``'s figure."""
    low, high = found.interval
    if low and high:
        return (low + high) / 2
    return aim(found)


def on_host(scenario: Scenario, scale: float, folder: Path) -> Scenario:
    """``scenario`` predicted on a host whose CPU takes ``scale`` times the profile's: its profile
    moved there (``twin.profile.on_host``), written to ``folder`` for the predictor to load."""
    from vllm_lab.twin.profile import load_profile
    from vllm_lab.twin.profile import on_host as moved

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"host-{scale:g}.yaml"
    if not path.is_file():
        path.write_text(moved(load_profile(scenario.hardware.twin_profile), scale).to_yaml())
    return scenario.model_copy(update={"hardware": scenario.hardware.model_copy(
        update={"twin_profile": str(path)})})


def _predicted(scenarios: list[Scenario], start: float, step_s: float) -> list[float]:
    """Each scenario's predicted SLO capacity, side by side."""
    with processes(len(scenarios)) as run:
        return [p.value for p in run(predicted_slo_capacity, [(s, start, step_s) for s in scenarios])]


def capacities(base: Scenario, scales: tuple[float, ...], start: float, step_s: float,
               folder: Path) -> list[float]:
    """The predicted SLO capacity of ``base`` on the host of each scale, side by side."""
    return _predicted([on_host(base, s, folder) for s in scales], start, step_s)


def crossing(scales: tuple[float, ...], caps: list[float], measured: float) -> tuple[int, int]:
    """The neighbours in ``scales`` (ascending; capacities fall as the host slows) whose predicted
    capacities bracket ``measured``: the slowest host still at or above it and the next; both the
    end where none or all are."""
    above = [i for i, c in enumerate(caps) if c >= measured]
    if not above:
        return 0, 0
    i = max(above)
    return i, min(i + 1, len(scales) - 1)


def interpolated(scales: tuple[float, ...], caps: list[float], measured: float) -> float:
    """The factor at which the predicted capacity crosses ``measured``, linear between the two
    scales that bracket it."""
    i, j = crossing(scales, caps, measured)
    if i == j or caps[i] == caps[j]:
        return scales[i]
    return scales[i] + (scales[j] - scales[i]) * (caps[i] - measured) / (caps[i] - caps[j])


def fitted_scale(base: Scenario, measured: float, predicted: float, start: float, step_s: float,
                 folder: Path) -> float:
    """The host's factor on the profile's CPU terms, from the defaults' measured SLO capacity
    (``base``: the defaults' open-loop scenario): 1 where the profile predicted it within
    ``NOISE``, the profile's host; else where the predicted capacity crosses the measured one,
    the slowest such host where the GPU's limit makes several agree (the least change); the
    grid's end where none does."""
    if measured <= 0 or predicted <= 0 or abs(measured / predicted - 1) <= NOISE:
        return 1.0
    caps = capacities(base, SCALES, start, step_s, folder)
    i, j = crossing(SCALES, caps, measured)
    if i == j:
        return SCALES[i]
    fine = tuple(round(SCALES[i] + (SCALES[j] - SCALES[i]) * (k + 1) / (FINE + 1), 4)
                 for k in range(FINE))
    scales = (SCALES[i], *fine, SCALES[j])
    caps = [caps[i], *capacities(base, fine, start, step_s, folder), caps[j]]
    return round(interpolated(scales, caps, measured), 3)


def predicted_on_host(base: Scenario, flag_sets: list[dict], scale: float, start: float,
                      step_s: float, folder: Path) -> list[float]:
    """Each configuration's predicted SLO capacity on the host of ``scale``, side by side."""
    moved = on_host(base, scale, folder)
    return _predicted([with_flags(moved, f) for f in flag_sets], start, step_s)
