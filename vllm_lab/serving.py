"""Start and stop vLLM (or the twin) on an inventory's hosts through the lab's playbooks.

Playbooks are the only way the lab touches hosts: ``start`` runs ``playbooks/serve.yml`` and
``stop`` runs ``playbooks/stop.yml`` with ``ansible-playbook`` as a subprocess. Variables travel in
a temporary JSON file (``-e @file``, mode 0600), never on the command line, so a secret never shows
in ``ps``. Each host's outcome comes back as a small JSON file the playbook writes on the control
node; the play recap says which hosts were unreachable, so one dead host of a fleet is reported
while the others serve.

Two lab processes must not share an instance (its pid file and port: each would stop or restart
the other's server). Every playbook that touches an instance first claims it for this process
(``lab_owner``: experiment, pid, control node) in a lock beside its pid file; another live owner is
refused with ``InstanceBusy`` naming it, and a dead owner's lock is taken over. A lock file, not a
port of our own, because a GPU host's instances are its GPUs: two servers on one GPU would measure
each other.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_lab.inputs import InputError, load_yaml, read_bytes, read_text

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
PLAYBOOKS = REPO_ROOT / "playbooks"
DEFAULT_INVENTORY = REPO_ROOT / "inventory" / "local.yml"
# Plus "unreachable" (no host answered) and "refused-config" (the role's preflight refused the
# inventory or the variables before anything started: a retry fails the same way).
CAUSES = ("oom", "refused-flag", "start-timeout", "crashed")
# Flags that are secrets: they travel as role variables (environment file on the host), never as flags.
SECRET_FLAGS = {"api-key": "vllm_api_key", "hf-token": "vllm_hf_token"}

# What vLLM (and the twin, which copies its wording) prints when the KV cache or weights do not fit.
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"
    r"|No available memory for the cache blocks"
    r"|larger than the available KV cache memory"
    r"|less than desired GPU memory utilization"
    r"|Insufficient memory|not enough memory", re.IGNORECASE)
# argparse refusals, and vLLM's config validation (pydantic) of the engine arguments.
_REFUSED = re.compile(
    r"unrecognized arguments|invalid choice|error: argument --|vllm serve: error: "
    r"|validation errors? for \w*(Config|Args)\b")
# A ValueError/TypeError is a refused flag when it names one (max_num_seqs or --max-num-seqs).
_ERROR_LINE = re.compile(r"\b(?:ValueError|TypeError)\b:?(.*)")
_FLAG_WORD = re.compile(r"--([a-z][a-z0-9-]+)|\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b")


def _names_a_flag(text: str) -> bool:
    from vllm_lab.flags import FLAGS  # the catalog of vLLM's serve flags

    for match in _ERROR_LINE.finditer(text):
        for dashed, snake in _FLAG_WORD.findall(match.group(1)):
            if (dashed or snake.replace("_", "-")) in FLAGS:
                return True
    return False

class InventoryError(RuntimeError):
    """The inventory cannot be used (missing, malformed, no such group); one sentence naming it."""


class InstanceBusy(Exception):
    """Another live lab process holds instances this one needs; ``busy``: host -> [{name, port, holder}]."""

    def __init__(self, inventory: Path, busy: dict[str, list[dict]]):
        self.busy = busy
        host, first = next(iter(busy.items()))
        b = first[0]
        h = b.get("holder", {})
        super().__init__(
            f"{inventory}: {host}'s instance {b.get('name')} (port {b.get('port')}) is held by experiment "
            f"{h.get('experiment') or '(none named)'} (lab pid {h.get('pid')} on {h.get('node')}, since "
            f"{h.get('since', '?')}); wait until it ends, or serve on other instances (vllm_instances)")


class ServeError(RuntimeError):
    """vLLM or the twin did not come up: ``cause`` is one of CAUSES, ``log_tail`` its last lines."""

    def __init__(self, cause: str, log_tail: str = "", *, host: str | None = None,
                 failures: list[dict] | None = None, instances: list[Instance] | None = None):
        self.cause = cause
        self.log_tail = log_tail
        self.host = host
        self.failures = failures or []
        self.instances = instances or []
        where = f" on {host}" if host else ""
        super().__init__(f"server did not start{where}: {cause}")


@dataclass(frozen=True)
class Instance:
    """One running server: where it answers and where its log is on its host."""

    host: str
    url: str
    port: int
    log_path: str
    name: str = "main"
    gpus: str = ""  # CUDA_VISIBLE_DEVICES of the instance ("" = every GPU of the host)
    # The key the server was given (scenario, inventory, vault or environment), for the load
    # generator; kept in memory only, never printed.
    api_key: str = field(default="", repr=False, compare=False)


class Instances(list):
    """The healthy instances, plus the hosts that could not be reached (``unreachable``: host -> why)."""

    def __init__(self, items=(), unreachable: dict[str, str] | None = None):
        super().__init__(items)
        self.unreachable: dict[str, str] = unreachable or {}


@dataclass
class PlaybookRun:
    """What one ansible-playbook run did, per host, from its recap."""

    returncode: int
    stdout: str
    recap: dict[str, dict[str, int]] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> int:
        """Tasks that changed something, over all hosts."""
        return sum(h.get("changed", 0) for h in self.recap.values())


def oom_line(log_tail: str) -> str | None:
    """What the log says about running out of GPU memory, from its first words on, if it does.

    The line is cut where the match begins: PyTorch's message puts the size it tried to allocate
    first and a long advice on fragmentation last, and a process prefix before it says nothing.
    """
    for ln in log_tail.splitlines():
        if m := _OOM.search(ln):
            return ln[m.start():].strip()
    return None


def classify_failure(log_tail: str, status: str) -> str:
    """Why a server did not come up: oom | refused-flag | start-timeout | crashed.

    ``status`` is how the wait ended: "exited" (the process is gone), "failed" (alive, but its log
    shows a fatal engine error) or "timeout" (still running, /health never answered). Log evidence
    wins over the status: an OOM can hang instead of exiting.
    """
    if _OOM.search(log_tail):
        return "oom"
    if _REFUSED.search(log_tail) or _names_a_flag(log_tail):
        return "refused-flag"
    return "start-timeout" if status == "timeout" else "crashed"


def scrub(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    """``text`` with every non-empty secret replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(str(secret), "***")
    return text


# An assert's failure, in the default callback's JSON or YAML-like result format.
_ASSERT_FAILED = re.compile(r'"?evaluated_to"?: false')


def _start_time(pid: int) -> str:
    """A process's start time in clock ticks (/proc), which tells a live pid from a reused one."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return ""
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[19] if fields[0] != "Z" else ""


def lab_owner(experiment: str = "") -> dict[str, Any]:
    """This lab process as the owner of the instances it claims (the lock's content)."""
    return {"experiment": experiment, "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
            "node": socket.gethostname()}


def _owner_token(owner: dict) -> str:
    return f"{owner.get('node', '')}:{owner.get('pid', '')}:{owner.get('pid_start', '')}"


def _dead_here(holder: dict) -> bool:
    """The holder ran on this node and its process is gone (only here can its pid be checked)."""
    if holder.get("node") != socket.gethostname() or not holder.get("pid"):
        return False
    start = _start_time(int(holder["pid"]))
    return not start or (bool(holder.get("pid_start")) and start != str(holder["pid_start"]))


_RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")
_UNREACHABLE = re.compile(r"^fatal: \[([^\]]+)\]: (UNREACHABLE|FAILED)! => (.*)$")
# Ansible's ssh connection's words for a host it lost. ansible-core 2.18's template and copy
# actions report a host lost during them as FAILED with these words, not UNREACHABLE.
_LOST_CONNECTION = "Failed to connect to the host via"


def parse_recap(stdout: str) -> dict[str, dict[str, int]]:
    """Per-host counters (ok, changed, unreachable, failed, ...) from the PLAY RECAP block."""
    recap: dict[str, dict[str, int]] = {}
    in_recap = False
    for line in stdout.splitlines():
        if line.startswith("PLAY RECAP"):
            in_recap = True
            continue
        match = _RECAP.match(line.strip()) if in_recap else None
        if match:
            recap[match.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(2))}
    return recap


def run_playbook(playbook: str, *, inventory: Path, extra_vars: dict | None = None,
                 limit: str | None = None, secrets: list[str] | tuple[str, ...] = (),
                 timeout: float | None = None) -> PlaybookRun:
    """Run one playbook of playbooks/ and return its recap; secrets are scrubbed from the output."""
    with tempfile.TemporaryDirectory(prefix="vllm-lab-ansible-") as tmp:
        vars_file = Path(tmp) / "extra-vars.json"
        fd = os.open(vars_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(extra_vars or {}, fh)
        cmd = [_ansible_playbook(), "-i", str(inventory), str(PLAYBOOKS / playbook), "-e", f"@{vars_file}"]
        if limit:
            cmd += ["--limit", limit]
        env = dict(os.environ, ANSIBLE_CONFIG=str(REPO_ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
                   ANSIBLE_FORCE_COLOR="0", ANSIBLE_STDOUT_CALLBACK="default",
                   ANSIBLE_RETRY_FILES_ENABLED="0", PYTHONUNBUFFERED="1",
                   # An inventory Ansible cannot parse fails the play instead of running on no host.
                   ANSIBLE_INVENTORY_UNPARSED_FAILED="1")
        log.debug("running %s", " ".join(cmd))
        returncode, stdout = _run_group(cmd, env, timeout, label=playbook)
    out = scrub(stdout, secrets)
    unreachable = _unreachable_reasons(out)
    recap = parse_recap(out)
    for host, counts in recap.items():
        if counts.get("unreachable") and host not in unreachable:
            unreachable[host] = "unreachable"
    return PlaybookRun(returncode, out, recap, unreachable)


def _run_group(cmd: list[str], env: dict[str, str], timeout: float | None,
               label: str) -> tuple[int, str]:
    """Run ``cmd`` in a process group of its own (a terminal's Ctrl-C reaches the lab alone, which
    decides, so a stop playbook is never cut short by it); its return code and output. When the
    lab is interrupted meanwhile, or ``timeout`` passes, its whole process group is stopped."""
    # Output goes to a file, not a pipe: the run is over when ansible-playbook exits, even where a
    # process it left behind (a server, an SSH connection) still holds its stdout.
    with tempfile.TemporaryFile(mode="w+", prefix="vllm-lab-ansible-") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except BaseException:  # KeyboardInterrupt (a stop signal) or the timeout
            _kill_group(proc)
            # What it printed says which task it was in: a hung playbook's only trace.
            log.warning("%s stopped before it finished; its last lines:\n%s", label,
                        "\n".join(_read_all(out).splitlines()[-15:]))
            raise
        return proc.returncode, _read_all(out)


def _read_all(fh) -> str:
    fh.seek(0)
    return fh.read()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group we started, SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def _unreachable_reasons(stdout: str) -> dict[str, str]:
    """Host -> why it could not be reached, from each ``fatal: [h]: UNREACHABLE! =>`` result (JSON on
    its line, or the YAML block below it with ansible.cfg's callback_result_format), and each
    FAILED one that says the connection was lost."""
    lines = stdout.splitlines()
    reasons: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = _UNREACHABLE.match(line)
        if not m:
            continue
        body = m.group(3).strip()
        if not body:
            block = []
            for nxt in lines[i + 1:]:
                if nxt and not nxt[0].isspace():
                    break
                block.append(nxt)
            body = "\n".join(block)
        try:
            result = yaml.safe_load(body)
        except yaml.YAMLError:
            result = None
        why = result.get("msg") if isinstance(result, dict) else None
        # A loop (the claim, each playbook's first task) says "All items completed": the
        # connection's own reason is in its first item.
        items = result.get("results") if isinstance(result, dict) else None
        if isinstance(items, list):
            why = next((r["msg"] for r in items if isinstance(r, dict) and r.get("msg")), why)
        if m.group(2) == "FAILED" and _LOST_CONNECTION not in str(why):
            continue
        reasons[m.group(1)] = " ".join(str(why or body).split())[:500]
    return reasons


def _ansible_playbook() -> str:
    beside = Path(sys.executable).parent / "ansible-playbook"
    return str(beside) if beside.exists() else "ansible-playbook"


def _split_secrets(serve_flags: dict, extra_vars: dict) -> tuple[dict, dict]:
    flags, role_vars = {}, dict(extra_vars)
    for key, value in serve_flags.items():
        spelled = key.replace("_", "-")
        if spelled in SECRET_FLAGS:
            role_vars[SECRET_FLAGS[spelled]] = value
        else:
            flags[spelled] = value
    return flags, role_vars


def _claiming(playbook: str, *, inventory: Path, role_vars: dict, limit: str | None,
              secrets: list[str] | tuple[str, ...] = (), timeout: float | None = None,
              experiment: str = "") -> tuple[PlaybookRun, dict[str, dict], dict[str, str]]:
    """Run a playbook that claims the instances first: its recap, each host's outcome file and
    the API key each host's servers got (a 0600 file in a folder gone when this returns: the load
    generator sends the same key, wherever the role found it).

    A lock whose lab process ran on this node and is gone is taken over (one more run naming it:
    the host cannot check a pid of this node); a live holder raises InstanceBusy.
    """
    takeover: list[str] = []
    while True:
        with tempfile.TemporaryDirectory(prefix="vllm-lab-serve-") as results:
            extra = {**role_vars, "vllm_result_dir": results, "vllm_lock_owner": lab_owner(experiment),
                     "vllm_lock_takeover": takeover}
            run = run_playbook(playbook, inventory=inventory, extra_vars=extra, limit=limit,
                               secrets=secrets, timeout=timeout)
            outcomes = {p.stem: json.loads(p.read_text()) for p in Path(results).glob("*.json")}
            keys = {p.stem: p.read_text().strip() for p in Path(results).glob("*.key")}
        busy = {h: o["busy"] for h, o in outcomes.items() if o.get("busy")}
        dead = sorted({_owner_token(b["holder"]) for bs in busy.values() for b in bs
                       if _dead_here(b.get("holder", {}))} - set(takeover))
        if busy and dead and not takeover:
            log.warning("serving: taking over locks of lab processes that are gone: %s", ", ".join(dead))
            takeover = dead
            continue
        if busy:
            raise InstanceBusy(inventory, busy)
        return run, outcomes, keys


def start(serve_flags: dict[str, Any], *, inventory: Path = DEFAULT_INVENTORY, backend: str = "twin",
          limit: str | None = None, twin_profile: str | None = None,
          extra_vars: dict | None = None, timeout: float | None = None,
          experiment: str = "") -> Instances:
    """Serve ``serve_flags`` on every host of ``inventory`` (or ``limit``) and wait until /health answers.

    Returns the healthy instances; hosts that could not be reached are in ``.unreachable`` and
    logged. Raises ServeError (cause oom | refused-flag | start-timeout | crashed, or unreachable
    when no host answered) when a reached host's server did not come up, and InstanceBusy when
    another live lab process holds an instance (``experiment`` names this one in the lock).
    """
    if backend not in ("twin", "vllm"):
        raise ValueError(f"backend must be 'twin' or 'vllm', not {backend!r}")
    flags, role_vars = _split_secrets(serve_flags, extra_vars or {})
    secrets = [str(role_vars[v]) for v in SECRET_FLAGS.values() if role_vars.get(v)]
    secrets += [os.environ[e] for e in ("VLLM_API_KEY", "HF_TOKEN") if os.environ.get(e)]
    role_vars.update(vllm_backend=backend, vllm_flags=flags)
    if twin_profile:
        role_vars["vllm_twin_profile"] = twin_profile
    run, outcomes, keys = _claiming("serve.yml", inventory=Path(inventory), role_vars=role_vars,
                                    limit=limit, secrets=secrets, timeout=timeout,
                                    experiment=experiment)
    healthy, failures = [], []
    for host, outcome in sorted(outcomes.items()):
        for inst in outcome["instances"]:
            if inst["status"] == "healthy":
                healthy.append(Instance(host=host, url=inst["url"], port=int(inst["port"]),
                                        log_path=inst["log_path"], name=inst["name"],
                                        gpus=inst.get("gpus", ""), api_key=keys.get(host, "")))
            else:
                failures.append({**inst, "log_tail": scrub(inst.get("log_tail", ""), secrets)})
    for host, why in run.unreachable.items():
        log.warning("serving: host %s unreachable, the others go on: %s", host, why)
    if failures:
        first = failures[0]
        raise ServeError(first["cause"], first["log_tail"], host=first["host"], failures=failures,
                         instances=healthy)
    # A reached host that failed before the wait (preflight, missing executable) wrote no outcome.
    missing = sorted(h for h, c in run.recap.items()
                     if c.get("failed") and h not in outcomes and h not in run.unreachable)
    if missing:
        # An assert that failed before the start (preflight) refused the configuration.
        cause = "refused-config" if _ASSERT_FAILED.search(run.stdout) else "crashed"
        raise ServeError(cause, _play_failure(run.stdout), host=missing[0], instances=healthy)
    if not healthy and run.unreachable:
        # Why ssh (or the connection) failed, per host: the run's recorded reason.
        raise ServeError("unreachable", "\n".join(f"{h}: {why}" for h, why in run.unreachable.items()),
                         host=next(iter(run.unreachable)), instances=[])
    if not healthy:
        raise ServeError("crashed", _play_failure(run.stdout), instances=[])
    return Instances(healthy, unreachable=run.unreachable)


def _play_failure(stdout: str) -> str:
    """A failed play's messages: each fatal or failed result with the indented lines that carry it
    (the YAML callback wraps a long message over several), and any other line with a msg."""
    lines, inside = [], False
    for ln in stdout.splitlines():
        inside = ln.startswith(("fatal:", "failed:", "[ERROR]:")) or (inside and ln.startswith(" "))
        if inside or "msg" in ln:
            lines.append(ln)
    return "\n".join(lines[-40:]) or "\n".join(stdout.splitlines()[-40:])


def stop(inventory: Path = DEFAULT_INVENTORY, limit: str | None = None, *,
         extra_vars: dict | None = None, timeout: float | None = None,
         experiment: str = "", release: bool = True) -> PlaybookRun:
    """Stop every instance on the inventory's hosts (whole process groups) and check the GPUs are free.

    Instances another live lab process holds are left alone; with ``release`` this process's locks
    are dropped (a restart between serve groups keeps them). Unreachable hosts are logged and left
    out; a reached host that fails the stop raises RuntimeError.
    """
    vars_ = {**(extra_vars or {}), "vllm_lock_owner": lab_owner(experiment), "vllm_lock_release": release}
    run = run_playbook("stop.yml", inventory=Path(inventory), extra_vars=vars_, limit=limit,
                       timeout=timeout)
    for host, why in run.unreachable.items():
        log.warning("serving: host %s unreachable during stop: %s", host, why)
    failed = [h for h, c in run.recap.items() if c.get("failed") and h not in run.unreachable]
    if failed:
        raise RuntimeError(f"stop failed on {', '.join(failed)}:\n{_play_failure(run.stdout)}")
    return run


def provision(inventory: Path = DEFAULT_INVENTORY, limit: str | None = None, *,
              extra_vars: dict | None = None, timeout: float | None = None,
              experiment: str = "") -> PlaybookRun:
    """Claim the instances, then run provision.yml (idempotent: a provisioned host reports no change).

    Raises InstanceBusy before anything is installed when another live lab process holds an
    instance (its venv stays as it is), RuntimeError on a failure.
    """
    run, _, _ = _claiming("provision.yml", inventory=Path(inventory), role_vars=extra_vars or {},
                       limit=limit, timeout=timeout, experiment=experiment)
    return _checked(run, "provision")


def _checked(run: PlaybookRun, action: str) -> PlaybookRun:
    """A provision or teardown run as it ended: unreachable hosts logged and left out, a reached
    host's failure (or a failed run no host explains) raised as RuntimeError."""
    for host, why in run.unreachable.items():
        log.warning("serving: host %s unreachable during %s: %s", host, action, why)
    failed = [h for h, c in run.recap.items() if c.get("failed") and h not in run.unreachable]
    if failed or (run.returncode and not run.unreachable):
        raise RuntimeError(f"{action} failed on {', '.join(failed) or 'the inventory'}:\n"
                           f"{_play_failure(run.stdout)}")
    return run


def teardown(inventory: Path = DEFAULT_INVENTORY, limit: str | None = None, *,
             timeout: float | None = None, experiment: str = "") -> PlaybookRun:
    """Claim the instances, then run teardown.yml: stop them and remove what serve.yml and
    provision.yml put on the hosts (a venv only when provision.yml made it).

    Raises InstanceBusy before anything is removed when another live lab process holds an
    instance, RuntimeError on a failure.
    """
    run, _, _ = _claiming("teardown.yml", inventory=Path(inventory), role_vars={}, limit=limit,
                          timeout=timeout, experiment=experiment)
    return _checked(run, "teardown")


def check_inventory(inventory: Path = DEFAULT_INVENTORY, group: str = "vllm_servers") -> list[str]:
    """The hosts of the inventory's serving group, in inventory order; InventoryError, one sentence
    naming the file and what is wrong, when it is missing, malformed or has no such group."""
    path = Path(inventory)
    if not path.exists():
        raise InventoryError(f"{path}: no such inventory file (INVENTORY=path/to/inventory.yml)")
    if not path.is_dir() and path.suffix not in (".yml", ".yaml"):
        try:  # an INI inventory, Ansible's to read: only a regular file of a sane size
            read_bytes(path, what="inventory file")
        except InputError as e:
            raise InventoryError(str(e)) from None
    if not path.is_dir() and path.suffix in (".yml", ".yaml"):
        try:
            data = load_yaml(read_text(path, what="inventory file"), str(path))
        except InputError as e:
            raise InventoryError(str(e)) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise InventoryError(f"{path}: not valid YAML{where} "
                                 f"({getattr(e, 'problem', None) or 'cannot be parsed'})") from None
        except OSError as e:
            raise InventoryError(f"{path}: cannot be read ({e.strerror})") from None
        if not isinstance(data, dict):
            raise InventoryError(f"{path}: not an Ansible inventory (its top level must map group names, "
                                 f"e.g. all:, to their hosts)")
    data = _listed(path)
    hosts = list(data.get(group, {}).get("hosts", []))
    for child in data.get(group, {}).get("children", []):
        hosts += [h for h in data.get(child, {}).get("hosts", []) if h not in hosts]
    if not hosts:
        groups = [g for g in data if g not in ("_meta", "all", "ungrouped")]
        raise InventoryError(f"{path}: no host in group {group} (the hosts that serve); its groups: "
                             f"{', '.join(groups) or 'none'}")
    return hosts


# ansible-inventory's answer per version of a file: a command asks for it twice (~0.35 s each).
_LISTED: dict[tuple, dict] = {}


def _listed(path: Path) -> dict:
    """``ansible-inventory --list`` of ``path``, read once per version of a regular file."""
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size) if path.is_file() else None
    if key in _LISTED:
        return _LISTED[key]
    exe = str(Path(_ansible_playbook()).with_name("ansible-inventory"))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO_ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_INVENTORY_UNPARSED_FAILED="1")
    out = subprocess.run([exe, "-i", str(path), "--list"], capture_output=True, text=True, check=False,
                         env=env)
    if out.returncode:
        lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Failed to parse" in ln or "error" in ln.lower()),
                   lines[-1] if lines else "ansible-inventory failed")
        raise InventoryError(f"{path}: Ansible cannot read it as an inventory ({why[:300]})")
    data = json.loads(out.stdout)
    if key:
        _LISTED[key] = data
    return data


def serve_hosts(inventory: Path = DEFAULT_INVENTORY, group: str = "vllm_servers") -> list[str]:
    """The hosts of the inventory's serving group, in inventory order (InventoryError when none)."""
    return check_inventory(inventory, group)
