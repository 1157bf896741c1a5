"""make watch: each live deployment probed with a small fixed load, against its baseline probes;
exit 1 on a regression (for cron or CI)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_lab.commands.arguments import add_store_arguments, count, seconds
from vllm_lab.store import store_path


def register(sub) -> None:
    """``lab watch``."""
    p = sub.add_parser("watch", help="probe a live deployment and flag regressions vs its baseline")
    p.add_argument("--url", default=None, help="the deployment (default: every instance of INVENTORY)")
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--hardware", default=None, help="hardware preset the probe scenario records")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="change the probe, e.g. load.shape.level=8")
    p.add_argument("--every", type=seconds, default=0, help="seconds between probes (0: one round)")
    p.add_argument("--count", type=count(1), default=1, help="rounds of probes")
    p.add_argument("--baseline", action="store_true", help="record a new baseline first")
    p.add_argument("--repeats", type=count(1), default=3, help="probes that make a baseline")
    add_store_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Probe a live deployment on a schedule; exit 1 when a probe is a regression."""
    from vllm_lab import watch
    regressed = watch.run_schedule(
        store_path(args.out, args.store), url=args.url, inventory=args.inventory, every_s=args.every,
        count=args.count, baseline=args.baseline, repeats=args.repeats,
        probe_overrides=args.overrides, hardware=args.hardware, workdir=args.out / ".work", echo=print)
    return 1 if regressed else 0
