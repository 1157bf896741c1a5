"""make report PERIOD=2026Q4: the quarterly report of every experiment of a period (runs started
within it), with its stages said as they end: a large store takes a while to read."""

from __future__ import annotations

import argparse
import time

from vllm_lab.commands.arguments import add_store_arguments
from vllm_lab.store import store_path


def register(sub) -> None:
    """``lab quarterly``."""
    p = sub.add_parser("quarterly", help="the quarterly report of every experiment of a period")
    p.add_argument("--period", required=True, help="a quarter, e.g. 2026Q4 (UTC)")
    add_store_arguments(p)
    p.add_argument("--no-pdf", action="store_true", help="skip the PDF (needs Chromium)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Build the quarterly report of every experiment of PERIOD, saying each stage as it ends."""
    from vllm_lab.reports import quarterly as period_report
    began = time.time()

    def say(line: str) -> None:  # plain, timestamped: a short command needs no live view
        print(f"{time.strftime('%H:%M:%S')} {line} ({time.time() - began:.1f} s)", flush=True)
    index = period_report.build(store_path(args.out, args.store), args.period, args.out,
                                pdf=not args.no_pdf, say=say)
    print(f"report: {index}")
    return 0
