"""make tune: step 3, Optuna over a declared space; each trial is a run in the store, a second
worker joins the study with EXPERIMENT=, and CONFIRM=N re-measures the best N on a live backend."""

from __future__ import annotations

import argparse
import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_lab import plans, search
from vllm_lab.commands import stopping
from vllm_lab.commands.arguments import add_run_arguments, count
from vllm_lab.commands.experiment import Experiment, counted
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.deadline import DeadlineReached
from vllm_lab.progress import Progress, closing_table


@dataclass(frozen=True)
class TuneOptions:
    """The study: trials, objective, space, storage, seed; CONFIRM re-measures the best live."""

    trials: int = 20
    objective: str = "goodput"
    space: str | None = None
    study_storage: str | None = None
    seed: int | None = None
    startup_trials: int = 4
    confirm: int = 0
    confirm_backend: str = "twin"

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """The study's options."""
        p.add_argument("--trials", type=count(1), default=20,
                       help="trials this worker runs (per host with --spread)")
        p.add_argument("--objective", default="goodput", choices=search.OBJECTIVES)
        p.add_argument("--space", default=None,
                       help="space name (scenarios/spaces/) or YAML file; default per hardware")
        p.add_argument("--study-storage", default=None, help="Optuna storage URL (default: the lab database)")
        p.add_argument("--seed", type=int, default=None, help="sampler seed")
        p.add_argument("--startup-trials", type=count(0), default=4,
                       help="random trials before TPE models the space")
        p.add_argument("--confirm", type=count(0), default=0, help="re-measure the best N configurations live")
        p.add_argument("--confirm-backend", choices=("twin", "vllm"), default="twin")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> TuneOptions:
        """The study's options from the command line."""
        return cls(args.trials, args.objective, args.space, args.study_storage, args.seed,
                   args.startup_trials, args.confirm, args.confirm_backend)


@stopping.stoppable
def tune(settings: Settings, source: Source, options: TuneOptions) -> int:
    """Optuna over a declared space; each trial is a run in the store; CONFIRM re-measures the best live."""
    from vllm_lab import reports, search
    scenario = source.resolve_checked()
    space = search.load_space(options.space, scenario)
    for param in space.space:
        plans.check_modelled(param, settings.backend, "SPACE")
    if options.study_storage:  # before anything is recorded: a storage that never answers
        search.check_storage(options.study_storage)
    exp_id = experiment_id(settings, "tune", scenario)
    study = search.TuneSettings(exp_id, space, options.objective, options.trials,
                                search.storage_url(options.study_storage, settings.store_path),
                                options.seed, options.startup_trials, settings.plan,
                                plans.reference_point(scenario, list(space.space)))
    hosts = settings.hosts()
    print(f"tune: study {exp_id}, {options.trials} trial(s) per host on {len(hosts)} host(s), backend "
          f"{settings.backend}, objective {search.objective_label(options.objective)}, space "
          f"{', '.join(space.space)}")
    shown = Progress("tune", exp_id, settings.backend, settings.out, noun="trial",
                     window_s=scenario.load.stop.duration_s)
    shown.expect(options.trials * len(hosts))
    done: list[int] = []

    def on_trial(number, values, run):
        shown.point_done({"trial": number, **values}, 0, run["status"], run["summary"],
                         run["error"] or "")
        done.append(number)

    def trials(backend):
        search.measure_reference(scenario, study, backend, settings.store_path, settings.out / ".work")
        with _quiet_deadline_in_threads():
            counts = search.run_trials(scenario, study, backend, settings.store_path,
                                       settings.out / ".work", hosts, on_trial)
        if getattr(backend, "stopped", False):
            raise DeadlineReached("")  # SPREAD: the hosts' threads stopped, the study did not say
        return counts

    def account() -> stopping.Account:
        total = options.trials * len(hosts)
        per_host = max(1, -(-(total - len(done)) // len(hosts)))  # TRIALS counts per host
        return stopping.Account(f"{len(done)} of {total} trials done, {total - len(done)} left",
                                changes={"TRIALS": per_host})

    counts = stopping.take(settings, exp_id, shown, trials, account)
    from vllm_lab.reports.console import results
    index = reports.build(settings.store_path, exp_id, settings.out)
    print(f"trials taken now: {counted(counts)}")
    closing_table(results(settings.store_path, exp_id))
    print(f"report: {index}")
    return confirm(settings, scenario, study, options) if options.confirm else 0


def confirm(settings: Settings, scenario, study, options: TuneOptions) -> int:
    """The best configurations of the search measured again on CONFIRM_BACKEND, as a small
    combination in experiment ``<study>-confirm``."""
    from vllm_lab import search
    from vllm_lab.analysis.search import best_configs
    configs = best_configs(search.load_study(study.experiment_id, study.storage), options.confirm,
                           options.objective)
    if not configs:
        print("confirm: no trial met the SLO; nothing to confirm")
        return 0
    again = dataclasses.replace(settings, backend=options.confirm_backend,
                                experiment=f"{study.experiment_id}-confirm", resume=False)
    # The study's objective goes with it, so the confirmation names its best by the same figure.
    return Experiment.build(again, "tune", scenario, search.confirm_points(scenario, configs),
                            {"params": list(study.space.space), "confirms": study.experiment_id,
                             "objective": options.objective}).run()


@contextmanager
def _quiet_deadline_in_threads() -> Iterator[None]:
    """A host's trial thread that ends on DeadlineReached ends as planned: no traceback for it."""
    previous = threading.excepthook

    def hook(args):
        if not isinstance(args.exc_value, DeadlineReached):
            previous(args)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def register(sub) -> None:
    """``lab tune``."""
    p = sub.add_parser("tune", help="Bayesian search (Optuna) over a declared space of flags (step 3)")
    add_run_arguments(p)
    TuneOptions.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's search."""
    return tune(Settings.from_cli_args(args), Source.from_cli_args(args), TuneOptions.from_cli_args(args))
