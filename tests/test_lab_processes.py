"""Lab processes side by side and inventories that cannot serve: the lock on each instance (vllm_lock),
two lab processes on one host, a dead holder's lock taken over, and missing, malformed or unreachable
inventories refused or recorded as such, with SPREAD=1 too.

Design: a second lab process that wants a busy instance is refused with the holder's experiment and
pid (not moved to a free port): on a GPU host an instance is its GPUs, and two servers on one GPU
(or two twins on two shared cores) would measure each other.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.processes import free_port, private_inventory
from vllm_lab import serving
from vllm_lab.store import Store

REPO = Path(__file__).resolve().parent.parent
LOCK_MODULE = REPO / "playbooks/roles/vllm/library/vllm_lock.py"
SETS = ["load.stop.duration_s=3", "workload.source=alpaca-like", "run.warmup_requests=1",
        "load.shape.level=2"]


def lab_cmd(inventory: Path, out: Path, *args: str) -> list[str]:
    # The scenario's own max-num-seqs is the first value swept: the sweep's reference point (the
    # scenario's flags) is then one of its points, and no other joins the runs counted here.
    first = args[args.index("--values") + 1].split(",")[0] if "--values" in args else None
    sets = [x for s in SETS + ([f"serve.max-num-seqs={first}"] if first else [])
            for x in ("--set", s)]
    return [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", "max-num-seqs",
            "--hardware", "cpu-demo", "--inventory", str(inventory), "--out", str(out), *sets, *args]


def run_lab(*cmd: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          check=False, env=dict(os.environ, PYTHONPATH=str(REPO)))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# --- the lock module itself ----------------------------------------------------------------------
def lock(path: Path, state: str = "claimed", owner: dict | None = None, takeover=()) -> dict:
    """Run vllm_lock the way Ansible does (an args file), return its JSON result."""
    args = path.parent.parent / "lock-args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {
        "path": str(path), "state": state, "owner": owner or {}, "takeover": list(takeover)}}))
    out = subprocess.run([sys.executable, str(LOCK_MODULE), str(args)], capture_output=True, text=True,
                         check=False)
    return json.loads(out.stdout)


@pytest.mark.integration
def test_lock_claim_busy_takeover_release(tmp_path):
    path = tmp_path / "run" / "main.lock"
    me = serving.lab_owner("exp-a")
    other = {**serving.lab_owner("exp-b"), "pid": os.getppid(),
             "pid_start": serving._start_time(os.getppid())}
    # No owner (a hand-run playbook): nothing checked, nothing written.
    assert lock(path, owner={})["status"] == "free" and not path.exists()
    first = lock(path, owner=me)
    assert first["status"] == "claimed" and first["changed"]
    assert json.loads(path.read_text())["experiment"] == "exp-a"
    # The same process again (a later serve.yml, without the experiment): no change, experiment kept.
    again = lock(path, owner={**me, "experiment": ""})
    assert again["status"] == "claimed" and not again["changed"]
    assert json.loads(path.read_text())["experiment"] == "exp-a"
    # Another live process is refused with who holds it, and cannot release it.
    refused = lock(path, owner=other)
    assert refused["status"] == "busy" and refused["holder"]["pid"] == os.getpid()
    assert refused["holder"]["experiment"] == "exp-a"
    assert lock(path, state="released", owner=other)["status"] == "busy"
    assert lock(path, state="status", owner=other)["status"] == "busy"
    assert lock(path, state="released", owner=me)["status"] == "released"
    assert lock(path, state="status", owner=other)["status"] == "free"


@pytest.mark.integration
def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    path = tmp_path / "main.lock"
    gone = {"experiment": "crashed-sweep", "pid": dead_pid(), "pid_start": "1", "node": socket.gethostname()}
    path.write_text(json.dumps(gone))
    took = lock(path, owner=serving.lab_owner("next"))
    assert took["status"] == "claimed" and took["took_over"]["experiment"] == "crashed-sweep"
    assert json.loads(path.read_text())["pid"] == os.getpid()
    # A pid reused by another process (a different start time) is not the holder either.
    path.write_text(json.dumps({**gone, "pid": os.getppid(), "pid_start": "1"}))
    assert lock(path, owner=serving.lab_owner("next"))["status"] == "claimed"
    # Another node's holder cannot be checked here: busy, unless the caller names it dead.
    remote = {**gone, "node": "laptop-elsewhere"}
    path.write_text(json.dumps(remote))
    assert lock(path, owner=serving.lab_owner("next"))["status"] == "busy"
    token = f"laptop-elsewhere:{remote['pid']}:1"
    assert lock(path, owner=serving.lab_owner("next"), takeover=[token])["status"] == "claimed"


@pytest.mark.integration
def test_serving_takes_over_a_lock_its_node_finds_dead(tmp_path, monkeypatch):
    """A remote host cannot check a pid of this node: serving checks it and runs once more naming it."""
    gone = {"experiment": "old", "pid": dead_pid(), "pid_start": "1", "node": socket.gethostname()}
    alive = {**gone, "pid": os.getppid(), "pid_start": serving._start_time(os.getppid())}
    calls = []

    def fake_run(playbook, *, inventory, extra_vars, limit=None, secrets=(), timeout=None):
        calls.append(extra_vars["vllm_lock_takeover"])
        holder = holders.pop(0)
        if holder:
            Path(extra_vars["vllm_result_dir"], "gpu-1.json").write_text(json.dumps(
                {"host": "gpu-1", "busy": [{"name": "main", "port": 8000, "holder": holder}]}))
        return serving.PlaybookRun(0, "", {"gpu-1": {"ok": 1}}, {})

    monkeypatch.setattr(serving, "run_playbook", fake_run)
    holders = [gone, None]
    serving.provision(tmp_path / "inv.yml", experiment="new")
    assert calls == [[], [f"{gone['node']}:{gone['pid']}:1"]]
    holders, calls[:] = [alive], []
    with pytest.raises(serving.InstanceBusy, match=rf"experiment old \(lab pid {alive['pid']} on "):
        serving.provision(tmp_path / "inv.yml", experiment="new")
    assert calls == [[]]


# --- inventories that cannot serve ----------------------------------------------------------------
BAD_INVENTORIES = {
    "missing": (None, "no such inventory file"),
    "malformed": ("all:\n  children: [vllm_servers\n", "not valid YAML at line"),
    "a-list": ("- localhost\n", "not an Ansible inventory"),
    "no-group": ("all:\n  children:\n    gpus:\n      hosts:\n        gpu-1: {}\n", "no host in group vllm_servers"),
    "empty-group": ("all:\n  children:\n    vllm_servers: {}\n", "no host in group vllm_servers"),
    "bad-structure": ("all:\n  hosts: [gpu-1, gpu-2]\n", "Ansible cannot read it"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", BAD_INVENTORIES)
def test_bad_inventory_is_one_sentence_naming_the_file(tmp_path, case):
    text, why = BAD_INVENTORIES[case]
    path = tmp_path / f"{case}.yml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(serving.InventoryError) as err:
        serving.check_inventory(path)
    assert str(err.value).startswith(f"{path}: ") and why in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.integration
@pytest.mark.parametrize("spread", [False, True], ids=["one-host", "spread"])
@pytest.mark.parametrize("case", ["missing", "malformed", "no-group"])
def test_lab_refuses_a_bad_inventory_before_anything_runs(tmp_path, case, spread):
    text, why = BAD_INVENTORIES[case]
    path = tmp_path / "inv.yml"
    if text is not None:
        path.write_text(text)
    out = run_lab(*lab_cmd(path, tmp_path / "reports", "--values", "8", *(["--spread"] if spread else [])))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith(f"lab: {path}: ") and why in out.stderr
    assert not (tmp_path / "reports" / "lab.db").exists()  # nothing recorded


@pytest.mark.integration
def test_unreachable_host_is_its_own_status_and_resume_retries_it(tmp_path):
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"vllm_servers": {"hosts": {"ghost": {
        "ansible_host": "127.0.0.1", "ansible_port": free_port(), "ansible_connection": "ssh",
        "ansible_user": "nobody",
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"}}}}}}))
    args = lab_cmd(inv, tmp_path / "reports", "--values", "8", "--experiment", "unreach")
    first = run_lab(*args)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stdout + first.stderr
    runs = Store(tmp_path / "reports/lab.db").runs("unreach")
    assert list(runs["status"]) == ["unreachable"]
    error = runs.iloc[0]["error"]
    assert error.startswith("unreachable: ghost: ") and "Connection refused" in error, error
    assert runs.iloc[0]["host"] == "ghost"
    assert Store(tmp_path / "reports/lab.db").finished_keys("unreach") == set()
    again = run_lab(*args, "--resume")
    assert again.returncode == 0 and "runs taken now: 1 unreachable" in again.stdout, again.stdout + again.stderr


# --- two lab processes on one host --------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_host(tmp_path_factory):
    """One private copy of inventory/local.yml (its own host folder and port), provisioned once."""
    tmp = tmp_path_factory.mktemp("two-labs")
    inv = private_inventory(tmp)
    serving.provision(inv, timeout=300)
    serving.stop(inv)  # gives the instance back: the lab processes below claim it
    yield tmp, inv
    serving.stop(inv)


def holder_of(tmp: Path) -> dict:
    path = tmp / "host/serve/run/main.lock"
    text = path.read_text() if path.exists() else ""
    return json.loads(text) if text.strip() else {}


@pytest.mark.integration
@pytest.mark.slow
def test_second_lab_process_is_refused_with_the_holders_experiment_and_pid(shared_host):
    tmp, inv = shared_host
    first = subprocess.Popen(lab_cmd(inv, tmp / "reports-a", "--values", "2,4", "--experiment", "lab-a"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                             start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and holder_of(tmp).get("pid") != first.pid:
            assert first.poll() is None, first.communicate()[0]
            time.sleep(0.2)
        second = run_lab(*lab_cmd(inv, tmp / "reports-b", "--values", "8", "--experiment", "lab-b"))
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is held by experiment lab-a (lab pid {first.pid} on {socket.gethostname()}" in second.stderr
        assert "Traceback" not in second.stderr
        assert not (tmp / "reports-b/lab.db").exists()
        out, _ = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
    assert first.returncode == 0, out
    # Both runs measured: whether the client kept up with them is this machine's load (the audit's
    # client-limited verdict, which two other live tests beside this one on 2 cores once drew),
    # not the lock's.
    runs = Store(tmp / "reports-a/lab.db").runs("lab-a")
    assert len(runs) == 2 and set(runs["status"]) <= {"ok", "client-limited"}, runs[["status", "error"]]
    assert holder_of(tmp) == {}  # released at the end of the run


@pytest.mark.integration
@pytest.mark.slow
def test_a_dead_holders_lock_and_server_are_taken_over(shared_host):
    tmp, inv = shared_host
    # A lab process that started a server and was killed: its lock and its server are left behind.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         ("import sys, time; from pathlib import Path; from vllm_lab import serving; "
         "serving.start({'model': 'llama-3-8b', 'max-num-seqs': 3}, inventory=Path(sys.argv[1]), "
         "backend='twin', experiment='killed-sweep', extra_vars={'vllm_twin_profile': 'cpu-demo'}); "
         "print('up', flush=True); time.sleep(600)"), str(inv)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "up"
        assert holder_of(tmp)["experiment"] == "killed-sweep"
        orphan = int((tmp / "host/serve/run/main.pid").read_text().split()[0])
        holder.kill()
        holder.wait()
        out = run_lab(*lab_cmd(inv, tmp / "reports-c", "--values", "2", "--experiment", "lab-c"))
        assert out.returncode == 0, out.stdout + out.stderr
        assert list(Store(tmp / "reports-c/lab.db").runs("lab-c")["status"]) == ["ok"]
        assert serving._start_time(orphan) == ""  # the dead holder's server was replaced
        assert holder_of(tmp) == {}
    finally:
        if holder.poll() is None:
            holder.kill()


def test_unreachable_reason_is_read_from_either_result_format():
    yaml_block = ("fatal: [gpu-2]: UNREACHABLE! => \n    changed: false\n    msg: 'Failed to connect to the host"
                  " via ssh: ssh: connect to host 10.0.0.2\n        port 22: Connection refused'\n"
                  "    unreachable: true\n\nPLAY RECAP ****\n")
    one_line = 'fatal: [gpu-3]: UNREACHABLE! => {"changed": false, "msg": "timed out", "unreachable": true}\n'
    assert serving._unreachable_reasons(yaml_block + one_line) == {
        "gpu-2": "Failed to connect to the host via ssh: ssh: connect to host 10.0.0.2 port 22: Connection refused",
        "gpu-3": "timed out"}


def test_a_host_lost_during_a_template_is_unreachable_not_failed():
    """ansible-core 2.18's template action reports a host lost under it as FAILED with the ssh
    connection's words: that host is unreachable; a failure of another kind stays a failure."""
    lost = ("fatal: [fleet-3]: FAILED! => \n    msg: 'Failed to connect to the host via ssh: Connection timed"
            " out during banner exchange'\n\n")
    other = "fatal: [fleet-1]: FAILED! => \n    msg: 'fleet-1: the serve flags name no model'\n\n"
    assert serving._unreachable_reasons(lost + other + "PLAY RECAP ****\n") == {
        "fleet-3": "Failed to connect to the host via ssh: Connection timed out during banner exchange"}


def test_unreachable_reason_of_a_loop_is_read_from_its_items():
    # The plays gather no facts: the first task to reach a host is the claim, a loop.
    loop = ("fatal: [ghost]: UNREACHABLE! => \n    changed: false\n    msg: All items completed\n    results:\n"
            "    -   ansible_loop_var: item\n        msg: 'Task failed: Failed to connect to the host via ssh:"
            " ssh: connect to host\n            127.0.0.1 port 1: Connection refused'\n        unreachable: true\n"
            "    unreachable: true\n\nPLAY RECAP ****\n")
    assert serving._unreachable_reasons(loop) == {
        "ghost": "Task failed: Failed to connect to the host via ssh: ssh: connect to host 127.0.0.1 port 1: "
                 "Connection refused"}
