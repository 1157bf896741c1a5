"""make calibrate: the calibration plan measured on the backend (single requests, closed loops, a
saturating load and the traffic users tune for on one server start, an eager run on a second), then
a twin profile fitted to it (FIT_ONLY: from the store alone; FIT=none: no fit, the runs kept for one)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_lab import calibrate as calibration
from vllm_lab.commands.arguments import UsageError, add_run_arguments
from vllm_lab.commands.experiment import Experiment
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import stoppable
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store, StoreError, experiment_dir
from vllm_lab.twin.profile import Profile, load_profile, measured_on, on_hardware


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
                            "(the profile's GPU on another host); none: measure only, fit later "
                            "with --fit-only")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> CalibrateArgs:
        """The calibration's arguments from its options."""
        return cls(args.fit_only, args.profile_out, tuple(args.reference), args.fit)


@stoppable
def calibrate(settings: Settings, source: Source, fit_only: bool = False,
              profile_out: Path | None = None, reference: Sequence[Path] = (), fit: str = "all") -> int:
    """Run the calibration plan on the backend, then fit a twin profile to it."""
    from vllm_lab.models import load_model_shape

    if fit_only and fit == "none":
        raise UsageError("calibrate: FIT_ONLY=1 fits without measuring and FIT=none measures "
                         "without fitting; give one of them")
    scenario = source.resolve_checked()
    if not fit_only:
        points = calibration.calibration_points(scenario)
        if fit == "host":  # another host of the profile's GPU: the runs its CPU decides
            points = calibration.host_points(points)
        Experiment.build(settings, "calibrate", scenario, points, {"params": ["point"]},
                         "calibrate").run()
    exp_id = experiment_id(dataclasses.replace(settings, resume=True), "calibrate", scenario, "calibrate")
    if fit == "none":
        # The store and its samples folder are all the fit reads: they may travel (Store.export).
        where = f" OUT={settings.out}" if settings.store is None else ""
        print(f"measured {exp_id} into {settings.store_path}; fit it with: make calibrate FIT_ONLY=1 "
              f"EXPERIMENT={exp_id}{where}")
        return 0
    if fit_only:
        scenario = Scenario.model_validate_json(_first_run_scenario(settings.store_path, exp_id))
    model = load_model_shape(str(scenario.serve["model"]))
    out = profile_out or experiment_dir(settings.out, exp_id) / f"{scenario.hardware.gpu}-{model.name}.yaml"
    base = starting_profile(scenario, exp_id).model_copy(update={"name": out.stem, "model": model.name})
    profile, rows = calibration.fit(settings.store_path, exp_id, base, model, out, list(reference), fit)
    for row in rows:
        print(f"  {row['point']:6s} {row['metric']:18s} measured {row['measured']:9.2f} "
              f"twin {row['predicted']:9.2f} {row['error']:+7.1%}")
    print(f"profile: {out} (median errors {profile.provenance.errors})")
    return 0


def starting_profile(scenario: Scenario, exp_id: str) -> Profile:
    """The profile a calibration fits from: the one the hardware preset names, on the GPU measured.

    A profile of the same GPU keeps its own hardware block (up to 8 GPUs a host); one of another
    GPU takes the preset's peaks first (``on_hardware``), so the efficiencies the fit finds are
    this GPU's and the profile it writes describes the GPU it was measured on. The terms the plan
    does not pin (launch costs measured elsewhere, the fp8 cache's read share) stay the base's.
    """
    base = load_profile(scenario.hardware.twin_profile)
    hw = scenario.hardware
    if measured_on(base, hw):
        start = base
    else:  # the preset's keys (its short name, the profile it names) are not a profile's
        start = on_hardware(base, hw)
        start = start.model_copy(update={"hardware": start.hardware.model_copy(
            update={"gpu": None, "twin_profile": None})})
    notes = (f"make calibrate on {start.hardware.name} (experiment {exp_id}), fitted from profile "
             f"{base.name}; the coefficients the calibration plan does not pin are {base.name}'s.")
    return start.model_copy(update={"provenance": start.provenance.model_copy(update={"notes": notes})})


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
