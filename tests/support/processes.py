"""Processes and files the tests share: free ports, a private copy of the local inventory, a twin
server in its own process group, and a private PostgreSQL server. Everything started here is stopped
by its own process id or group, never looked up by name."""

import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from tests.support import require, slice_of

REPO = Path(__file__).resolve().parents[2]


def process_table() -> dict[int, list[str]]:
    """Every live process id and the fields of its /proc stat after the name: state, ppid, pgrp, ..."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # it ended while we looked
        table[int(entry)] = raw[raw.rindex(")") + 2:].split()
    return table


# Below the kernel's ephemeral range (ip_local_port_range, 32768 up by default): no client's
# outgoing connection can take a port between free_port() and the server's bind. Each xdist
# worker has its own slice, walked from a random start (another checkout's tests may run too).
_PORTS = slice_of(20000, 32768)
_NEXT = itertools.count(random.randrange(len(_PORTS)))


def server_pid(folder: Path) -> int | None:
    """The pid of the server a private inventory's host folder (``folder``/host) holds, if any."""
    for pidfile in (folder / "host").rglob("*.pid"):
        fields = pidfile.read_text().split()  # "pid starttime"
        if fields and fields[0].isdigit():
            return int(fields[0])
    return None


def free_port() -> int:
    """A TCP port nothing listens on now, from this worker's slice; the next call gives another."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_NEXT) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address: a server on any of them holds it
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


def private_inventory(folder: Path, **host_vars) -> Path:
    """inventory/local.yml with its own host folder and port, so a test shares nothing with a user.

    group_vars/ is copied beside it: Ansible reads it relative to the inventory file.
    """
    inv = yaml.safe_load((REPO / "inventory/local.yml").read_text())
    host = inv["all"]["children"]["vllm_servers"]["hosts"]["localhost"]
    host["lab_host_root"] = str(folder / "host")
    host["vllm_instances"] = [{"name": "main", "port": free_port(), "gpus": "", "flags": {}}]
    # The twin's stand-in for loading a model (1 s by default) is paid at every server start.
    host["vllm_twin_startup_seconds"] = 0.3
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


class PostgresServer:
    """A private PostgreSQL server (the system's binaries, scripts/install-system-deps.sh) on a free
    port, in a folder of its own under /tmp; ``with`` gives its URL, and the exit stops it by the
    postmaster's pid and removes the folder. PostgreSQL refuses to run as root, so as root it runs
    as the postgres user (pytest's own temporary folders are closed to other users)."""

    def __init__(self):
        self.folder, self.port = Path(tempfile.mkdtemp(prefix="lab-pg-")), free_port()
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        require(None if found or shutil.which("initdb") else
                "PostgreSQL is not installed (scripts/install-system-deps.sh installs it)")
        self.bin = found[-1].parent if found else Path(shutil.which("initdb")).parent
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *argv: str) -> None:
        subprocess.run([*self.as_user, *argv], check=True, capture_output=True, text=True)

    def __enter__(self) -> str:
        if self.as_user:
            shutil.chown(self.folder, "postgres", "postgres")
        data = self.folder / "data"
        self._run(str(self.bin / "initdb"), "-D", str(data), "-U", "lab", "--auth=trust")
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.folder / "log"), "-w", "start",
                  "-o", f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1")
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "lab", "optuna")
        return f"postgresql://lab@127.0.0.1:{self.port}/optuna"

    def __exit__(self, *exc) -> None:
        pid = int((self.folder / "data/postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        shutil.rmtree(self.folder, ignore_errors=True)
