"""make calibrate: the calibration plan measured on the backend (single requests, closed loops and
a saturating load on one server start), then a twin profile fitted to it (FIT_ONLY: from the
store alone)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_lab import calibrate as calibration
from vllm_lab.commands.arguments import add_run_arguments
from vllm_lab.commands.experiment import Experiment
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store, StoreError, experiment_dir


@dataclass(frozen=True)
class CalibrateArgs:
    """Whether to measure, where the profile goes, reference measurements fitted too, and what
    the fit moves (calibrate.FITS)."""

    fit_only: bool = False
    profile_out: Path | None = None
    reference: Sequence[Path] = field(default_factory=tuple)
    fit: str = "all"

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """``--profile-out``, ``--fit-only``, ``--reference`` and ``--fit``."""
        p.add_argument("--profile-out", type=Path, default=None, help="where to write the profile YAML")
        p.add_argument("--fit-only", action="store_true", help="fit from EXPERIMENT's runs, measure nothing")
        p.add_argument("--reference", type=Path, nargs="*", default=[],
                       help="vllm bench serve result files from the same machine, fitted too")
        p.add_argument("--fit", choices=calibration.FITS, default="all",
                       help="all: every coefficient the plan pins; host: the host's CPU scale alone "
                            "(the profile's GPU on another host)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> CalibrateArgs:
        """The calibration's arguments from its options."""
        return cls(args.fit_only, args.profile_out, tuple(args.reference), args.fit)


@stoppable
def calibrate(settings: Settings, source: Source, fit_only: bool = False,
              profile_out: Path | None = None, reference: Sequence[Path] = (), fit: str = "all") -> int:
    """Run the calibration plan on the backend, then fit a twin profile to it."""
    from vllm_lab.models import load_model_shape
    from vllm_lab.twin.profile import load_profile

    scenario = source.resolve_checked()
    if not fit_only:
        points = calibration.calibration_points(scenario)
        if fit == "host":  # another host of the profile's GPU: the runs its CPU decides
            points = calibration.host_points(points)
        Experiment.build(settings, "calibrate", scenario, points, {"params": ["point"]},
                         "calibrate").run()
    exp_id = experiment_id(dataclasses.replace(settings, resume=True), "calibrate", scenario, "calibrate")
    if fit_only:
        scenario = Scenario.model_validate_json(_first_run_scenario(settings.store_path, exp_id))
    # The profile keeps its own hardware block (the GPU it was measured on, up to 8 per host).
    base = load_profile(scenario.hardware.twin_profile)
    model = load_model_shape(str(scenario.serve["model"]))
    out = profile_out or experiment_dir(settings.out, exp_id) / f"{scenario.hardware.gpu}-{model.name}.yaml"
    profile, rows = calibration.fit(settings.store_path, exp_id, base.model_copy(
        update={"name": out.stem, "model": model.name}), model, out, list(reference), fit)
    for row in rows:
        print(f"  {row['point']:6s} {row['metric']:18s} measured {row['measured']:9.2f} "
              f"twin {row['predicted']:9.2f} {row['error']:+7.1%}")
    print(f"profile: {out} (median errors {profile.provenance.errors})")
    return 0


def _first_run_scenario(path: Path, exp_id: str) -> str:
    with Store(path) as store:
        runs = store.runs(exp_id)
    if runs.empty:
        raise StoreError(f"{path}: experiment {exp_id} has no runs to fit")
    return str(runs.iloc[0]["scenario_json"])


def register(sub) -> None:
    """``lab calibrate``."""
    p = sub.add_parser("calibrate", help="measure the calibration plan and fit a twin profile")
    add_run_arguments(p)
    CalibrateArgs.add_cli_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's calibration."""
    a = CalibrateArgs.from_cli_args(args)
    return calibrate(Settings.from_cli_args(args), Source.from_cli_args(args), a.fit_only,
                     a.profile_out, a.reference, a.fit)
