#!/usr/bin/python
"""Ansible module: one vLLM (or twin) instance as a supervised process group, without systemd."""

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_process
short_description: Run one vLLM or twin instance as a supervised process group
description:
  - Starts a command in its own session (setsid), records "pid starttime" in a pid file and sends
    its output to a log file; stops the whole process group and session (vLLM's EngineCore and
    workers outlive the API server, vllm issue 55510); waits for an HTTP health URL.
  - Used where systemd is not PID 1 (containers).
options:
  name: {description: Instance name, for messages., type: str, required: true}
  state:
    description: started, stopped, ready (wait for the health URL) or status.
    type: str
    choices: [started, stopped, ready, status]
    default: started
  argv: {description: Command to run., type: list, elements: str}
  env_file: {description: KEY=VALUE file merged into the environment (may hold secrets)., type: path}
  pid_file: {description: Where the group leader's pid and start time are kept., type: path, required: true}
  log_file: {description: Where stdout and stderr go; the previous log is kept as .prev., type: path}
  cwd: {description: Working directory., type: path}
  health_url: {description: URL that answers 200 once the instance is ready., type: str}
  unit: {description: A systemd unit to watch instead of the pid file (state=ready)., type: str}
  timeout_s: {description: How long state=ready waits., type: float, default: 60}
  stop_timeout_s: {description: Seconds between SIGTERM and SIGKILL., type: float, default: 30}
  log_tail_lines: {description: Lines of log returned as log_tail., type: int, default: 80}
"""

RETURN = r"""
status:
  description: "state=ready: healthy, exited, failed (alive, but its log shows a fatal engine error) or timeout; state=status: running or stopped"
  type: str
pids: {description: Processes of the group/session (before a stop)., type: list}
log_tail: {description: Last lines of the log (state=ready when not healthy)., type: str}
"""

import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule


def _stat(pid):
    """(state, pgrp, session, starttime) of a pid from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[2]), int(fields[3]), fields[19]


def _read_pid_file(path):
    try:
        with open(path, encoding="utf-8") as fh:
            parts = fh.read().split()
        return int(parts[0]), (parts[1] if len(parts) > 1 else None)
    except (OSError, ValueError, IndexError):
        return None, None


def _leader_alive(pid, starttime):
    st = _stat(pid) if pid else None
    # A zombie has exited; a different start time means the pid was reused.
    return bool(st) and st[0] != "Z" and (starttime is None or st[3] == starttime)


def _members(leader):
    """Live processes in the leader's process group or session (the whole vLLM tree)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st and st[0] != "Z" and (st[1] == leader or st[2] == leader):
            found.append(int(entry))
    return sorted(found)


def _signal_all(leader, pids, sig):
    try:
        os.killpg(leader, sig)
    except OSError:
        pass
    for pid in pids:  # members that left the group but stayed in the session
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _wait_gone(leader, timeout):
    began = time.monotonic()
    while True:
        left = _members(leader)
        if not left or time.monotonic() >= began + timeout:
            return left
        # Often in the first second: a server that heeds SIGTERM (the twin) is gone within it.
        time.sleep(0.05 if time.monotonic() - began < 1 else 0.2)


def _read_env(path):
    env = {}
    if not path:
        return env
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, value = line.split("=", 1)
            parsed = shlex.split(value) if value else [""]
            env[key.strip()] = parsed[0] if parsed else ""
    return env


def _tail(path, lines):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            data = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


# Lines vLLM writes when its engine cannot come up, even where the process does not exit.
FATAL_MARKERS = (b"WorkerProc hit an exception", b"Engine core initialization failed",
                 b"CUDA error: an illegal memory access")


class _LogWatch:
    """Reads what a log gained since the last look and remembers whether a fatal marker passed."""

    def __init__(self, path):
        self.path, self.offset, self.carry = path, 0, b""

    def fatal(self):
        if not self.path:
            return False
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return False
        self.offset += len(data)
        text = self.carry + data
        self.carry = text[-256:]  # a marker split across two reads
        return any(m in text for m in FATAL_MARKERS)


def _poll_interval(waited):
    """Seconds until the next look: often while a start is young (a twin answers in about a second)."""
    return 0.1 if waited < 5 else 0.5


def _healthy(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _unit_alive(module, unit):
    rc, out, _ = module.run_command(["systemctl", "show", "-p", "ActiveState", "--value", unit])
    return rc == 0 and out.strip() in ("active", "activating", "reloading")


def _start(module, p):
    os.makedirs(os.path.dirname(p["pid_file"]), exist_ok=True)
    if p["log_file"]:
        os.makedirs(os.path.dirname(p["log_file"]), exist_ok=True)
        if os.path.exists(p["log_file"]):
            os.replace(p["log_file"], p["log_file"] + ".prev")
    env = dict(os.environ)
    env.update(_read_env(p["env_file"]))
    log = open(p["log_file"] or os.devnull, "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            p["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            cwd=p["cwd"] or None, env=env, start_new_session=True, close_fds=True)
    except OSError as exc:
        module.fail_json(msg=f"{p['name']}: cannot start {p['argv'][0]}: {exc}")
    finally:
        log.close()
    st = _stat(proc.pid)
    with open(p["pid_file"], "w", encoding="utf-8") as fh:
        fh.write(f"{proc.pid} {st[3] if st else ''}\n")
    return proc.pid


def _stop(module, p, leader, starttime):
    if not _leader_alive(leader, starttime):
        left = _members(leader) if leader else []
    else:
        left = _members(leader)
    pids = list(left)
    if not left:
        return pids, False
    if module.check_mode:
        return pids, True
    _signal_all(leader, left, signal.SIGTERM)
    left = _wait_gone(leader, p["stop_timeout_s"])
    if left:
        _signal_all(leader, left, signal.SIGKILL)
        left = _wait_gone(leader, 10)
    if left:
        module.fail_json(msg=f"{p['name']}: processes {left} survived SIGKILL", pids=pids)
    return pids, True


def main():
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "state": {"type": "str", "default": "started",
                      "choices": ["started", "stopped", "ready", "status"]},
            "argv": {"type": "list", "elements": "str"},
            "env_file": {"type": "path"},
            "pid_file": {"type": "path", "required": True},
            "log_file": {"type": "path"},
            "cwd": {"type": "path"},
            "health_url": {"type": "str"},
            "unit": {"type": "str"},
            "timeout_s": {"type": "float", "default": 60.0},
            "stop_timeout_s": {"type": "float", "default": 30.0},
            "log_tail_lines": {"type": "int", "default": 80},
        },
        required_if=[("state", "started", ["argv"]), ("state", "ready", ["health_url"])],
        supports_check_mode=True,
    )
    p = module.params
    leader, starttime = _read_pid_file(p["pid_file"])
    alive = _leader_alive(leader, starttime)

    if p["state"] == "status":
        module.exit_json(changed=False, status="running" if alive else "stopped",
                         pids=_members(leader) if leader else [])

    if p["state"] == "ready":
        began = time.monotonic()
        deadline = began + p["timeout_s"]
        log = _LogWatch(p["log_file"])
        while True:
            if _healthy(p["health_url"]):
                module.exit_json(changed=False, status="healthy", pids=_members(leader) if leader else [])
            running = _unit_alive(module, p["unit"]) if p["unit"] else alive
            if not running:
                status = "exited"
                break
            if log.fatal():
                status = "failed"
                break
            if time.monotonic() >= deadline:
                status = "timeout"
                break
            time.sleep(_poll_interval(time.monotonic() - began))
            if not p["unit"]:
                alive = _leader_alive(leader, starttime)
        module.exit_json(changed=False, status=status,
                         log_tail=_tail(p["log_file"], p["log_tail_lines"]) if p["log_file"] else "")

    if p["state"] == "stopped":
        pids, changed = _stop(module, p, leader, starttime)
        if changed and not module.check_mode:
            try:
                os.remove(p["pid_file"])
            except OSError:
                pass
        module.exit_json(changed=changed, pids=pids, status="stopped")

    # state == started
    if alive:
        module.exit_json(changed=False, pids=_members(leader), status="running")
    if module.check_mode:
        module.exit_json(changed=True, pids=[])
    # Leftovers of a crashed instance (workers whose leader died) would hold the GPU and the port.
    if leader:
        _stop(module, p, leader, None)
    new = _start(module, p)
    module.exit_json(changed=True, pids=[new], status="running")


if __name__ == "__main__":
    main()
