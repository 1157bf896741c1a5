"""Run Locust headless against a server and return the merged raw samples and scraped metrics.

One host: `locust --processes N` (or one process). Several hosts: a master here and `locust
--worker` on each load-generator host (local ones as subprocesses, remote ones over ssh, their
sample files copied back with scp). Every Locust process runs in its own process group and is
stopped by that group's id.

The files of a run's folder (under OUT/.work) are made fresh before Locust starts, never written
through what was there (a link, a FIFO), and read back bounded and without blocking
(`samples.read_run_samples`, `worker_summaries`, `stop_reason`).

Remote workers run the lab that provision.yml (role lab_host) installed on the inventory's
load-generator hosts: `loadgen_workers(inventory)` reads each host's address, SSH settings and
interpreter (`<lab_host_venv>/bin/python`, or `lab_host_python` where `lab_host_lab_install` is
false) through Ansible, so the inventory's templating and group_vars apply. A remote worker gets
its own copy of the run's config in `<lab_host_root>/traffic/<run>/`, writes its samples there,
and they are copied back here and removed there once it has exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import pandas as pd

from vllm_lab.inputs import InputError
from vllm_lab.traffic import samples as samples_mod
from vllm_lab.traffic.arrivals import client_overloaded
from vllm_lab.traffic.samples import LiveFigures
from vllm_lab.traffic.scrape import Scraper, frame
from vllm_lab.traffic.spec import Load, Workload
from vllm_lab.traffic.workloads import PromptBuilder

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# How a local Locust process gets the server's API key (environment, not argv or the config file).
API_KEY_ENV = "VLLM_LAB_API_KEY"
# The first share of an open loop's schedule a worker host's processes send (the lab deals them by
# the host's place in the list; the locustfile reads the same name).
FIRST_SHARE_ENV = "VLLM_LAB_FIRST_SHARE"
_LOCAL = {"127.0.0.1", "localhost", "::1"}
# The lab_host role's defaults (playbooks/roles/lab_host/defaults/main.yml), for hosts that set none.
LAB_HOST_ROOT_DEFAULT = "/opt/vllm-lab"
# The end of Locust's output that a failure shows.
TAIL_BYTES = 2000


@dataclass
class LoadResult:
    """What one load run produced: raw samples, server metrics and the client's own health."""

    samples: pd.DataFrame
    server_metrics: pd.DataFrame
    client_overloaded: bool
    schedule_lag_p99_s: float
    loop_lag_p99_s: float = 0.0
    cpu_fraction_max: float = 0.0
    stop_reason: str = ""
    locust_rc: int = 0
    out_dir: Path | None = None
    workers: list[dict] = field(default_factory=list)
    token_count_approximation: str | None = None


class TrafficError(RuntimeError):
    """Locust could not run (it crashed, or its workers never connected)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies left to a container's PID 1,
    which may never reap them, do not count)."""
    stats = list(Path("/proc").glob("[0-9]*/stat"))
    if not stats:  # no /proc: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat_file in stats:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _wait_group(pgid: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for every process of the group to end; True when none is left."""
    deadline = time.monotonic() + seconds
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0, drain_s: float = 0.0) -> None:
    """Stop a process group we started: let it end by itself for up to ``drain_s``, then SIGTERM,
    then SIGKILL after a grace period.

    The drain matters for Locust's ``--processes``: its master quits at once while the workers it
    forked still finish their in-flight requests and write their samples (a graceful stop); read
    before they end, a run loses exactly its slowest last requests.
    """
    deadline = time.monotonic() + drain_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(drain_s)
    if _wait_group(proc.pid, deadline - time.monotonic()) and proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not _wait_group(proc.pid, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _stop_run(proc: subprocess.Popen, worker_procs: list[subprocess.Popen],
              request_timeout_s: float) -> None:
    """Stop a run's Locust master and workers, each by its process group.

    A graceful stop waits up to the request timeout for the requests in flight (Locust's
    --stop-timeout); the workers get as long to finish them and write their samples. The master
    tells its workers to quit; a worker writes its samples' summary on the way out, so it gets
    time to finish (a remote one ends its ssh session) before being stopped.
    """
    drain_s = request_timeout_s + 15 if proc.poll() is not None else 0.0
    _stop_group(proc, drain_s=drain_s)
    deadline = time.monotonic() + max(drain_s, 15)
    for w in worker_procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.wait(max(0.1, deadline - time.monotonic()))
        _stop_group(w)


@dataclass(frozen=True)
class WorkerHost:
    """A load-generator host: where Locust workers run, how to reach it, which Python runs them."""

    name: str                       # the inventory's name; remote workers label their samples with it
    address: str                    # what ssh connects to (ansible_host)
    python: str = "python3"         # interpreter with the lab (and Locust) on that host
    user: str = ""
    port: int | None = None
    key: str = ""                   # private key file
    ssh_args: tuple[str, ...] = ()  # the inventory's ansible_ssh_*args, split
    root: str = LAB_HOST_ROOT_DEFAULT  # lab_host_root: the run's folder goes under <root>/traffic
    local: bool = False             # this machine: a subprocess with this interpreter, no ssh

    @classmethod
    def of(cls, host: str | WorkerHost) -> WorkerHost:
        """A WorkerHost as is, or one for a bare address (python3 on its PATH, as before)."""
        if isinstance(host, WorkerHost):
            return host
        return cls(name=host, address=host, local=host in _LOCAL)

    def _opts(self, port_flag: str) -> list[str]:
        opts = ["-o", "BatchMode=yes", *self.ssh_args]
        if self.port:
            opts += [port_flag, str(self.port)]
        if self.key:
            opts += ["-i", self.key]
        return opts

    @property
    def target(self) -> str:
        """user@address, as ssh and scp take it."""
        return f"{self.user}@{self.address}" if self.user else self.address

    def ssh(self, remote_cmd: str) -> list[str]:
        """The ssh command line that runs remote_cmd (a shell string) on this host."""
        return ["ssh", *self._opts("-p"), self.target, remote_cmd]

    def scp_from(self, remote_glob: str, local_dir: Path) -> list[str]:
        """The scp command line that copies remote_glob from this host into local_dir."""
        return ["scp", "-q", *self._opts("-P"), f"{self.target}:{remote_glob}", str(local_dir)]


# One Jinja expression per host, rendered by Ansible itself (group_vars, templates, defaults).
_HOST_VARS = (
    "{{ {'address': ansible_host | default(inventory_hostname),"
    " 'connection': ansible_connection | default('ssh'),"
    " 'user': ansible_user | default(''),"
    " 'port': ansible_port | default(''),"
    " 'key': ansible_ssh_private_key_file | default(ansible_private_key_file | default('')),"
    " 'ssh_args': [ansible_ssh_args | default(''), ansible_ssh_common_args | default(''),"
    " ansible_ssh_extra_args | default('')] | join(' '),"
    " 'lab_install': lab_host_lab_install | default(true) | bool,"
    f" 'root': lab_host_root | default('{LAB_HOST_ROOT_DEFAULT}'),"
    f" 'venv': lab_host_venv | default((lab_host_root | default('{LAB_HOST_ROOT_DEFAULT}')) ~ '/venv'),"
    " 'python': lab_host_python | default('python3')} }}"
)


def loadgen_workers(inventory: Path, group: str = "loadgen") -> list[WorkerHost]:
    """The inventory's load-generator hosts (in ansible-inventory's order) as WorkerHosts.

    Where provision.yml installed the lab (lab_host_lab_install, the default) a worker runs
    `<lab_host_venv>/bin/python`; elsewhere the host's `lab_host_python`, which must hold the lab.
    A host with ansible_connection=local, or at 127.0.0.1/localhost, is this machine.
    """
    from vllm_lab import serving  # no import cycle: serving imports nothing of traffic

    names = serving.serve_hosts(Path(inventory), group=group)
    exe = str(Path(serving._ansible_playbook()).with_name("ansible"))
    env = dict(os.environ, ANSIBLE_CONFIG=str(serving.REPO_ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
               ANSIBLE_STDOUT_CALLBACK="ansible.builtin.minimal", ANSIBLE_CALLBACK_RESULT_FORMAT="json",
               ANSIBLE_DEPRECATION_WARNINGS="0",
               # Ansible's own strategy: the lab's would start Mitogen's connection process for nothing.
               ANSIBLE_STRATEGY="linear")
    # debug runs on the control node: nothing connects to the hosts.
    out = subprocess.run([exe, "-i", str(inventory), group, "-m", "ansible.builtin.debug",
                          "-a", json.dumps({"msg": _HOST_VARS})], capture_output=True, text=True,
                         env=env, cwd=serving.REPO_ROOT, check=False, timeout=120)
    found: dict[str, dict] = {}
    decoder = json.JSONDecoder()
    for m in re.finditer(r"^(\S+) \| SUCCESS => ", out.stdout, re.MULTILINE):
        found[m.group(1)] = decoder.raw_decode(out.stdout, m.end())[0]["msg"]
    missing = [n for n in names if n not in found]
    if out.returncode or missing:
        raise RuntimeError(f"{inventory}: could not read the variables of {', '.join(missing) or group}:"
                           f" {(out.stdout + out.stderr).strip()[-800:]}")
    workers = []
    for name in names:
        v = found[name]
        local = v["connection"] == "local" or v["address"] in _LOCAL
        workers.append(WorkerHost(
            name=name, address=v["address"], local=local,
            python=f"{v['venv']}/bin/python" if v["lab_install"] else v["python"],
            user=v["user"], port=int(v["port"]) if str(v["port"]).strip() else None, key=v["key"],
            ssh_args=tuple(shlex.split(v["ssh_args"])), root=v["root"]))
    return workers


# Where the lab's locustfile lies in the remote host's installed package.
_FIND_LOCUSTFILE = ("import os, vllm_lab; "
                    "print(os.path.join(os.path.dirname(vllm_lab.__file__), 'traffic', 'locustfile.py'))")


def _worker_cmd(host: str | WorkerHost, master: str, port: int, cfg: Path | str,
                processes: int, first_share: int = 0) -> list[str]:
    """The command that starts a host's Locust worker(s); cfg is the config's path on that host,
    first_share the first share of the schedule its processes send (a local worker has it in the
    environment _run_locust gives it; ssh does not pass the environment on)."""
    h = WorkerHost.of(host)
    args = ["--worker", "--master-host", master, "--master-port", str(port)]
    if processes > 1:
        args += ["--processes", str(processes)]
    if h.local:
        return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *args]
    # The installed lab's own locustfile, found by the host's interpreter; exec keeps one process
    # that ends when the master sends quit.
    py = shlex.quote(h.python)
    remote = (f"LF=$({py} -c {shlex.quote(_FIND_LOCUSTFILE)}) && "
              f"cd {shlex.quote(str(PurePosixPath(str(cfg)).parent))} && "
              f"VLLM_LAB_TRAFFIC_CONFIG={shlex.quote(str(cfg))} {FIRST_SHARE_ENV}={int(first_share)} "
              f"PYTHONUNBUFFERED=1 "
              f"exec {py} -m locust -f \"$LF\" {shlex.join(args)}")
    return h.ssh(remote)


def _remote_dir(h: WorkerHost, run_tag: str) -> str:
    return str(PurePosixPath(h.root) / "traffic" / run_tag)


def _master_address(h: WorkerHost) -> str:
    """This machine's address as seen from the worker's host: the source of the route there."""
    if h.local:
        return "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(h.address, 22, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def _distinct_remote(workers: list[WorkerHost]) -> list[WorkerHost]:
    seen: dict[tuple, WorkerHost] = {}
    for w in workers:
        if not w.local:
            seen.setdefault((w.target, w.port, w.root), w)
    return list(seen.values())


def _copy_to_remote(workers: list[WorkerHost], config: dict, run_tag: str) -> None:
    """Write each remote host's copy of the run's config (its own out_dir, its name) over ssh."""
    for h in _distinct_remote(workers):
        rdir = _remote_dir(h, run_tag)
        body = json.dumps({**config, "out_dir": rdir, "worker_host": h.name})
        try:
            subprocess.run(h.ssh(f"umask 077 && mkdir -p {shlex.quote(rdir)}/samples && "
                                 f"cat > {shlex.quote(rdir)}/traffic_config.json"),
                           input=body, text=True, check=True, timeout=60, capture_output=True)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            why = (e.stderr or "").strip()[-500:] if isinstance(e.stderr, str) else str(e)
            raise TrafficError(f"load generator {h.name} ({h.target}) did not take the run's "
                               f"config: {why}") from e


def _fetch_remote_samples(workers: list[WorkerHost], out_dir: Path, run_tag: str) -> None:
    """Copy each remote host's sample and summary files here, then remove its run folder there."""
    for h in _distinct_remote(workers):
        rdir = _remote_dir(h, run_tag)
        got = subprocess.run(h.scp_from(f"{rdir}/samples/*", out_dir / "samples"),
                             check=False, timeout=300, capture_output=True, text=True)
        if got.returncode == 0:
            subprocess.run(h.ssh(f"rm -rf {shlex.quote(rdir)}"), check=False, timeout=60,
                           capture_output=True)
        else:
            # The samples stay there for a look; the config, which holds the API key, does not.
            subprocess.run(h.ssh(f"rm -f {shlex.quote(rdir)}/traffic_config.json"), check=False,
                           timeout=60, capture_output=True)
            print(f"traffic: no samples from {h.name} ({rdir}): {got.stderr.strip()[-300:]}",
                  file=sys.stderr)


def _wait(proc: subprocess.Popen, limit: float, samples_dir: Path,
          on_progress: Callable[..., None] | None, every_s: float = 2.0) -> int:
    """Wait for Locust (-1 past ``limit``), reporting live figures every ``every_s`` seconds."""
    if on_progress is None:
        try:
            return proc.wait(limit)
        except subprocess.TimeoutExpired:
            return -1
    live = LiveFigures(samples_dir)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return proc.wait(min(every_s, max(0.01, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            on_progress(**live.read())
    return -1


def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    load: Load,
    out_dir: Path,
    seed: int = 0,
    api_key: str | None = None,
    processes: int = 1,
    scrape_metrics: bool = True,
    workers_hosts: list[str | WorkerHost] | None = None,
    scrape_interval_s: float = 2.0,
    on_progress: Callable[..., None] | None = None,
    web_host: str | None = None,
) -> LoadResult:
    """Run Locust headless against base_url until the load's stop condition; return the samples.

    workers_hosts: one Locust worker (of `processes` processes) per entry, with a master here;
    entries are WorkerHosts (see loadgen_workers) or bare addresses. base_url must be reachable
    from every worker's host. on_progress(requests=, tok_s=, errors=) hears the figures so far
    every few seconds (web_url= once when web_host serves Locust's web UI for the run).
    """
    out_dir = _fresh_out_dir(out_dir)
    hosts = [WorkerHost.of(h) for h in workers_hosts or []]
    config = {
        "base_url": base_url, "model": model, "seed": seed, "out_dir": str(out_dir),
        "num_workers": len(hosts) * processes if hosts else processes,
        # One process, or the processes Locust forks here, share the request pool's memory;
        # workers started on their own (hosts) ask the master for each request.
        "shared_pool": not hosts,
        "workload": workload.model_dump(mode="json"), "load": load.model_dump(mode="json"),
    }
    cfg = _write_config(out_dir, config)
    run_tag = f"{out_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
    env = {**os.environ, "VLLM_LAB_TRAFFIC_CONFIG": str(cfg), "PYTHONUNBUFFERED": "1"}
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *_ui(web_host, on_progress),
           "--host", base_url, "--csv", str(out_dir / "locust"),
           "--logfile", str(out_dir / "locust.log"),
           "--only-summary", "--stop-timeout", str(int(load.request_timeout_s))]
    port = _free_port()
    cmd += _distribution(hosts, processes, config["num_workers"], port)
    if hosts:
        # A remote worker's copy holds the key (0600 under umask 077, removed after the run):
        # through ssh's command line it would show in ps on both ends.
        _copy_to_remote(hosts, {**config, "api_key": api_key}, run_tag)
    scraper = Scraper(base_url, scrape_interval_s).start() if scrape_metrics else None
    rc, tail = _run_locust(cmd, env, out_dir, load, hosts, processes,
                           lambda h, first: _worker_popen_args(h, cfg, run_tag, port, processes, first),
                           on_progress)
    metrics = scraper.stop() if scraper else frame([])
    _fetch_remote_samples(hosts, out_dir, run_tag)
    return _result(out_dir, rc, tail, metrics, load, workload)


# What the lab and Locust write in a run's folder: each made fresh for the run.
_RUN_FILES = ("traffic_config.json", "locust.stdout", "locust.log", "stop_reason.json",
              "locust_stats.csv", "locust_stats_history.csv", "locust_failures.csv",
              "locust_exceptions.csv")


def _fresh_out_dir(out_dir: Path) -> Path:
    """The run's folder, its samples folder empty and nothing of an earlier run left in the files
    the run writes: a link there is removed as a link, never written through, and a FIFO is
    removed, never opened (Locust and the lab would wait on it for a reader)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("samples", *_RUN_FILES):
        _remove(out_dir / name)
    (out_dir / "samples").mkdir()
    return out_dir


def _remove(path: Path) -> None:
    """Remove what is at ``path``: a folder with what it holds (links in it as links), else the
    entry itself."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _create(path: Path, mode: int = 0o600) -> int:
    """A new file at ``path``, open for writing (and reading back): O_EXCL makes it ours, never
    whatever took the name after ``_fresh_out_dir`` cleared it; TrafficError otherwise."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                       mode)
    except FileExistsError:
        raise TrafficError(f"{path}: appeared while the run was being set up; the lab writes "
                           f"its own files there and writes through nothing else") from None


def _write_config(out_dir: Path, config: dict) -> Path:
    # The config stays beside the samples, so it holds no key: local Locust processes get the key
    # in their environment (never in argv, which ps shows to every user).
    cfg = out_dir / "traffic_config.json"
    with os.fdopen(_create(cfg), "w") as fh:
        json.dump(config, fh)
    return cfg


def _ui(web_host: str | None, on_progress: Callable[..., None] | None) -> list[str]:
    """Locust's options for headless, or for its web UI (LIVE=1: the same run, started at once,
    with Locust's web UI to watch it; it quits when the shape ends the run, as a headless one does)."""
    if not web_host:
        return ["--headless"]
    web_port = _free_port()
    shown = "127.0.0.1" if web_host in ("0.0.0.0", "::", "*") else web_host
    if on_progress:
        on_progress(web_url=f"http://{'[' + shown + ']' if ':' in shown else shown}:{web_port}/")
    return ["--autostart", "--autoquit", "0", "--web-host", web_host, "--web-port", str(web_port)]


def _distribution(hosts: list[WorkerHost], processes: int, num_workers: int, port: int) -> list[str]:
    """Locust's options for a master of workers on hosts, for processes forked here, or none."""
    if hosts:
        bind = "127.0.0.1" if all(h.local for h in hosts) else "0.0.0.0"
        return ["--master", "--expect-workers", str(num_workers), "--master-bind-host", bind,
                "--master-bind-port", str(port), "--expect-workers-max-wait", "60"]
    if processes > 1:
        # Its own port for the forked workers to report to, not Locust's fixed 5557: two runs on
        # one machine (two checkouts, a test suite on every core) would meet on it.
        return ["--processes", str(processes), "--master-bind-host", "127.0.0.1",
                "--master-bind-port", str(port), "--master-host", "127.0.0.1",
                "--master-port", str(port)]
    return []


def _worker_popen_args(h: WorkerHost, cfg: Path, run_tag: str, port: int, processes: int,
                       first_share: int) -> list[str]:
    where = cfg if h.local else PurePosixPath(_remote_dir(h, run_tag), cfg.name)
    return _worker_cmd(h, _master_address(h), port, where, processes, first_share)


def _run_locust(cmd: list[str], env: dict, out_dir: Path, load: Load, hosts: list[WorkerHost],
                processes: int, worker_cmd: Callable[[WorkerHost, int], list[str]],
                on_progress: Callable[..., None] | None) -> tuple[int, str]:
    """Locust (and its workers on hosts) from start to stop, each in its own process group; its
    exit code and the end of its output (read from the lab's own file, not the name again).

    Each worker host's processes send the shares of an open loop's schedule from its place in
    ``hosts`` on, dealt here: not by the index Locust's master acknowledges a worker with, which
    a worker reads as 0 until the acknowledgement arrives."""
    worker_procs: list[subprocess.Popen] = []
    with os.fdopen(_create(out_dir / "locust.stdout"), "w+b") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            for place, h in enumerate(hosts):
                first = place * processes
                worker_procs.append(subprocess.Popen(
                    worker_cmd(h, first), env={**env, FIRST_SHARE_ENV: str(first)}, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
            # The shape stops the run, and Locust's graceful stop gives the requests in flight up
            # to the request timeout (--stop-timeout); this limit only catches a hung Locust.
            rc = _wait(proc, load.stop.duration_s + load.request_timeout_s + 60,
                       out_dir / "samples", on_progress)
        finally:
            try:
                _stop_run(proc, worker_procs, load.request_timeout_s)
            except KeyboardInterrupt:
                # A stop signal during the drain: the run is not recorded, so nothing waits for it.
                for p in (proc, *worker_procs):
                    _stop_group(p, grace_s=2.0)
                raise
        size = os.fstat(log.fileno()).st_size
        tail = os.pread(log.fileno(), TAIL_BYTES, max(0, size - TAIL_BYTES))
    return rc, tail.decode("utf-8", errors="replace")


def check_shares(workers: list[dict], load: Load) -> None:
    """TrafficError where two processes of an open loop took one share of its schedule.

    Each process sends its own share (``arrivals.dealt``, by the index in its summary): two with
    one share send those requests twice and leave another share unsent, a load that is not the
    schedule (seen once, in CI: two forked processes both read index 0)."""
    shares = [w.get("index") for w in workers]
    if load.open_loop and len(set(shares)) < len(shares):
        raise TrafficError(f"Locust's {len(shares)} processes took the schedule's shares "
                           f"{sorted(shares, key=str)}: two sent the same requests, so the run's "
                           f"load was not its schedule")


def _result(out_dir: Path, rc: int, tail: str, metrics: pd.DataFrame, load: Load,
            workload) -> LoadResult:
    samples_dir = out_dir / "samples"
    try:
        df = samples_mod.read_run_samples(samples_dir)
    except InputError as e:
        raise TrafficError(f"the run's samples cannot be read: {e}") from None
    workers = samples_mod.worker_summaries(samples_dir)
    if rc not in (0, 1) or (df.empty and not workers):
        raise TrafficError(f"locust exited with {rc} and wrote no samples; output tail:\n{tail}")
    check_shares(workers, load)
    sched = df["sched_lag_s"].dropna().to_numpy(dtype=float) if len(df) else np.array([])
    sched_p99 = float(np.percentile(sched, 99)) if sched.size else 0.0
    # Per-worker loop-lag p99s are not averaged: the worst worker decides.
    loop_p99 = max((w["loop_lag"]["p99"] for w in workers), default=0.0)
    cpu = max((w["cpu_fraction"] for w in workers), default=0.0)
    approx = PromptBuilder(workload.tokenizer).approximation
    return LoadResult(
        samples=df,
        server_metrics=metrics,
        client_overloaded=client_overloaded(sched_p99, loop_p99, cpu, load.max_schedule_lag_s),
        schedule_lag_p99_s=sched_p99,
        loop_lag_p99_s=loop_p99,
        cpu_fraction_max=cpu,
        stop_reason=samples_mod.stop_reason(out_dir / "stop_reason.json"),
        locust_rc=rc,
        out_dir=out_dir,
        workers=workers,
        token_count_approximation=approx,
    )


def wait_for(url: str, timeout_s: float = 30.0) -> None:
    """Block until url answers, or raise TrafficError after timeout_s."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.1)
    raise TrafficError(f"{url} did not answer within {timeout_s} s")
