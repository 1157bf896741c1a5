"""make provision, stop and teardown: the inventory's hosts made ready, every server stopped, or
what the lab put there removed, through their playbooks (another lab process's servers left alone)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_lab import serving
from vllm_lab.store import StoreError

PLAYBOOKS = {"provision": ("provision.yml", "make the inventory's hosts ready to serve (provision.yml)"),
             "stop": ("stop.yml", "stop every instance on the inventory's hosts (stop.yml)"),
             "teardown": ("teardown.yml", "stop, then remove what provision.yml and serve.yml put there")}


def register(sub) -> None:
    """``lab provision``, ``lab stop`` and ``lab teardown``."""
    for name, (_, what) in PLAYBOOKS.items():
        p = sub.add_parser(name, help=what)
        p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
        p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Provision, stop or tear down the inventory's hosts through their playbook."""
    serving.check_inventory(args.inventory)  # a bad inventory is one sentence before anything runs
    print(f"{args.command}: {args.inventory} (playbooks/{PLAYBOOKS[args.command][0]})", flush=True)
    action = {"provision": serving.provision, "stop": serving.stop, "teardown": serving.teardown}
    try:
        run = action[args.command](args.inventory)
    except RuntimeError as e:
        raise StoreError(f"{args.inventory}: {args.command} failed: {e}") from None
    for host, counts in run.recap.items():
        print(f"  {host}: {counts.get('changed', 0)} changed, {counts.get('ok', 0)} ok")
    for host, why in run.unreachable.items():
        print(f"  {host}: unreachable ({why})")
    return 1 if run.unreachable else 0
