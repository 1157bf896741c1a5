"""Start and stop vLLM (or the twin) on an inventory's hosts through the lab's playbooks.

Playbooks are the only way the lab touches hosts: ``start`` runs ``playbooks/serve.yml`` and
``stop`` runs ``playbooks/stop.yml`` with ``ansible-playbook`` as a subprocess. Variables travel in
a temporary JSON file (``-e @file``, mode 0600), never on the command line, so a secret never shows
in ``ps``. Each host's outcome comes back as a small JSON file the playbook writes on the control
node; the play recap says which hosts were unreachable, so one dead host of a fleet is reported
while the others serve.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    """The log line that says the GPU ran out of memory, if one does."""
    return next((ln.strip() for ln in log_tail.splitlines() if _OOM.search(ln)), None)


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
_RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")
_UNREACHABLE = re.compile(r"^fatal: \[([^\]]+)\]: UNREACHABLE! => (.*)$")


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
                   ANSIBLE_RETRY_FILES_ENABLED="0", PYTHONUNBUFFERED="1")
        log.debug("running %s", " ".join(cmd))
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)
    out = scrub(proc.stdout, secrets)
    unreachable = {m.group(1): m.group(2)[:500] for m in map(_UNREACHABLE.match, out.splitlines()) if m}
    recap = parse_recap(out)
    for host, counts in recap.items():
        if counts.get("unreachable") and host not in unreachable:
            unreachable[host] = "unreachable"
    return PlaybookRun(proc.returncode, out, recap, unreachable)


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


def start(serve_flags: dict[str, Any], *, inventory: Path = DEFAULT_INVENTORY, backend: str = "twin",
          limit: str | None = None, twin_profile: str | None = None,
          extra_vars: dict | None = None, timeout: float | None = None) -> Instances:
    """Serve ``serve_flags`` on every host of ``inventory`` (or ``limit``) and wait until /health answers.

    Returns the healthy instances; hosts that could not be reached are in ``.unreachable`` and
    logged. Raises ServeError (cause oom | refused-flag | start-timeout | crashed) when a reached
    host's server did not come up, or when no host could be reached at all.
    """
    if backend not in ("twin", "vllm"):
        raise ValueError(f"backend must be 'twin' or 'vllm', not {backend!r}")
    flags, role_vars = _split_secrets(serve_flags, extra_vars or {})
    secrets = [str(role_vars[v]) for v in SECRET_FLAGS.values() if role_vars.get(v)]
    secrets += [os.environ[e] for e in ("VLLM_API_KEY", "HF_TOKEN") if os.environ.get(e)]
    with tempfile.TemporaryDirectory(prefix="vllm-lab-serve-") as results:
        role_vars.update(vllm_backend=backend, vllm_flags=flags, vllm_result_dir=results)
        if twin_profile:
            role_vars["vllm_twin_profile"] = twin_profile
        run = run_playbook("serve.yml", inventory=Path(inventory), extra_vars=role_vars, limit=limit,
                           secrets=secrets, timeout=timeout)
        outcomes = {p.stem: json.loads(p.read_text()) for p in Path(results).glob("*.json")}
        # The key each host's servers got (0600, in this folder, gone when it is): the load
        # generator sends the same, wherever the role found it.
        keys = {p.stem: p.read_text().strip() for p in Path(results).glob("*.key")}
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
    if not healthy:
        cause = "unreachable" if run.unreachable else "crashed"
        raise ServeError(cause, _play_failure(run.stdout), instances=[])
    return Instances(healthy, unreachable=run.unreachable)


def _play_failure(stdout: str) -> str:
    lines = [ln for ln in stdout.splitlines()
             if ln.startswith(("fatal:", "failed:", "[ERROR]:")) or "msg" in ln]
    return "\n".join(lines[-20:]) or "\n".join(stdout.splitlines()[-40:])


def stop(inventory: Path = DEFAULT_INVENTORY, limit: str | None = None, *,
         extra_vars: dict | None = None, timeout: float | None = None) -> PlaybookRun:
    """Stop every instance on the inventory's hosts (whole process groups) and check the GPUs are free.

    Unreachable hosts are logged and left out; a reached host that fails the stop raises RuntimeError.
    """
    run = run_playbook("stop.yml", inventory=Path(inventory), extra_vars=extra_vars or {}, limit=limit,
                       timeout=timeout)
    for host, why in run.unreachable.items():
        log.warning("serving: host %s unreachable during stop: %s", host, why)
    failed = [h for h, c in run.recap.items() if c.get("failed")]
    if failed:
        raise RuntimeError(f"stop failed on {', '.join(failed)}:\n{_play_failure(run.stdout)}")
    return run


def provision(inventory: Path = DEFAULT_INVENTORY, limit: str | None = None, *,
              extra_vars: dict | None = None, timeout: float | None = None) -> PlaybookRun:
    """Run provision.yml (idempotent: a provisioned host reports no change); raise on failure."""
    run = run_playbook("provision.yml", inventory=Path(inventory), extra_vars=extra_vars or {},
                       limit=limit, timeout=timeout)
    for host, why in run.unreachable.items():
        log.warning("serving: host %s unreachable during provision: %s", host, why)
    failed = [h for h, c in run.recap.items() if c.get("failed")]
    if failed or (run.returncode and not run.unreachable):
        raise RuntimeError(f"provision failed on {', '.join(failed) or 'the inventory'}:\n"
                           f"{_play_failure(run.stdout)}")
    return run


def serve_hosts(inventory: Path = DEFAULT_INVENTORY, group: str = "vllm_servers") -> list[str]:
    """The hosts of the inventory's serving group, in inventory order."""
    exe = str(Path(_ansible_playbook()).with_name("ansible-inventory"))
    out = subprocess.run([exe, "-i", str(inventory), "--list"], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"{inventory}: ansible-inventory failed: {out.stderr.strip()[-500:]}")
    data = json.loads(out.stdout)
    hosts = list(data.get(group, {}).get("hosts", []))
    for child in data.get(group, {}).get("children", []):
        hosts += [h for h in data.get(child, {}).get("hosts", []) if h not in hosts]
    if not hosts:
        raise RuntimeError(f"{inventory}: no hosts in group {group}")
    return hosts
