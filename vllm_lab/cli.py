"""The lab's command line: parse, call one function, print. The Makefile calls this."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from vllm_lab import lint as lint_mod
from vllm_lab import scenarios
from vllm_lab.store import StoreError


def _scenario_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="default", help="scenario name or file")
    p.add_argument("--hardware", default=None, help="hardware preset name or file (default h200)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one key, e.g. serve.max-num-seqs=128")


def _split_sets(text: str | None) -> list[str]:
    """SET="a.b=1 c.d=2" from make arrives as one string."""
    return text.split() if text else []


def cmd_lint(args: argparse.Namespace) -> int:
    """Lint one scenario, or every shipped one with --all; exit 1 on any error."""
    names = _all_scenario_names() if args.all else [args.scenario]
    failed = False
    for name in names:
        layers = scenarios.load_layers(name, args.hardware, args.overrides)
        scenario = scenarios.validate(layers)
        if args.vllm_version:
            scenario = scenario.model_copy(update={"vllm_version": args.vllm_version})
        findings = lint_mod.lint(scenario, layers)
        print(f"{name}: " + (f"{len(findings)} finding(s)" if findings else "ok"))
        for finding in findings:
            print(f"  {finding}")
        # The guide/ templates are kept as the guide wrote them; with --all their findings are
        # the worked example, not a failure.
        as_written = args.all and name.startswith("guide/")
        failed |= not as_written and any(f.severity == "error" for f in findings)
    return 1 if failed else 0


def _all_scenario_names() -> list[str]:
    guide = sorted((scenarios.SCENARIO_DIR / "guide").glob("*.yaml"))
    return scenarios.available()["scenarios"] + [f"guide/{p.stem}" for p in guide]


def cmd_show(args: argparse.Namespace) -> int:
    """Print the resolved scenario as YAML: what a run would record."""
    scenario = scenarios.resolve(args.scenario, args.hardware, args.overrides)
    print(yaml.safe_dump(scenario.to_record(), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every lab command."""
    parser = argparse.ArgumentParser(prog="lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("lint", help="check a scenario's vLLM flags before anything runs")
    _scenario_args(p)
    p.add_argument("--all", action="store_true", help="lint every shipped scenario")
    p.add_argument("--vllm-version", default=None, help="target vLLM version (default: scenario's)")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("show", help="print the resolved scenario")
    _scenario_args(p)
    p.set_defaults(func=cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one lab command; a bad input is one sentence on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (scenarios.ScenarioError, StoreError) as e:
        print(f"lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted; finished runs are in the store", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
