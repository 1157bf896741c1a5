"""make sweep: step 2, one flag over a ladder of values (VALUES, else a ladder fitted to the
hardware); a value vLLM would refuse is measured and recorded as refused."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_lab import plans
from vllm_lab.commands.arguments import add_run_arguments
from vllm_lab.commands.experiment import Experiment, lint_notes
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable


@dataclass(frozen=True)
class SweepArgs:
    """The flag (or scenario key) swept and its values (None: the hardware's ladder)."""

    param: str
    values: str | None = None

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """``--param`` and ``--values``."""
        p.add_argument("--param", required=True, help="flag (max-num-seqs) or path (load.shape.level)")
        p.add_argument("--values", default=None, help="comma-separated values (default: a ladder)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> SweepArgs:
        """The sweep's arguments from its options."""
        return cls(args.param, args.values)


@stoppable
def sweep(settings: Settings, source: Source, param: str, values_text: str | None = None) -> int:
    """One flag over a ladder of values (VALUES, else a ladder for the hardware)."""
    scenario = source.resolve_checked()
    plans.check_modelled(param, settings.backend)
    values, points = plans.sweep_plan(scenario, param, values_text, settings.repeats or scenario.run.repeats)
    lint_notes(points)
    settings = settings.planned(values=",".join(str(v) for v in values))  # the ladder taken
    reference = plans.reference_point(scenario, [param])
    meta = {"param": param, "values": values, "reference": reference}
    return Experiment.build(settings, "sweep", scenario, points, meta, param).run()


def register(sub) -> None:
    """``lab sweep``."""
    p = sub.add_parser("sweep", help="sweep one flag over a ladder of values")
    add_run_arguments(p)
    SweepArgs.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's sweep."""
    a = SweepArgs.from_cli_args(args)
    return sweep(Settings.from_cli_args(args), Source.from_cli_args(args), a.param, a.values)
