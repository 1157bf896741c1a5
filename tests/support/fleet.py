"""Test helpers for the serving layer: a snapshot of the lab's sources, and a fleet of hosts made of
network namespaces on this machine, each with its own veth pair, address and sshd.

Everything is made by the test and removed by it, by process id and by the names it chose; nothing
is looked up by process name. The namespaces share this machine's filesystem, so each host gets its
own folder (``lab_host_root``) and its own port space.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.support import slice_of
from tests.support.processes import process_table

REPO = Path(__file__).resolve().parents[2]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
TWIN_MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def fleet_unavailable_reason() -> str | None:
    """Why the namespace fleet cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the network-namespace fleet needs root (ip netns): run the tests as root"
    if not shutil.which("ip"):
        return "iproute2 (ip) is missing: run scripts/install-system-deps.sh"
    if not Path(SSHD).exists() or not shutil.which("ssh-keygen"):
        return "openssh-server is missing: run scripts/install-system-deps.sh"
    probe = f"vlt5probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns unavailable: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def lab_source_snapshot(dest: Path) -> Path:
    """A frozen copy of the lab's package sources, so the wheel provision.yml builds stays the same
    while other work edits the checkout (the second run must see identical bytes)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(REPO / "vllm_lab", dest / "vllm_lab",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    return dest


def shared_site_vars() -> dict:
    """Host vars that give a host venv this interpreter and the lab venv's dependencies (via .pth)."""
    base = getattr(sys, "_base_executable", sys.executable)
    return {
        "lab_host_python": base,
        "lab_host_venv_site_dirs": [sysconfig.get_path("purelib")],
        "lab_host_lab_with_deps": False,
    }


def kill_instances(root: Path) -> None:
    """Stop any server a test left under ``root`` (pid files the vllm role wrote), by process group."""
    for pid_file in root.glob("**/serve/run/*.pid"):
        try:
            pid = int(pid_file.read_text().split()[0])
            os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def _descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (sshd's per-connection children start their own sessions)."""
    children: dict[int, list[int]] = {}
    for child, fields in process_table().items():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(started: dict[int, str]) -> list[int]:
    """Those of the processes (pid: its start time, /proc stat's field 22) that still run: not a
    zombie, and not another process that took a pid since."""
    table = process_table()
    return [pid for pid, start in started.items()
            if pid in table and table[pid][0] != "Z" and table[pid][19] == start]


def _kill_tree(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM an sshd we started, its process group and every descendant (open sessions included);
    SIGKILL what is left of the descendants after ``grace_s``.

    A session's shell gets its SIGTERM first: this machine's root shell runs ``pyenv rehash``
    at every login, and a rehash killed outright keeps pyenv's lock (its shims'
    ``.pyenv-shim``), so every later login on any host waited 60 s for it and the next playbook
    ran past the test's timeout (CI, 2026-12-06). Given SIGTERM, its EXIT trap gives the lock back."""
    if proc.poll() is not None:
        return
    table = process_table()
    started = {pid: table[pid][19] for pid in _descendants(proc.pid) if pid in table}
    victims = list(started)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (victims := _running(started)):
            time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@dataclass
class FleetHost:
    name: str
    netns: str
    veth_host: str
    address: str
    root: Path
    sshd: subprocess.Popen | None = None


@dataclass
class NetnsFleet:
    """N hosts, each a network namespace with a veth pair to this one, 10.77.<k>.2 and its own sshd."""

    workdir: Path
    size: int = 3
    hosts: list[FleetHost] = field(default_factory=list)

    def __post_init__(self):
        self.tag = str(os.getpid())  # unique among live processes: names no other fleet uses
        self.key = self.workdir / "id_ed25519"
        self.inventory = self.workdir / "fleet.yml"
        # SSH connections are shared per host, as ansible.cfg does, through sockets of this fleet's
        # own (a short path: a socket's is limited to 108 bytes); down() closes them.
        self.control_dir = Path(tempfile.mkdtemp(prefix="lab-ssh-"))

    def up(self, host_vars: dict | None = None) -> Path:
        """Make the namespaces, links, addresses and sshds; write and return the inventory."""
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True)
        (self.workdir / "authorized_keys").write_text((self.workdir / "id_ed25519.pub").read_text())
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
        used = _ip("-4", "-o", "addr").stdout
        mine = slice_of(10, 250)  # this xdist worker's subnets
        subnets = [k for k in random.sample(mine, len(mine)) if f"10.77.{k}." not in used]
        for i in range(self.size):
            k = subnets[i]
            host = FleetHost(name=f"fleet-{i + 1}", netns=f"vlt5-{self.tag}-{i + 1}",
                             veth_host=f"vt5h{self.tag}{i + 1}", address=f"10.77.{k}.2",
                             root=self.workdir / f"host-{i + 1}")
            self.hosts.append(host)
            peer = f"vt5n{self.tag}{i + 1}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth_host, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("addr", "add", f"10.77.{k}.1/24", "dev", host.veth_host)
            _ip("link", "set", host.veth_host, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", peer, ns=host.netns)
            _ip("link", "set", peer, "up", ns=host.netns)
            _ip("link", "set", "lo", "up", ns=host.netns)
            self._start_sshd(host)
        for host in self.hosts:
            self._wait_port(host.address, 22)
        self.write_inventory(host_vars or {})
        return self.inventory

    def _start_sshd(self, host: FleetHost) -> None:
        hostkey = self.workdir / f"hostkey-{host.name}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)], check=True)
        cfg = self.workdir / f"sshd-{host.name}.conf"
        cfg.write_text("\n".join([
            f"ListenAddress {host.address}", "Port 22", f"HostKey {hostkey}",
            f"PidFile {self.workdir}/sshd-{host.name}.pid",
            f"AuthorizedKeysFile {self.workdir}/authorized_keys",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "MaxStartups 50",
            "MaxSessions 50", "Subsystem sftp /usr/lib/openssh/sftp-server", ""]))
        log = open(self.workdir / f"sshd-{host.name}.log", "wb")  # noqa: SIM115 - the child keeps it
        host.sshd = subprocess.Popen(["ip", "netns", "exec", host.netns, SSHD, "-D", "-e", "-f", str(cfg)],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    @staticmethod
    def _wait_port(address: str, port: int, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"{address}:{port} did not open")

    def write_inventory(self, host_vars: dict) -> None:
        ssh_args = (f"-o ControlMaster=auto -o ControlPersist=60s -o ControlPath={self.control_dir}/%C "
                    "-o ConnectTimeout=5 -o ServerAliveInterval=2 "
                    "-o ServerAliveCountMax=2 -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                    "-o LogLevel=ERROR")
        hosts = {}
        for host in self.hosts:
            hosts[host.name] = {
                "ansible_host": host.address, "ansible_user": "root",
                "ansible_ssh_private_key_file": str(self.key), "ansible_ssh_args": ssh_args,
                "ansible_python_interpreter": "/usr/bin/python3",
                "lab_host_root": str(host.root), "lab_host_venv": str(host.root / "venv"),
                "vllm_venv": str(host.root / "venv"), "vllm_root": str(host.root / "serve"),
                **host_vars,
            }
        inv = {"all": {"children": {"vllm_servers": {"hosts": hosts}, "loadgen": {"hosts": {}},
                                    "monitoring": {"hosts": {}}}}}
        self.inventory.write_text(yaml.safe_dump(inv, sort_keys=False))

    def cut(self, host: FleetHost) -> None:
        """Make a host unreachable mid-run: its link goes down and its sshd is stopped by pid."""
        _ip("link", "set", host.veth_host, "down", check=False)
        if host.sshd:
            _kill_tree(host.sshd)

    def down(self) -> None:
        """Stop what the fleet started (servers, sshds) by pid, then remove links and namespaces."""
        kill_instances(self.workdir)
        for host in self.hosts:
            if host.sshd:
                _kill_tree(host.sshd)
            _ip("link", "del", host.veth_host, check=False)
            _ip("netns", "del", host.netns, check=False)
        # The shared connections' masters, through their own sockets (a cut host's may still wait
        # out its ServerAlive checks).
        for sock in self.control_dir.iterdir():
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "fleet"], check=False,
                           capture_output=True, timeout=10)
        shutil.rmtree(self.control_dir, ignore_errors=True)


# --- load generators on the fleet (tests/test_traffic_distributed.py) -------------------------

def host_side_address(host: FleetHost) -> str:
    """This machine's address on the host's link (10.77.<k>.1)."""
    return host.address.rsplit(".", 1)[0] + ".1"


def route_to_this_machine(fleet: NetnsFleet) -> None:
    """Give every namespace a route to 10.77.0.0/16 over its own link, so a server bound here to any
    host's link address is reachable from all hosts. Nothing is forwarded between namespaces: the
    destination is this machine's own address."""
    for host in fleet.hosts:
        _ip("route", "add", "10.77.0.0/16", "via", host_side_address(host), ns=host.netns)


def make_loadgen(fleet: NetnsFleet, names: list[str] | None = None) -> Path:
    """Move hosts (all by default) from the inventory's vllm_servers group to loadgen; return it."""
    inv = yaml.safe_load(fleet.inventory.read_text())
    groups = inv["all"]["children"]
    servers = groups["vllm_servers"]["hosts"]
    for name in [n for n in list(servers) if names is None or n in names]:
        groups["loadgen"]["hosts"][name] = servers.pop(name)
    fleet.inventory.write_text(yaml.safe_dump(inv, sort_keys=False))
    return fleet.inventory
