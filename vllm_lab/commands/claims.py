"""make claims: the tuning guide's claims, each measured by its experiment of arms (CLAIMS= picks
some), with a verdict table."""

from __future__ import annotations

import argparse

from vllm_lab import claims as guide
from vllm_lab import scenarios
from vllm_lab.commands.arguments import add_run_arguments
from vllm_lab.commands.experiment import Experiment
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable
from vllm_lab.store import DETERMINISTIC_BACKENDS


@stoppable
def claims(settings: Settings, source: Source, selection: str | None) -> int:
    """The guide's claims, each measured by its experiment, with a verdict table."""
    base = source.resolve_checked()
    try:
        selected = guide.parse_selection(selection)
    except ValueError as e:
        raise scenarios.ScenarioError(str(e)) from None
    points = guide.points(base, selected, settings.repeats or 1,
                          deterministic=settings.backend in DETERMINISTIC_BACKENDS)
    if not points:
        print(f"claims {selected}: nothing to measure here (claim 7 is not testable on vLLM "
              f"{base.vllm_version})")
        return 0
    return Experiment.build(settings, "claims", base, points, {"base": base.to_record()}).run()


def register(sub) -> None:
    """``lab claims``."""
    p = sub.add_parser("claims", help="measure the tuning guide's claims and give each a verdict")
    add_run_arguments(p)
    p.add_argument("--claims", default=None, help="claim numbers, e.g. 1,3,5-8 (default: all nine)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's claims."""
    return claims(Settings.from_cli_args(args), Source.from_cli_args(args), args.claims)
