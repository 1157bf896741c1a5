"""make findings: the tuning guide's troubleshooting patterns in an experiment's runs (default: the
newest), each with the numbers that triggered it and the flag to try."""

from __future__ import annotations

import argparse

from vllm_lab.analysis import findings as patterns
from vllm_lab.commands.arguments import add_store_arguments
from vllm_lab.commands.naming import newest_experiment
from vllm_lab.store import Store, store_path


def register(sub) -> None:
    """``lab findings``."""
    p = sub.add_parser("findings", help="troubleshooting findings of an experiment's runs")
    add_store_arguments(p, "experiment id (default: the newest)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Print the troubleshooting findings of an experiment's runs (default: the newest)."""
    path = store_path(args.out, args.store)
    name = args.experiment or newest_experiment(path)
    with Store(path) as store:
        store.experiment(name)  # names the known ones when it does not exist
        runs = store.runs(name)
    total = 0
    for row in runs.to_dict("records"):
        for f in patterns.findings(row):
            total += 1
            print(f"{row['point'] or 'baseline'} repeat {row['repeat']}: {patterns.describe(f)}")
    print(f"{name}: {total} finding(s) over {len(runs)} run(s)")
    return 0
