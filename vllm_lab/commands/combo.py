"""make combo: step 3, a grid of 2-3 flags, every combination (PARAMS: default ladders; GRID: the
values), failures as data, resumable and spreadable over hosts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vllm_lab import plans
from vllm_lab.commands.arguments import add_run_arguments
from vllm_lab.commands.experiment import Experiment, lint_notes
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable


@dataclass(frozen=True)
class ComboArgs:
    """The flags with their default ladders, or a grid of values per flag."""

    params: str | None = None
    grid: str | None = None

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """``--params`` and ``--grid``."""
        p.add_argument("--params", default=None,
                       help="flags with default ladders, e.g. max-num-seqs,max-num-batched-tokens")
        p.add_argument("--grid", default=None,
                       help='values per flag: "max-num-seqs=8,16 max-num-batched-tokens=2048,8192"')

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ComboArgs:
        """The combination's arguments from its options."""
        return cls(args.params, args.grid)


@stoppable
def combo(settings: Settings, source: Source, params_text: str | None, grid_text: str | None) -> int:
    """A grid of 2-3 flags: every combination, failures as data, resumable and spreadable."""
    from vllm_lab import search
    scenario = source.resolve_checked()
    params = [p.strip() for p in (params_text or "").split(",")]
    for param in [item.partition("=")[0] for item in (grid_text or "").split()] + params:
        if param:
            plans.check_param(param, scenario, "PARAMS" if param in params else "GRID")
            plans.check_modelled(param, settings.backend, "PARAMS" if param in params else "GRID")
    grid = search.parse_grid(grid_text, params_text, scenario)
    repeats = settings.repeats or scenario.run.repeats
    reference = plans.reference_point(scenario, list(grid))
    points = search.combo_points(scenario, grid, repeats, reference)
    lint_notes(points)
    settings = settings.planned(grid=" ".join(f"{k}={','.join(str(v) for v in vs)}"
                                              for k, vs in grid.items()))  # the ladders taken
    return Experiment.build(settings, "combo", scenario, points,
                            {"params": list(grid), "grid": grid, "reference": reference},
                            "-".join(grid)).run()


def register(sub) -> None:
    """``lab combo``."""
    p = sub.add_parser("combo", help="a grid of 2-3 flags (step 3)")
    add_run_arguments(p)
    ComboArgs.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's combination."""
    a = ComboArgs.from_cli_args(args)
    return combo(Settings.from_cli_args(args), Source.from_cli_args(args), a.params, a.grid)
