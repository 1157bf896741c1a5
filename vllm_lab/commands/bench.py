"""make bench: one of the benchmarks in scripts/bench_<name>.py, run with this Python and its own
arguments as given (no shell)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from vllm_lab.commands.arguments import UsageError

BENCH_DIR = Path(__file__).resolve().parents[2] / "scripts"


def benchmarks() -> dict[str, Path]:
    """The benchmark scripts by name: scripts/bench_<name>.py is <name>, '_' spelled '-'."""
    return {p.stem.removeprefix("bench_").replace("_", "-"): p
            for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def register(sub) -> None:
    """``lab bench``."""
    p = sub.add_parser("bench", help="run one of the benchmarks in scripts/bench_*.py")
    p.add_argument("name", help="the benchmark, e.g. twin for scripts/bench_twin.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run one benchmark script with this Python, its arguments as given (no shell)."""
    known = benchmarks()
    if args.name not in known:
        raise UsageError(f"benchmark {args.name!r} is not one of scripts/bench_*.py "
                         f"({', '.join(known)})")
    return subprocess.run([sys.executable, str(known[args.name]), *args.args], check=False).returncode
