"""What every long command takes: where its scenario comes from (``Source``) and how it takes its
runs (``Settings``: backend, inventory, folders, resume, the deadline, precision)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_lab import lint as lint_mod
from vllm_lab import scenarios, serving
from vllm_lab.commands.precision import Precision
from vllm_lab.deadline import Deadline
from vllm_lab.scenarios import Scenario


def store_path(out: Path, store: Path | None = None) -> Path:
    """The store a command reads and writes: STORE if given, else OUT/lab.db."""
    return store or Path(out) / "lab.db"


@dataclass(frozen=True)
class Source:
    """Where a command's scenario comes from: a scenario, a hardware preset and overrides."""

    scenario: str = "default"
    hardware: str | None = None
    overrides: tuple[str, ...] = ()

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Source:
        """The layers ``--scenario``, ``--hardware`` and ``--set`` name."""
        return cls(args.scenario, args.hardware, tuple(args.overrides))

    def resolve_checked(self) -> Scenario:
        """Resolve the scenario and stop on lint errors: nothing is launched with a refused flag."""
        layers = scenarios.load_layers(self.scenario, self.hardware, list(self.overrides))
        scenario = scenarios.validate(layers)
        errors = [f for f in lint_mod.lint(scenario, layers) if f.severity == "error"]
        if errors:
            raise scenarios.ScenarioError(f"{errors[0]} (make lint SCENARIO={self.scenario} lists all)")
        return scenario


def _resume_placeholder(exp_id: str, **changes: object) -> str:
    return f"make ... RESUME=1 EXPERIMENT={exp_id}"


@dataclass(frozen=True)
class Settings:
    """How a command takes its runs: backend, inventory, folders, resume, the deadline."""

    backend: str = "twin"
    inventory: Path = Path("inventory/local.yml")
    out: Path = Path("reports")
    store: Path | None = None
    experiment: str | None = None
    resume: bool = False
    repeats: int | None = None
    spread: bool = False
    loadgen_processes: int | None = None
    deadline: Deadline | None = None
    live_host: str | None = None  # LIVE=1: Locust's web UI for the run in flight, bound here
    precision: Precision | None = None  # PRECISION=: repeat each point until this precise
    # The exact command that resumes an experiment, as the user would type it: given its id, and
    # make variables to change (TRIALS=<left>).
    resume_command: Callable[..., str] = field(default=_resume_placeholder, compare=False)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Settings:
        """The settings a long command's options (``arguments.add_run_arguments``) give; the
        command line set ``args.resume_command``."""
        return cls(
            backend=args.backend, inventory=args.inventory, out=args.out, store=args.store,
            experiment=args.experiment, resume=args.resume, repeats=args.repeats, spread=args.spread,
            loadgen_processes=args.loadgen_processes, deadline=args.deadline,
            live_host=args.live_host if getattr(args, "live", False) else None,
            precision=getattr(args, "precision", None),
            resume_command=getattr(args, "resume_command", None) or _resume_placeholder)

    @property
    def store_path(self) -> Path:
        """The store file (STORE, else OUT/lab.db)."""
        return store_path(self.out, self.store)

    def hosts(self) -> list[str | None]:
        """Every inventory host with SPREAD, else the one default host."""
        return serving.serve_hosts(self.inventory) if self.spread else [None]
