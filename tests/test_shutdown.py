"""How the lab ends when told to (vllm_lab/shutdown.py): SIGTERM, SIGHUP and Ctrl-C stop a command
the way Ctrl-C always did, and a live sweep on the twin ends with its server and Locust stopped,
its port closed, the instance's lock given back and its heartbeat saying it was interrupted.

The live cases start the lab as a user would (scripts/lab.py, its own process group) on a private
inventory, and stop what they started by process id or group only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.processes import private_inventory, process_table, server_pid
from vllm_lab import shutdown

REPO = Path(__file__).resolve().parent.parent


# --- in this process -----------------------------------------------------------------------------
def test_sigterm_and_sighup_are_raised_as_terminated_with_the_shells_status():
    for signum in (signal.SIGTERM, signal.SIGHUP):
        with pytest.raises(shutdown.Terminated) as stop, shutdown.handling():
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here, at once
        assert stop.value.code == 128 + signum and shutdown.exit_code(stop.value) == 128 + signum
        assert isinstance(stop.value, KeyboardInterrupt)  # every Ctrl-C path stops on it too
    with pytest.raises(KeyboardInterrupt) as stop, shutdown.handling():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert shutdown.exit_code(stop.value) == 130


def test_the_handlers_before_are_given_back():
    before = {s: signal.getsignal(s) for s in shutdown.SIGNALS}
    with shutdown.handling():
        assert all(signal.getsignal(s) is shutdown.on_signal for s in shutdown.SIGNALS)
    assert {s: signal.getsignal(s) for s in shutdown.SIGNALS} == before


def test_a_signal_while_a_server_stops_waits_until_it_is_stopped():
    stopped = []
    with pytest.raises(shutdown.Terminated), shutdown.handling():
        with shutdown.shielded():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            stopped.append(True)  # not cut short
        raise AssertionError("the signal was not raised after the shielded block")
    assert stopped == [True]


def test_a_second_signal_is_noted_not_raised(capsys):
    with pytest.raises(KeyboardInterrupt), shutdown.handling():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            # The lab now stops its servers: a second Ctrl-C must not cut that short.
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            raise
    assert "stopping the servers first" in capsys.readouterr().err


def test_make_passing_on_a_sigterm_the_lab_already_got_is_the_same_stop(capsys):
    # make sends a SIGTERM on to its children, who got it from the group too: one stop, no note.
    with pytest.raises(shutdown.Terminated), shutdown.handling():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except shutdown.Terminated:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            raise
    assert "stopping the servers first" not in capsys.readouterr().err


def test_a_stop_that_pydantic_wrapped_in_its_own_error_is_the_stop_again():
    """A SIGTERM raised while pydantic ran a serializer of the lab's came back as a
    PydanticSerializationError, and a stopped sweep ended as an internal error (exit 70)."""
    from pydantic import BaseModel, model_serializer

    from vllm_lab.commands.stopping import watched

    class Dumped(BaseModel):
        x: int = 1

        @model_serializer(mode="wrap")
        def _dump(self, handler):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, inside pydantic's call
            return handler(self)

    with pytest.raises(shutdown.Terminated) as stop, shutdown.handling(), watched(None, object()):
        Dumped().model_dump()
    assert stop.value.code == 143 and type(stop.value.__cause__).__name__ == "PydanticSerializationError"
    assert shutdown.stop_inside(ValueError("unrelated")) is None


def test_an_inherited_ignore_is_kept():
    """nohup ignores SIGHUP for the lab: it stays ignored."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with shutdown.handling():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is shutdown.on_signal
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_exit_callbacks_run_once_and_a_failed_one_skips_no_other(capsys):
    calls = []

    class Holder:
        def stop(self):
            calls.append("held")

    def broken():
        raise RuntimeError("no playbook")

    holder = Holder()
    shutdown.on_exit(holder.stop)
    shutdown.on_exit(broken)
    shutdown._at_exit()
    shutdown._at_exit()
    assert calls == ["held"]
    assert "at exit: RuntimeError: no playbook" in capsys.readouterr().err


# --- a live sweep on the twin --------------------------------------------------------------------
SETS = ["load.stop.duration_s=60", "workload.source=alpaca-like", "run.warmup_requests=1",
        "load.shape.level=2"]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A private copy of inventory/local.yml: its own host folder and port."""
    tmp = tmp_path_factory.mktemp("shutdown")
    inv = private_inventory(tmp)
    port = yaml.safe_load(inv.read_text())["all"]["children"]["vllm_servers"]["hosts"]["localhost"][
        "vllm_instances"][0]["port"]
    return tmp, inv, port


def heartbeat(out: Path) -> dict:
    path = out / ".work/status.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def in_phase(out: Path, phase: str) -> bool:
    return any(f.get("phase") == phase for f in heartbeat(out).get("in_flight", []))


def groups_of(lab_pid: int, server: int | None) -> set[int]:
    """The process groups of the lab's children (Locust, Ansible) and of the server."""
    table = process_table()
    tree, grew = {lab_pid}, True
    while grew:
        grew = False
        for pid, fields in table.items():
            if int(fields[1]) in tree and pid not in tree:
                tree.add(pid)
                grew = True
    if server in table:
        tree.add(server)
    return {int(table[p][2]) for p in tree - {lab_pid} if p in table}


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.integration
@pytest.mark.parametrize(("signals", "phase", "code"), [
    ((signal.SIGTERM,), "measuring", 143),
    ((signal.SIGHUP,), "starting", 129),
    ((signal.SIGINT, signal.SIGINT), "measuring", 130),
], ids=["sigterm-measuring", "sighup-starting", "two-sigint-measuring"])
def test_a_stopped_sweep_leaves_no_server_behind(host, signals, phase, code):
    tmp, inv, port = host
    out = tmp / f"reports-{phase}-{len(signals)}-{signals[0]}"
    cmd = [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", "max-num-seqs",
           "--values", "2,4", "--hardware", "cpu-demo", "--inventory", str(inv), "--out", str(out),
           "--experiment", "stopped", *[x for s in SETS for x in ("--set", s)]]
    lab = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    groups: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not in_phase(out, phase):
            assert lab.poll() is None, lab.communicate()[0]
            time.sleep(0.2)
        assert in_phase(out, phase), f"the sweep never reached {phase}"
        time.sleep(3 if phase == "measuring" else 1)
        groups = groups_of(lab.pid, server_pid(tmp))
        assert groups, "the lab had no child process to stop"
        for s in signals:
            lab.send_signal(s)
            time.sleep(0.5)
        output, _ = lab.communicate(timeout=200)
    finally:
        if lab.poll() is None:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
    assert lab.returncode == code, output
    assert "servers stopped; resume with:" in output and "Traceback" not in output, output
    left = [pid for pid, fields in process_table().items()
            if int(fields[2]) in groups and fields[0] != "Z"]
    assert left == [], f"processes of the lab's groups survived: {left}"
    assert not port_open(port)
    assert heartbeat(out)["state"] == "interrupted" and heartbeat(out)["in_flight"] == []
    lock = tmp / "host/serve/run/main.lock"
    assert not lock.exists() or not lock.read_text().strip()  # the instance is given back
