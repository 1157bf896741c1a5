"""make baseline: step 1, vLLM's defaults on the scenario's traffic, repeated (3 runs at least):
the reference the later steps compare with."""

from __future__ import annotations

import argparse

from vllm_lab import plans
from vllm_lab.commands.arguments import add_run_arguments
from vllm_lab.commands.experiment import Experiment
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable


@stoppable
def baseline(settings: Settings, source: Source) -> int:
    """vLLM's defaults on the scenario's traffic, repeated: the reference later steps compare with."""
    scenario = source.resolve_checked()
    repeats = settings.repeats or max(3, scenario.run.repeats)
    return Experiment.build(settings, "baseline", scenario, plans.baseline_points(scenario, repeats),
                            {"repeats": repeats}).run()


def register(sub) -> None:
    """``lab baseline``."""
    p = sub.add_parser("baseline", help="measure vLLM's defaults on the scenario's traffic")
    add_run_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's baseline."""
    return baseline(Settings.from_cli_args(args), Source.from_cli_args(args))
