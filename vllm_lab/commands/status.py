"""make status: what the lab under OUT is doing now (experiment, point, phase, since when), or did
last, from its heartbeat file and the store's newest experiment; from any shell."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_lab.commands.arguments import out_folder
from vllm_lab.progress import describe_status
from vllm_lab.store import Store


def register(sub) -> None:
    """``lab status``."""
    p = sub.add_parser("status", help="what the lab is doing now (or did last), from another shell too")
    p.add_argument("--out", type=out_folder, default=Path("reports"))
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Print what the lab under OUT is doing, or did last."""
    store_path = args.out / "lab.db"
    newest = None
    if store_path.exists():
        with Store(store_path) as store:
            exp = store.newest_experiment()
            if exp:
                runs = store.runs(exp)
                newest = {"id": exp, "step": store.experiment(exp)["step"],
                          "statuses": runs["status"].value_counts().to_dict()}
    print(describe_status(args.out, newest))
    return 0
