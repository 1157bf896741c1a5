"""make show: the resolved scenario as YAML, secrets redacted: what a run would record."""

from __future__ import annotations

import argparse

import yaml

from vllm_lab import scenarios
from vllm_lab.commands.arguments import add_scenario_arguments
from vllm_lab.flags import redact


def register(sub) -> None:
    """``lab show``."""
    p = sub.add_parser("show", help="print the resolved scenario")
    add_scenario_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Print the resolved scenario as YAML: what a run would record."""
    scenario = scenarios.resolve(args.scenario, args.hardware, args.overrides)
    print(yaml.safe_dump(redact(scenario.to_record()), sort_keys=False), end="")
    return 0
