"""make autotune: the serving flags that carry the most traffic within the SLO, searched on the
predictor and measured on the backend within GPU_MINUTES (``vllm_lab.autotune``), then reported
(``reports.autotune``): the report, ``best.yaml`` and ``summary.json`` under OUT/<experiment>/."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_lab import autotune as tuning
from vllm_lab import scenarios, search
from vllm_lab.autotune.ranking import say_now
from vllm_lab.backends import Backend
from vllm_lab.commands import stopping
from vllm_lab.commands.arguments import add_run_arguments, count, minutes
from vllm_lab.commands.naming import experiment_name
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.progress import Progress
from vllm_lab.scenarios import Scenario
from vllm_lab.store import StoreError, experiment_dir


@dataclass(frozen=True)
class AutotuneOptions:
    """What make autotune takes beyond the common settings."""

    gpu_minutes: float = 20.0
    # The defaults and each flag moved alone take the first 16 of the default space, the sampler
    # the rest (realtime-chat on the H200, predicted over the defaults, six seeds: 20 in all find
    # +34-45%, 40 find +45-48%; TPE alone +4-48% and +29-48%).
    trials: int = 40
    space: str | None = None
    seed: int | None = None
    top: int | None = None
    objective: str = "capacity"

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """The budget, the search and how many candidates are measured."""
        p.add_argument("--gpu-minutes", type=minutes, default=20.0,
                       help="wall minutes of the measuring backend, server starts counted")
        p.add_argument("--trials", type=count(1), default=AutotuneOptions.trials,
                       help="configurations the predictor ranks")
        p.add_argument("--space", default=None,
                       help="space name (scenarios/spaces/) or YAML file; default autotune")
        p.add_argument("--seed", type=int, default=None, help="sampler seed")
        p.add_argument("--top", type=count(0), default=None,
                       help="best configurations measured besides the defaults (default: twin 2, vllm 3)")
        p.add_argument("--objective", default="capacity", choices=tuning.OBJECTIVES,
                       help="rank by SLO capacity (req/s), or energy: output tokens per joule at it")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> AutotuneOptions:
        """The autotune's options from the command line."""
        return cls(args.gpu_minutes, args.trials, args.space, args.seed, args.top, args.objective)


@stopping.stoppable
def autotune(settings: Settings, source: Source, options: AutotuneOptions) -> int:
    """Search on the predictor by SLO capacity, measure the defaults and the best few within
    GPU_MINUTES and before DEADLINE, and report; a stop reports what was measured."""
    began = time.time()  # the host's time counts from here: provisioning is the lab's own
    if settings.spread:
        raise scenarios.ScenarioError("SPREAD=1 is not supported by autotune: its candidates are "
                                      "measured one after another on one host")
    scenario = source.resolve_checked()
    space = tuning.load_space(options.space, scenario)
    storage = search.storage_url(None, settings.store_path)
    exp_id = _experiment(settings, scenario, storage)
    # A DURATION given on the command line sets the staircase's levels; else the backend's default.
    step_s = scenario.load.stop.duration_s if any(
        o.startswith("load.stop.duration_s=") for o in source.overrides) else None
    tuned = tuning.Settings(exp_id, settings.store_path, settings.out, storage, options.gpu_minutes,
                            trials=options.trials, seed=options.seed, top=options.top, step_s=step_s,
                            repeats=settings.repeats or 1, plan=settings.plan,
                            objective=options.objective, began=began)
    shown = Progress("autotune", exp_id, settings.backend, settings.out, noun="level",
                     window_s=step_s or tuning.measuring(settings.backend).step_s)

    def account() -> stopping.Account:
        from vllm_lab.reports.autotune import build_report
        try:
            spent = build_report(settings.store_path, exp_id, settings.out, storage)["gpu_minutes"]
        except StoreError:  # stopped during the search: no plan, nothing measured yet
            return stopping.Account("the search on the predictor was under way, nothing measured")
        return stopping.Account(f"{spent:.1f} of GPU_MINUTES={options.gpu_minutes:g} spent",
                                kept="what was measured is kept and reported")

    stopping.take(settings, exp_id, shown,
                  lambda backend: tuning.search_and_measure(scenario, space, backend, tuned,
                                                            progress=shown),
                  account)
    # Reported once the command's span is kept, so its page says where the hosts' time went.
    from vllm_lab.reports.autotune import build_report
    summary = build_report(settings.store_path, exp_id, settings.out, storage)
    print(f"autotune: {summary['verdict']}")
    print(f"report: {experiment_dir(settings.out, exp_id) / 'index.html'}")
    return 0


def run(scenario: Scenario, space: search.SearchSpace, backend: Backend, settings: tuning.Settings,
        say: Callable[[str], Any] = say_now, progress: Progress | None = None) -> dict[str, Any]:
    """Search on the predictor, measure the defaults and the top-k within the budget, and report;
    the summary (also OUT/<experiment>/summary.json)."""
    from vllm_lab.reports.autotune import build_report
    tuning.search_and_measure(scenario, space, backend, settings, say, progress)
    return build_report(settings.store_path, settings.experiment_id, settings.out, settings.storage)


def _experiment(settings: Settings, scenario: Scenario, storage: str) -> str:
    """EXPERIMENT, the newest autotune of this scenario with RESUME, or a new name."""
    if settings.experiment or not settings.resume:
        return settings.experiment or experiment_name("autotune", scenario)
    prefix = experiment_name("autotune", scenario)[: -len("YYYYmmdd-HHMMSS")]
    found = tuning.newest_study(storage, prefix)
    if not found:
        raise StoreError(f"{settings.store_path}: nothing to resume for {prefix[:-1]}; run "
                         f"without RESUME=1")
    return found


def register(sub) -> None:
    """``lab autotune``."""
    p = sub.add_parser("autotune", help="search flags on the predictor by SLO capacity, measure the "
                       "defaults and the best few within GPU_MINUTES")
    add_run_arguments(p)
    AutotuneOptions.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's autotune."""
    return autotune(Settings.from_cli_args(args), Source.from_cli_args(args),
                    AutotuneOptions.from_cli_args(args))
