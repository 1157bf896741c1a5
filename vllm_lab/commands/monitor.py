"""make monitor: Prometheus, its alert rules, the node and DCGM exporters (and Grafana where it can
be installed) for the inventory's deployments, through playbooks/monitor.yml."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    """``lab monitor``."""
    p = sub.add_parser("monitor", help="Prometheus, exporters, alert rules and Grafana (monitor.yml)")
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="extra variable for monitor.yml, e.g. prometheus_port=9091")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Set up Prometheus (+ node exporter, + Grafana where installable) for the inventory."""
    from vllm_lab import monitor
    result = monitor.deploy(args.inventory, extra_vars=dict(v.split("=", 1) for v in args.var))
    print(monitor.describe(result))
    return 0
