"""What every long command takes: where its scenario comes from (``Source``) and how it takes its
runs (``Settings``: backend, inventory, folders, resume, the deadline, precision)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lab import lint as lint_mod
from vllm_lab import scenarios, serving
from vllm_lab.commands import plan_record
from vllm_lab.commands.precision import Precision
from vllm_lab.deadline import Deadline
from vllm_lab.scenarios import Scenario
from vllm_lab.store import store_path


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
    # The plan the experiment records when it is made (``plan_record.record``): a resume restores it.
    plan: dict[str, Any] | None = None
    # The exact command that resumes an experiment, as the user would type it: given its id, and
    # make variables to change (TRIALS=<left>); without one, the lab's command from the plan.
    resume_command: Callable[..., str] | None = field(default=None, compare=False)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Settings:
        """The settings a long command's options (``arguments.add_run_arguments``) give; the
        command line set ``args.resume_command``."""
        return cls(
            backend=args.backend, inventory=args.inventory, out=args.out, store=args.store,
            experiment=args.experiment, resume=args.resume, repeats=args.repeats, spread=args.spread,
            loadgen_processes=args.loadgen_processes, deadline=args.deadline,
            live_host=args.live_host if getattr(args, "live", False) else None,
            precision=getattr(args, "precision", None), plan=getattr(args, "plan", None),
            resume_command=getattr(args, "resume_command", None))

    def planned(self, **resolved: Any) -> Settings:
        """These settings with what the command resolved for an option left out (a sweep's
        ladder, a staircase's levels) added to the plan, so a resume takes the same."""
        if self.plan is None:
            return self
        options = self.plan["options"]
        extra = {f"--{k.replace('_', '-')}": [str(v)] for k, v in resolved.items()
                 if f"--{k.replace('_', '-')}" not in options}
        return dataclasses.replace(self, plan={**self.plan, "options": {**options, **extra}})

    def resume_with(self, exp_id: str, **changes: object) -> str:
        """The command that resumes ``exp_id``: the command line's, else the lab's from the plan."""
        if self.resume_command is not None:
            return self.resume_command(exp_id, **changes)
        return plan_record.resume_words((self.plan or {}).get("command", "?"), self.plan or {}, exp_id)

    @property
    def store_path(self) -> Path:
        """The store file (STORE, else OUT/lab.db)."""
        return store_path(self.out, self.store)

    def hosts(self) -> list[str | None]:
        """Every inventory host with SPREAD, else the one default host."""
        return serving.serve_hosts(self.inventory) if self.spread else [None]
