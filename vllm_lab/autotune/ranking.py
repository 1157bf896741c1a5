"""The search on the twin's predictor: each configuration of the space ranked by its predicted SLO
capacity, bracketed from a start rate and bisected, in an Optuna study named after the autotune."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_lab import plans, search, stress
from vllm_lab.analysis.autotune import NOISE, Candidate
from vllm_lab.analysis.stress import level_verdict, offered_rate
from vllm_lab.autotune.space import open_loop, with_flags
from vllm_lab.backends import Measurement, PredictBackend
from vllm_lab.progress import point_label
from vllm_lab.scenarios import Scenario, ScenarioError
from vllm_lab.store import RunStatus

# Probes per configuration: a bracket widened by BRACKET, then halved: about 4% wide.
PROBES = 7
BRACKET = 1.4
# Configurations the search asks for at once, each predicted in a process of its own. Fixed, not
# the host's core count, so that one SEED gives one search on any host; the processes are as many
# as the host has cores, up to this, or VLLM_LAB_PREDICT_PROCESSES (1: all here, e.g. on a shared
# host, or for searches too small to pay for starting processes, as the tests' are). PROCESSES,
# where set, overrides both.
BATCH = 8
PROCESSES: int | None = None


def prediction_processes(jobs: int) -> int:
    """Processes for ``jobs`` predictions at once (1: in this process)."""
    limit = PROCESSES or int(os.environ.get("VLLM_LAB_PREDICT_PROCESSES") or os.cpu_count() or 1)
    return min(jobs, limit, BATCH)


def say_now(line: str) -> None:
    """Progress on stdout, flushed: a make log written to a file shows each level as it ends."""
    print(line, flush=True)


# What autotune ranks configurations by: their SLO capacity (req/s), or the output tokens per
# joule they give at it (the SLO as a constraint, energy as the figure to beat).
OBJECTIVES = ("capacity", "energy")


@dataclass(frozen=True)
class Predicted:
    """A figure the predictor gave (req/s), or why the configuration would not start; with it,
    the output tokens per joule at that rate (None where no rate held)."""

    value: float = 0.0
    error: str = ""
    tokens_per_joule: float | None = None

    def score(self, objective: str) -> float:
        """The figure ``objective`` ranks by (0 where nothing held the SLO)."""
        if objective == "energy":
            return round(self.tokens_per_joule or 0.0, 4)
        return self.value


def level_holds(level: float, m: Measurement) -> bool:
    """A level holds when its run is ok, meets every SLO and its queue does not grow without bound."""
    if m.status != RunStatus.OK or not m.summary.meets_slo:
        return False
    return not level_verdict(level, m.summary, m.samples, m.server_metrics)["unbounded"]


def predicted_slo_capacity(scenario: Scenario, start: float, duration_s: float,
                           probes: int = PROBES) -> Predicted:
    """The predictor's SLO capacity of a configuration: bracket it from ``start`` (req/s), then bisect.

    Each probe is one open-loop run of ``duration_s`` on the predictor (the levels the live staircase
    runs last as long, so both read the same p99). The capacity is on the axis a measured one is
    read on: the load the last level that held really offered (``analysis.stress.offered_rate``:
    one seed's arrivals are a few percent off the level asked), not the level. It is 0 when even
    a tenth of ``start`` breaks the SLO; the error is vLLM's words when the configuration would
    not start.
    """
    backend = PredictBackend()
    base = open_loop(scenario, duration_s)
    low, high, rate = 0.0, math.inf, start
    offered, tokens_per_joule = 0.0, None
    for _ in range(probes):
        point = stress.staircase_points(base, [round(rate, 4)])[0]
        m = backend.measure(point.scenario, None, Path("."))
        if m.status not in (RunStatus.OK, RunStatus.UNSTEADY):  # a run that did not hold: no level
            return Predicted(error=m.error or m.status)
        if level_holds(rate, m):
            low, tokens_per_joule = rate, m.summary.output_tokens_per_joule
            offered = offered_rate(m.samples, rate)
        else:
            high = rate
        if math.isinf(high):
            rate = low * BRACKET
        elif low == 0:
            rate = high / BRACKET**2
            if rate < start / 10:
                break
        else:
            rate = (low + high) / 2
    return Predicted(round(offered, 3), tokens_per_joule=tokens_per_joule)


def saturation(scenario: Scenario) -> Predicted:
    """The predictor's saturated capacity (closed loop, a queue that never empties), or its error."""
    try:
        return Predicted(round(stress.predicted_capacity(scenario), 3))
    except ScenarioError as e:
        return Predicted(error=str(e))


def first_points(base: Scenario, space: search.SearchSpace) -> list[dict[str, Any]]:
    """The search's first trials: vLLM's defaults (the scenario's reference values) and each flag
    moved alone from them, step 2 of the method on the predictor."""
    return search.one_at_a_time(space, {p: plans.reference_value(p, base) for p in space.space})


def run_search(base: Scenario, space: search.SearchSpace, study_name: str, storage: str,
               trials: int, seed: int | None, start: float, duration_s: float,
               say: Callable[[str], Any] = say_now, objective: str = "capacity"):
    """Optuna over ``space`` on the predictor, maximizing the SLO capacity or (energy) the output
    tokens per joule at it; each trial keeps both; resumes its study. Trials are asked ``BATCH``
    at a time and predicted side by side (``processes``); the sampler lies about the ones in
    flight (``constant_liar``) so that one batch spreads over the space."""
    from optuna.trial import TrialState

    study = search.open_study(study_name, storage, "goodput", seed, startup_trials=min(8, max(trials // 2, 1)))
    # vLLM's defaults and each flag moved alone come first (as many as ``trials`` allows): 20
    # sampled points can all miss the one flag that makes the gain (on the H200's chat traffic,
    # seeded at random, one search found +56% predicted and the next +1%).
    for point in first_points(base, space)[:trials]:
        study.enqueue_trial(point, skip_if_exists=True)
    left = trials - len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    with processes(left) as run:  # at most BATCH at once
        while left > 0:
            batch = [study.ask() for _ in range(min(left, BATCH))]
            try:
                points = [tidy(search.suggest(trial, space)) for trial in batch]
                results = run(predicted_slo_capacity,
                              [(with_flags(base, v), start, duration_s) for v in points])
            except BaseException:
                for trial in batch:
                    study.tell(trial, state=TrialState.FAIL)  # never leave a trial RUNNING
                raise
            for trial, values, result in zip(batch, points, results):
                _tell(study, trial, values, result, objective, say)
            left -= len(batch)
    return study


def _tell(study, trial, values: dict[str, Any], result: Predicted, objective: str,
          say: Callable[[str], Any]) -> None:
    """One trial's prediction into its study, and its progress line."""
    from optuna.trial import TrialState

    if result.error:
        trial.set_user_attr("error", result.error.splitlines()[0][:300])
        study.tell(trial, state=TrialState.PRUNED)
        say(f"  trial {trial.number} {point_label(values)}: does not start")
        return
    trial.set_user_attr("capacity", result.value)
    trial.set_user_attr("tokens_per_joule", result.tokens_per_joule)
    study.tell(trial, result.score(objective))
    per_joule = (f", {result.tokens_per_joule:.2f} tok/J at it"
                 if objective == "energy" and result.tokens_per_joule else "")
    say(f"  trial {trial.number} {point_label(values)}: predicted SLO capacity "
        f"{result.value:.2f} req/s{per_joule}")


@contextmanager
def processes(jobs: int) -> Iterator[Callable[..., list]]:
    """``run(fn, jobs)``: ``fn(*job)`` for each job, in order. In processes of their own (started
    once, by spawn: the lab's process may hold threads) where several jobs meet several cores,
    else here; ``fn`` is then a module's function. The predictor is deterministic, so either way
    gives the same figures."""
    workers = prediction_processes(jobs)
    if workers <= 1:
        yield lambda fn, batch: [fn(*job) for job in batch]
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda fn, batch: list(pool.map(_call, [(fn, job) for job in batch]))


def _call(fn_job: tuple[Callable[..., Any], tuple]) -> Any:
    """One job in a worker process."""
    fn, job = fn_job
    return fn(*job)


def pared(best: Candidate, base: Scenario, duration_s: float, objective: str = "capacity",
          say: Callable[[str], Any] = say_now, tolerance: float = NOISE) -> Candidate:
    """``best`` with each flag that carries none of its gain set back to vLLM's default.

    The search moves every flag of the space at once, and a flag the predictor is indifferent to
    keeps whatever value the sampler drew. Each moved flag is set back in turn (the space's order)
    and stays back where the predictor still gives at least ``1 - tolerance`` of the best's figure,
    measured against the best itself, so the reverts cannot add up to more than ``tolerance``. The
    lab's rule calls fewer changed flags cheaper, and a flag that gains nothing is a risk for
    nothing (an fp8 KV cache changes the answers, a memory share near 1 courts an OOM)."""
    flags = dict(best.flags or {})
    start = best.predicted or 1.0
    kept = predicted_slo_capacity(with_flags(base, flags), start, duration_s)
    if kept.error or kept.score(objective) <= 0:
        return best
    floor = (1 - tolerance) * kept.score(objective)
    for param, value in (best.flags or {}).items():
        default = plans.reference_value(param, base)
        if default is None or value == default:
            continue
        for nearer in toward_default(param, value, default):
            trial = {**flags, param: nearer}
            got = predicted_slo_capacity(with_flags(base, trial), start, duration_s)
            if not got.error and got.score(objective) >= floor:
                flags, kept = trial, got
                say(f"  {best.name}: {param}={value} " + (
                    f"carries none of its gain on the predictor; back to vLLM's {default}"
                    if nearer == default else
                    f"carries no more than {nearer} on the predictor; {nearer} is kept"))
                break
    return dataclasses.replace(best, flags=tidy(flags), predicted=kept.value)


# Flags that count processes on the GPU's host. Each process takes a core the predictor does not
# charge for: where the GPU is the limit it gives two API-server processes and four the same
# capacity, and on an H100 host four starved the engine (its steps a third longer, the GPU 74%
# busy) and broke at 44.7 req/s where two held 52.4 (reports/examples/h100, `-g`). So a count
# that cannot go back to vLLM's default is halved toward it while the predictor keeps the gain.
PROCESS_FLAGS = ("api-server-count",)


def toward_default(param: str, value: Any, default: Any) -> list[Any]:
    """The values a pick's ``param`` is tried at, cheapest first: vLLM's default; for a count of
    processes also each halving between it and the pick's (1, 2 for a pick of 4; 1, 2, 4 for 8)."""
    if param not in PROCESS_FLAGS or not isinstance(value, int) or not isinstance(default, int):
        return [default]
    between, n = [], max(default, 1) * 2
    while n < value:
        between.append(n)
        n *= 2
    return [default, *between]


def _pared_quietly(best: Candidate, base: Scenario, duration_s: float,
                   objective: str) -> tuple[Candidate, list[str]]:
    """``pared`` with its progress lines kept, to be said in the picks' order."""
    lines: list[str] = []
    return pared(best, base, duration_s, objective, lines.append), lines


def pared_candidates(ranked: list[Candidate], base: Scenario, duration_s: float, k: int,
                     objective: str = "capacity",
                     say: Callable[[str], Any] = say_now) -> list[Candidate]:
    """The candidates to measure, ``k`` of them named c1, c2, ... in order, each with the flags
    it changes from vLLM's defaults only (what the lab's rule counts as its cost): the ranked
    configurations, best first, each pared to the flags that carry its gain (``pared``), those
    that differ from each other and from vLLM's defaults (measured anyway); then, where the picks
    pare to fewer than ``k``, the picks as the search found them: whether the flags the pared ones
    gave up matter on the GPU is the next thing a measurement can tell."""
    def changed(c: Candidate) -> Candidate:
        return dataclasses.replace(c, flags={p: v for p, v in (c.flags or {}).items()
                                             if v != plans.reference_value(p, base)})

    with processes(len(ranked)) as run:  # each pick pared in a process of its own
        leans = run(_pared_quietly, [(cand, base, duration_s, objective) for cand in ranked])
    chosen: list[Candidate] = []
    for lean, lines in leans:
        if len(chosen) >= k:
            break
        for line in lines:
            say(line)
        lean = changed(lean)
        if lean.flags and all(lean.flags != c.flags for c in chosen):
            chosen.append(lean)
    for cand in map(changed, ranked):
        if cand.flags and all(cand.flags != c.flags for c in chosen):
            chosen.append(cand)
    return [dataclasses.replace(c, name=f"c{i + 1}") for i, c in enumerate(chosen[:k])]


def tidy(values: dict[str, Any]) -> dict[str, Any]:
    """Flag values as a person writes them: a stepped float's 0.8500000000000001 is 0.85."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}


def top_configs(study, k: int) -> list[Candidate]:
    """The ``k`` distinct configurations of the highest objective (above 0: the SLO capacity, or
    tokens per joule at it), as candidates c1, c2, ... with their predicted SLO capacity."""
    from optuna.trial import TrialState

    ranked = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
                    key=lambda t: -t.value)
    out: list[Candidate] = []
    seen = set()
    for t in ranked:
        key = json.dumps(t.params, sort_keys=True)
        if t.value > 0 and key not in seen:
            seen.add(key)
            out.append(Candidate(f"c{len(out) + 1}", tidy(t.params),
                                 t.user_attrs.get("capacity", t.value)))
        if len(out) == k:
            break
    return out


def newest_study(storage: str, prefix: str) -> str | None:
    """The newest autotune study whose name starts with ``prefix`` (names end with their time)."""
    import optuna

    try:
        names = [s.study_name for s in optuna.study.get_all_study_summaries(storage)]
    except Exception:  # noqa: BLE001 - a store without Optuna's tables holds no study
        return None
    names = [n for n in names if n.startswith(prefix)]
    return max(names) if names else None
