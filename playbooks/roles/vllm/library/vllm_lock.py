#!/usr/bin/python
"""Ansible module: which lab process owns one instance of a host (a lock file beside its pid file)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_lock
short_description: Claim, check or release one vLLM instance for one lab process
description:
  - Two lab processes that serve the same instance of a host share its pid file and port, and each
    would stop or restart the other's server. Before it touches an instance a lab process claims it:
    the lock file (JSON: experiment, lab pid and its start time, control node, since when) names its
    owner for as long as that process lives, across the server restarts of a sweep.
  - A lock file, not a held flock, because the lab process lives on the control node while this module
    runs (briefly) on the host; flock only serializes the read-compare-write of the file.
  - A lock whose owner is gone is taken over; its pid can only be checked where it ran, so here when
    the owner ran on this machine, else when the caller names it in takeover (it checked on its node).
  - Without an owner (ansible-playbook run by hand) the lock is neither checked nor taken.
options:
  path: {description: The lock file., type: path, required: true}
  state:
    description: claimed (take it or keep it), released (drop it if ours) or status (who holds it).
    type: str
    choices: [claimed, released, status]
    default: claimed
  owner:
    description: "The lab process: experiment, pid, pid_start (/proc start time), node (control node hostname)."
    type: dict
    default: {}
  takeover:
    description: Owners ("node:pid:pid_start") the caller found dead on their node; their locks may be taken.
    type: list
    elements: str
    default: []
"""

RETURN = r"""
status: {description: "claimed, busy (a live other owner holds it), released, free or held (state=status).", type: str}
holder: {description: The owner in the lock file before this call ({} when none)., type: dict}
took_over: {description: The dead owner whose lock was taken ({} when none)., type: dict}
"""

import fcntl
import json
import os
import socket
import time

from ansible.module_utils.basic import AnsibleModule


def _token(owner):
    return f"{owner.get('node', '')}:{owner.get('pid', '')}:{owner.get('pid_start', '')}"


def _same(a, b):
    return bool(a) and bool(b) and _token(a) == _token(b)


def _alive_here(pid, pid_start):
    """Whether ``pid`` runs on this machine and is the process that wrote the lock (not a reuse)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as fh:
            raw = fh.read()
    except (OSError, ValueError):
        return False
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0] != "Z" and (not pid_start or fields[19] == str(pid_start))


def _dead(holder, takeover):
    if _token(holder) in takeover:
        return True
    return holder.get("node") == socket.gethostname() and not _alive_here(holder.get("pid"), holder.get("pid_start"))


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {"type": "str", "default": "claimed", "choices": ["claimed", "released", "status"]},
            "owner": {"type": "dict", "default": {}},
            "takeover": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    p = module.params
    owner = {k: v for k, v in (p["owner"] or {}).items() if v not in (None, "")}
    if p["state"] != "status" and not owner.get("pid"):
        module.exit_json(changed=False, status="free", holder={}, took_over={})
    if p["state"] != "claimed" and not os.path.exists(p["path"]):
        module.exit_json(changed=False, status="free", holder={}, took_over={})
    os.makedirs(os.path.dirname(p["path"]), exist_ok=True)
    fd = os.open(p["path"], os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # two claimers read-compare-write one at a time
        try:
            holder = json.loads(fh.read() or "{}")
        except ValueError:
            holder = {}  # a torn or foreign file holds nothing
        holder = holder if isinstance(holder, dict) and holder.get("pid") else {}
        ours = _same(holder, owner)
        stale = bool(holder) and not ours and _dead(holder, p["takeover"])
        if p["state"] == "status":
            held = bool(holder) and not ours and not stale
            module.exit_json(changed=False, status="busy" if held and owner else ("held" if held else "free"),
                             holder=holder, took_over={})
        if p["state"] == "released":
            if not ours:
                module.exit_json(changed=False, status="free" if not holder else "busy", holder=holder,
                                 took_over={})
            if not module.check_mode:
                fh.seek(0)
                fh.truncate()
            module.exit_json(changed=True, status="released", holder=holder, took_over={})
        if holder and not ours and not stale:
            module.exit_json(changed=False, status="busy", holder=holder, took_over={})
        record = dict(owner)
        if ours and not record.get("experiment") and holder.get("experiment"):
            record["experiment"] = holder["experiment"]  # a later call of the same process keeps it
        record["since"] = holder.get("since") if ours else time.strftime("%Y-%m-%d %H:%M:%S")
        changed = record != holder
        if changed and not module.check_mode:
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        module.exit_json(changed=changed, status="claimed", holder=holder,
                         took_over=holder if stale else {})


if __name__ == "__main__":
    main()
