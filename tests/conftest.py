"""Helpers the integration tests share: free ports and a private copy of the local inventory."""

import shutil
import socket
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_inventory(folder: Path, **host_vars) -> Path:
    """inventory/local.yml with its own host folder and port, so a test shares nothing with a user.

    group_vars/ is copied beside it: Ansible reads it relative to the inventory file.
    """
    inv = yaml.safe_load((REPO / "inventory/local.yml").read_text())
    host = inv["all"]["children"]["vllm_servers"]["hosts"]["localhost"]
    host["lab_host_root"] = str(folder / "host")
    host["vllm_instances"] = [{"name": "main", "port": free_port(), "gpus": "", "flags": {}}]
    host.update(host_vars)
    path = folder / "inv.yml"
    path.write_text(yaml.safe_dump(inv))
    shutil.copytree(REPO / "inventory/group_vars", folder / "group_vars", dirs_exist_ok=True)
    return path
