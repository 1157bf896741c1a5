"""make report: an experiment's report rebuilt from the store alone, by its step's builder
(``reports.BUILDERS``); ``make report PERIOD=`` is ``commands.quarterly``."""

from __future__ import annotations

import argparse

from vllm_lab.commands.arguments import add_store_arguments
from vllm_lab.commands.naming import newest_experiment
from vllm_lab.store import check_experiment_name, store_path


def register(sub) -> None:
    """``lab report``."""
    p = sub.add_parser("report", help="rebuild an experiment's report from the store")
    add_store_arguments(p, "experiment id (default: the newest)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Rebuild an experiment's report from the store alone."""
    from vllm_lab import reports
    path = store_path(args.out, args.store)
    name = args.experiment or newest_experiment(path)
    check_experiment_name(name)  # a store from before the pattern may hold any name
    print(f"report: {reports.build(path, name, args.out)}")
    return 0
