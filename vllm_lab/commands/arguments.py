"""The options several commands share, and the types that check them: a bad value is one sentence."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vllm_lab.commands.precision import Precision, PrecisionError
from vllm_lab.deadline import EXIT_DEADLINE, Deadline, DeadlineError
from vllm_lab.store import EXPERIMENT_NAME_RULE, StoreError, check_experiment_name


class UsageError(Exception):
    """A command line (or a make variable) the lab cannot take; the message is one sentence."""


def count(minimum: int):
    """An argparse type: a whole number of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a whole number, "
                                             f"{minimum} or more")
        return value
    return parse


def seconds(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a number of seconds, 0 or more")
    return value


def minutes(text: str) -> float:
    """An argparse type: a positive number of minutes."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: minutes of the measuring "
                                         f"backend, a number above 0")
    return value


def experiment(text: str) -> str:
    """An argparse type: an experiment name (the store's one pattern)."""
    try:
        return check_experiment_name(text)
    except StoreError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an experiment name: use "
                                          f"{EXPERIMENT_NAME_RULE}") from None


def out_folder(text: str) -> Path:
    """An argparse type: OUT, a folder or a path to make one at (checked before anything is
    written: a file there would end the command at its first write)."""
    path = Path(text)
    for node in (path, *path.parents):
        if os.path.lexists(node):
            if not node.is_dir():
                what = "" if node == path else f" ({node} is not a folder)"
                raise argparse.ArgumentTypeError(f"{text!r} is not a folder{what}: OUT must be a "
                                                  f"folder, or a path the lab can make one at")
            break
    return path


def deadline(text: str) -> Deadline:
    """An argparse type: a deadline (an ISO time, HH:MM today or a duration from now)."""
    try:
        return Deadline.parse(text)
    except DeadlineError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def precision(text: str) -> Precision:
    """An argparse type: PRECISION's targets."""
    try:
        return Precision.parse(text)
    except PrecisionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    """The scenario's layers: a scenario, a hardware preset, overrides."""
    p.add_argument("--scenario", default="default", help="scenario name or file")
    p.add_argument("--hardware", default=None, help="hardware preset name or file (default h200)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one key, e.g. serve.max-num-seqs=128")


def add_store_arguments(p: argparse.ArgumentParser, experiment_help: str | None = None) -> None:
    """Where the store is (OUT, STORE) and, with ``experiment_help``, which experiment to read."""
    if experiment_help:
        p.add_argument("--experiment", type=experiment, default=None, help=experiment_help)
    p.add_argument("--out", type=out_folder, default=Path("reports"), help="reports folder")
    p.add_argument("--store", type=Path, default=None, help="store file (default OUT/lab.db)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What every long command takes: the scenario and how its runs are taken (``Settings``)."""
    add_scenario_arguments(p)
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--backend", choices=("twin", "vllm", "predict"), default="twin")
    add_store_arguments(p)
    p.add_argument("--experiment", type=experiment, default=None,
                   help="experiment id (to resume or name it)")
    p.add_argument("--resume", action="store_true", help="continue the experiment (or the newest alike)")
    p.add_argument("--repeats", type=count(1), default=None, help="runs per point")
    p.add_argument("--spread", action="store_true", help="spread points over all inventory hosts")
    p.add_argument("--loadgen-processes", type=count(1), default=None,
                   help="Locust processes per load-generator host (default: sized from the load)")
    p.add_argument("--deadline", type=deadline, default=None,
                   help="stop gracefully by then: 2026-12-01T05:30, 05:30 (today) or 1h30m from now; "
                        f"exit {EXIT_DEADLINE} with the command that resumes")
    p.add_argument("--precision", type=precision, default=None,
                   help="repeat each point until its 95%% intervals are this narrow: default "
                        "(±2%% throughput, ±5%% TTFT/TPOT p50, at most 10 runs) or e.g. "
                        "throughput=2%%,ttft=5%%,max=8")
    p.add_argument("--live", action="store_true", help="serve Locust's web UI for the run in flight")
    p.add_argument("--live-host", default="127.0.0.1", help="address the web UI binds (with --live)")
