"""make lint: a scenario's vLLM flags checked against the target vLLM version before anything runs
(SCENARIO=all: every shipped scenario but the guide's templates as written, wrong on purpose)."""

from __future__ import annotations

import argparse

from vllm_lab import lint as flag_lint
from vllm_lab import scenarios
from vllm_lab.commands.arguments import add_scenario_arguments


def lint(args: argparse.Namespace) -> int:
    """Lint one scenario, or every runnable shipped one with --all; exit 1 when an error is printed."""
    names = scenarios.available()["scenarios"] if args.all else [args.scenario]
    failed = False
    for name in names:
        layers = scenarios.load_layers(name, args.hardware, args.overrides)
        scenario = scenarios.validate(layers)
        if args.vllm_version:
            scenario = scenario.model_copy(update={"vllm_version": args.vllm_version})
        findings = flag_lint.lint(scenario, layers)
        print(f"{name}: " + (f"{len(findings)} finding(s)" if findings else "ok"))
        for finding in findings:
            print(f"  {finding}")
        failed |= any(f.severity == "error" for f in findings)
    if args.all:
        print(_guide_note())
    return 1 if failed else 0


def _guide_note() -> str:
    """The line --all ends with: the guide's templates as written are wrong on purpose, so not linted."""
    guide = [f"guide/{p.stem}" for p in sorted((scenarios.SCENARIO_DIR / "guide").glob("*.yaml"))]
    return (f"not linted: {', '.join(guide)} (the tuning guide's templates exactly as written, kept "
            "wrong on purpose as the worked example; make lint SCENARIO=guide/<name> shows their "
            "errors)")


def register(sub) -> None:
    """``lab lint``."""
    p = sub.add_parser("lint", help="check a scenario's vLLM flags before anything runs")
    add_scenario_arguments(p)
    p.add_argument("--all", action="store_true", help="lint every shipped scenario (not guide/, the guide as written)")
    p.add_argument("--vllm-version", default=None, help="target vLLM version (default: scenario's)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """The command line's lint."""
    return lint(args)
