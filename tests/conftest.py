"""Helpers the integration tests share: free ports, a private copy of the local inventory, and a
twin server started in its own process group."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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


class TwinProcess:
    """`vllm-twin serve` in its own process group, healthy when the constructor returns; ``stop()``
    stops the whole group by its id."""

    def __init__(self, log_dir: Path, *flags: str, model: str = "llama-3-8b", host: str = "127.0.0.1",
                 port: int | None = None, profile: str = "cpu-demo", startup_s: float = 0.3,
                 health_timeout_s: float = 60):
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.model = model
        self.log = open(Path(log_dir) / f"twin-{self.port}.log", "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_lab.twin.server", "serve", model, "--twin-profile", profile,
             "--twin-startup-seconds", str(startup_s), "--host", host, "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + health_timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=1).status == 200:
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise AssertionError("the twin did not become healthy:\n" + self.output())

    def output(self) -> str:
        """Everything the twin has logged so far."""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 10 s; the log is closed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
