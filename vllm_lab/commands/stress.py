"""make stress: step 4. Ramp and step are a staircase of open-loop levels (a ramp refines the
bracket around the knee in the same experiment); spike and soak are one run read as a time series."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from vllm_lab import plans, scenarios
from vllm_lab import stress as staircase
from vllm_lab.analysis.stress import levels_table
from vllm_lab.commands.arguments import add_run_arguments, count
from vllm_lab.commands.experiment import Experiment
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable
from vllm_lab.store import Store


@dataclass(frozen=True)
class StressArgs:
    """The shape, the levels (None: fractions of the predicted capacity) and a ramp's rounds."""

    shape: str
    levels: str | None = None
    refine: int = 3

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """``--shape``, ``--levels`` and ``--refine``."""
        p.add_argument("--shape", required=True, choices=staircase.SHAPES)
        p.add_argument("--levels", default=None, help="offered loads (req/s) for ramp/step; default: "
                       "fractions of the predicted capacity")
        p.add_argument("--refine", type=count(0), default=3,
                       help="ramp: rounds of levels added inside the knee's bracket (or of confirmations)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> StressArgs:
        """The stress test's arguments from its options."""
        return cls(args.shape, args.levels, args.refine)


@stoppable
def stress(settings: Settings, source: Source, shape: str, levels_text: str | None, refine: int) -> int:
    """Ramp/step: a staircase of open-loop levels and its knee; spike/soak: one run as a time series."""
    scenario = staircase.stress_scenario(source.resolve_checked(), shape)
    if shape in ("spike", "soak"):
        if shape == "spike" and settings.backend == "predict":
            raise scenarios.ScenarioError("SHAPE=spike needs a live backend (BACKEND=twin or vllm): "
                                          "the predictor runs constant loads only")
        return Experiment.build(settings, "stress", scenario, staircase.single_points(scenario),
                                {"shape": shape}, shape).run()
    given = plans.parse_values("load.shape.level", levels_text, "LEVELS") if levels_text else None
    for level in given or ():  # each checked here, where the sentence can name LEVELS
        plans.apply_value(scenario, "load.shape.level", level, "LEVELS")
    levels = staircase.staircase_levels(scenario, given)
    meta = {"shape": shape, "params": ["load.shape.level"]}
    settings = settings.planned(levels=",".join(f"{v:g}" for v in levels))  # the staircase taken
    fixed = dataclasses.replace(settings, experiment=experiment_id(settings, "stress", scenario, shape))

    def read_levels():
        with Store(fixed.store_path) as store:
            return levels_table(store, fixed.experiment, store.runs(fixed.experiment))

    counts: dict[str, int] = {}

    def take(points: list[plans.Point]) -> int:
        for status, n in Experiment.build(fixed, "stress", scenario, points, meta, shape).take_all().items():
            counts[status] = counts.get(status, 0) + n
        return 0

    # A ramp zooms into the knee in the same experiment; a step keeps its levels. A stop (the
    # deadline, Ctrl-C) leaves the command: no later round starts, nor says anything. The report
    # and its results are said once, after the last round.
    staircase.run_staircase(scenario, levels, refine if shape == "ramp" else 0, take, read_levels,
                            settings.repeats or scenario.run.repeats)
    return Experiment(fixed.experiment, "stress", scenario, [], meta, fixed).finish(counts)


def register(sub) -> None:
    """``lab stress``."""
    p = sub.add_parser("stress", help="ramp/step staircase with its knee, spike or soak (step 4)")
    add_run_arguments(p)
    StressArgs.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's stress test."""
    a = StressArgs.from_cli_args(args)
    return stress(Settings.from_cli_args(args), Source.from_cli_args(args), a.shape, a.levels, a.refine)
