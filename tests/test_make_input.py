"""Make variables reach the lab as data: injection payloads run nothing, experiment names never leave
OUT, and every bad input (a damaged, foreign or locked store, REPEATS=-2, a level the predictor cannot
simulate, ANSIBLE_VERBOSITY, an unknown flag) is one sentence and exit status 2, never a traceback."""

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_lab import cli, plans, scenarios, store
from vllm_lab.backends import Measurement
from vllm_lab.commands import bench
from vllm_lab.store import Store, StoreError

# Untimed: make, the CLI on the predictor, a provision: no live window (make test).
pytestmark = [pytest.mark.untimed, pytest.mark.usefixtures("shared_predictions")]  # tests/conftest.py
REPO = Path(__file__).resolve().parent.parent
SMALL = ["--backend", "predict", "--hardware", "cpu-demo", "--set", "load.shape.level=2",
         "--repeats", "1"]


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`make -s ARGS` in the repository, on this Python (LAB_PYTHON: .venv is left alone)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(["make", "-s", *args, f"LAB_PYTHON={sys.executable}"], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=120, check=False)


def one_sentence(err: str) -> str:
    """The lab's one line on stderr (make adds its own '*** Error 2' line after it)."""
    # make[1] when the tests themselves run under make (make test).
    lines = [ln for ln in err.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", ln)]
    assert len(lines) == 1 and lines[0].startswith("lab: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_f():
    """The payloads' file F, in the folder make runs in: it must never appear."""
    f = REPO / "F"
    assert not f.exists()
    yield f
    assert not f.exists(), "a make variable ran as a shell command"
    f.unlink(missing_ok=True)


# -- 1. shell injection through make variables -------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("target, variables", [
    ("baseline", ["EXPERIMENT=x; touch F"]),
    ("sweep", ["PARAM=$(touch F)…"]),
    ("sweep", ["PARAM=max-num-seqs", "VALUES=8|tee F"]),
    ("show", ["SET=serve.dtype=float16; touch F"]),
    ("combo", ["GRID=max-num-seqs=8,16 `touch F`=1"]),
    ("report", ["PERIOD=2026Q4; touch F"]),
    ("baseline", ["EXPERIMENT=$(shell touch F)"]),  # make's own function: not run either
])
def test_injection_payloads_run_nothing(tmp_path, no_f, target, variables):
    out = make(target, "BACKEND=predict", f"OUT={tmp_path}", *variables)
    assert out.returncode == 2
    one_sentence(out.stderr)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["my run", "it's", 'say "x"'])
def test_a_name_with_a_space_or_quote_gets_a_sentence(tmp_path, name):
    out = make("baseline", "BACKEND=predict", f"OUT={tmp_path}", f"EXPERIMENT={name}")
    assert out.returncode == 2
    assert one_sentence(out.stderr).startswith(f"lab: EXPERIMENT={name!r} is not an experiment name")


@pytest.mark.integration
def test_make_help_still_lists_every_variable():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True)
    for name in ("sweep", "EXPERIMENT", "SET", "PDF", "LAB_PYTHON"):
        assert name in out.stdout


def test_a_quoted_set_value_keeps_its_spaces_and_negative_values_stay_values():
    argv, names = cli.make_argv("sweep", {
        "LAB_MAKE_SET": 'serve.served-model-name="a b" load.shape.level=2',
        "LAB_MAKE_PARAM": "max-logprobs", "LAB_MAKE_VALUES": "-1,5", "LAB_MAKE_REPEATS": " 1 "})
    args = cli.build_parser().parse_args(argv)
    assert args.overrides == ["serve.served-model-name=a b", "load.shape.level=2"]
    assert args.values == "-1,5" and args.repeats == 1 and names["--values"] == "VALUES"
    assert scenarios.resolve("default", None, args.overrides).serve["served-model-name"] == "a b"
    assert plans.parse_values("max-logprobs", args.values) == [-1, 5]
    with pytest.raises(cli.UsageError, match="SET=.*close every quote"):
        cli.make_argv("show", {"LAB_MAKE_SET": 'serve.x="a b'})


def test_required_variables_and_switches_are_sentences(capsys, monkeypatch):
    monkeypatch.setenv("LAB_MAKE_RESUME", "maybe")
    assert cli.main(["make", "baseline"]) == 2
    assert "RESUME='maybe' is not allowed" in capsys.readouterr().err
    monkeypatch.delenv("LAB_MAKE_RESUME")
    assert cli.main(["make", "sweep"]) == 2
    assert "PARAM is required, e.g. make sweep PARAM=max-num-seqs" in capsys.readouterr().err


# -- 2. experiment names never leave OUT --------------------------------------------------------

@pytest.mark.parametrize("name", ["../../x", "/tmp/lab-abs-experiment", ".hidden", "a/b", "..", "x..y"])
def test_experiment_names_cannot_leave_out(tmp_path, capsys, name):
    out = tmp_path / "a" / "out"
    assert cli.main(["baseline", *SMALL, "--out", str(out), "--experiment", name]) == 2
    assert "is not an experiment name" in capsys.readouterr().err
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    assert not Path("/tmp/lab-abs-experiment").exists()
    with pytest.raises(StoreError, match="not an experiment name"):
        Store(out / "lab.db").create_experiment(name, "baseline", "default")


def test_a_scenario_name_with_slashes_stays_inside_out(tmp_path, capsys):
    doc = tmp_path / "evil.yaml"
    doc.write_text((REPO / "scenarios/default.yaml").read_text() + "\nname: ../../../escape me\n")
    out = tmp_path / "deep" / "out"
    assert cli.main(["baseline", *SMALL, "--scenario", str(doc), "--out", str(out)]) == 0, \
        capsys.readouterr().err
    written = {p for p in tmp_path.rglob("*") if p.is_file()} - {doc}
    assert written and all(out in p.parents for p in written)
    exp = Store(out / "lab.db").newest_experiment()
    assert store.EXPERIMENT_NAME.fullmatch(exp) and ".." not in exp


# -- 8. a store that cannot be used: damaged, foreign, locked ----------------------------------

def _store_with_a_run(out: Path) -> Path:
    assert cli.main(["baseline", *SMALL, "--out", str(out), "--experiment", "kept"]) == 0
    return out / "lab.db"


def test_a_damaged_store_is_one_sentence_and_is_not_changed(tmp_path, capsys):
    db = _store_with_a_run(tmp_path)
    Store(db).close()  # checkpoint the WAL into the file
    data = bytearray(db.read_bytes())
    page = 4096
    for offset in range(2 * page, len(data), page):  # every page after the schema's
        data[offset:offset + 64] = b"\xff" * 64
    db.write_bytes(bytes(data))
    for f in (tmp_path / "lab.db-wal", tmp_path / "lab.db-shm"):
        f.unlink(missing_ok=True)
    before = db.read_bytes()
    capsys.readouterr()
    for argv in (["findings", "--out", str(tmp_path)], ["report", "--out", str(tmp_path)],
                 ["baseline", *SMALL, "--out", str(tmp_path), "--experiment", "more"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(db) in err and "Traceback" not in err, err
    assert db.read_bytes() == before


def test_a_foreign_sqlite_file_is_refused_not_given_the_labs_tables(tmp_path, capsys):
    db = tmp_path / "lab.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
    conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    assert cli.main(["baseline", *SMALL, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{db}: an SQLite database of another program (tables: invoices)" in err
    assert "OUT=" in err and db.read_bytes() == before
    (tmp_path / "lab.db").write_text("not a database at all, just text\n" * 200)
    assert cli.main(["findings", "--out", str(tmp_path)]) == 2
    assert "not a lab database, not even SQLite" in capsys.readouterr().err


def test_a_locked_store_is_a_sentence_after_the_wait(tmp_path, capsys, monkeypatch):
    db = _store_with_a_run(tmp_path)
    monkeypatch.setattr(store, "LOCK_TIMEOUT_S", 0.5)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process mid-write, for longer than the wait
    try:
        capsys.readouterr()
        started = time.monotonic()
        assert cli.main(["baseline", *SMALL, "--out", str(tmp_path), "--experiment", "second"]) == 2
        assert time.monotonic() - started < 20
    finally:
        other.execute("ROLLBACK")
        other.close()
    err = capsys.readouterr().err
    assert f"{db}: the store is locked by another process" in err and err.count("\n") == 1
    assert list(Store(db).runs("kept")["status"]) == ["ok"]  # nothing recorded was lost


def test_store_and_pdf_errors_name_what_make_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(store.os, "access", lambda *_: False)  # root may write anywhere
    with pytest.raises(StoreError, match="choose another reports folder with OUT=") as e:
        Store(tmp_path / "lab.db")
    assert "STORE=" not in str(e.value)
    names = cli.make_argv("report", {"LAB_MAKE_PERIOD": "2026Q4"})[1]
    assert "PDF=0" in cli._for_make("the PDF needs Chromium; rerun with --no-pdf to skip it", names)


# -- 8/9. numbers, the predictor, Ansible ------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("variables, says", [
    (["REPEATS=-2"], "REPEATS='-2' is not allowed: a whole number, 1 or more"),
    (["REPEATS=0"], "REPEATS='0' is not allowed: a whole number, 1 or more"),
    (["DURATION=soon"], "DURATION='soon' is not allowed"),
    # Load levels are bounded in the schema now: refused before the predictor is asked.
    (["SET=load.shape.level=1e12"], "load.shape.level: Input should be less than or equal to 1000000"),
    (["ANSIBLE_VERBOSITY=3", "BACKEND=twin"], "ANSIBLE_VERBOSITY='3'"),
])
def test_bad_numbers_and_settings_are_sentences(tmp_path, variables, says):
    out = make("baseline", "BACKEND=predict", f"OUT={tmp_path}", *variables)
    assert out.returncode == 2 and says in one_sentence(out.stderr)
    assert not (tmp_path / "lab.db").exists() or not Store(tmp_path / "lab.db").runs().shape[0]


def test_the_predictor_refuses_a_flag_vllm_does_not_know(tmp_path, capsys):
    assert cli.main(["sweep", *SMALL, "--out", str(tmp_path), "--param", "not-a-flag",
                     "--values", "1,2"]) == 2
    assert "PARAM=not-a-flag: not a flag of vLLM 0.26.0" in capsys.readouterr().err
    assert cli.main(["combo", *SMALL, "--out", str(tmp_path),
                     "--grid", "max-num-seqs=8,16 max-num-seq=1,2"]) == 2
    assert "GRID=max-num-seq: not a flag of vLLM 0.26.0 (did you mean max-num-seqs?)" in \
        capsys.readouterr().err
    base = scenarios.resolve("default")
    assert plans.check_param("load.shape.level", base) == "load.shape.level"
    assert plans.check_param("serve.max-num-seqs", base) == "serve.max-num-seqs"


def test_negative_values_reach_the_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LAB_MAKE_PARAM", "max-logprobs")
    monkeypatch.setenv("LAB_MAKE_VALUES", "-1,5")
    monkeypatch.setenv("LAB_MAKE_BACKEND", "predict")
    monkeypatch.setenv("LAB_MAKE_OUT", str(tmp_path))
    monkeypatch.setenv("LAB_MAKE_EXPERIMENT", "neg")
    # The scenario's own max-logprobs (the sweep's reference point) is one of the values swept.
    monkeypatch.setenv("LAB_MAKE_SET", "load.shape.level=2 serve.max-logprobs=5")
    monkeypatch.setenv("LAB_MAKE_HARDWARE", "cpu-demo")
    assert cli.main(["make", "sweep"]) == 0, capsys.readouterr().err
    points = Store(tmp_path / "lab.db").runs("neg")["point"]
    assert sorted(p["max-logprobs"] for p in points) == [-1, 5]


# -- 9. reports/.work stays bounded -------------------------------------------------------------

class WorkBackend:
    """Writes a file into each run's work folder, as Locust does."""

    name = "predict"

    def measure(self, scenario, host, workdir: Path) -> Measurement:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "locust.log").write_text("x")
        return Measurement(status="ok", started=time.time(), ended=time.time())

    def close(self, host):
        pass


def test_work_folders_of_recorded_runs_are_removed_and_old_ones_pruned(tmp_path):
    work = tmp_path / ".work"
    stale, fresh = work / "old-experiment", work / "interrupted-today"
    for folder in (stale, fresh):
        (folder / "run").mkdir(parents=True)
    old = time.time() - plans.WORK_KEEP_S - 60
    os.utime(stale, (old, old))
    base = scenarios.resolve("default")
    plan = plans.Plan("work-test", "sweep", plans.sweep_points(base, "max-num-seqs", [8, 16]), {})
    assert plans.execute(plan, WorkBackend(), tmp_path / "lab.db", work) == {"ok": 2}
    assert sorted(p.name for p in work.iterdir()) == ["interrupted-today"]


# -- 5. make help, benchmarks and the host targets -----------------------------------------------

@pytest.mark.integration
def test_make_help_is_plain_text_off_a_terminal_and_groups_variables_by_target():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "\033" not in out.stdout  # piped: no colour codes for a file or a pager to show
    for target in ("provision", "stop", "teardown", "bench"):
        assert f"\n  {target} " in out.stdout
    # Every scripts/bench_*.py is listed under its make bench NAME, with its first line.
    for name in bench.benchmarks():
        assert f"\n  {name} " in out.stdout
    # A target's own variables sit under its heading.
    sweep = out.stdout.index("\nmake sweep:")
    assert sweep < out.stdout.index("\n  PARAM ") < out.stdout.index("\nmake combo:")
    assert out.stdout.index("\nmake bench:") < out.stdout.index("\n  NAME ")


@pytest.mark.integration
def test_make_bench_runs_the_named_script_with_its_arguments_as_data(no_f):
    out = make("bench", "NAME=twin", "ARGS=--help")
    assert out.returncode == 0 and "fidelity" in out.stdout, out.stderr
    for variables, says in ((["NAME=x; touch F"], "benchmark 'x; touch F' is not one of"),
                            (["NAME=-h"], "NAME='-h' is not allowed"),
                            ([], "NAME is required")):
        out = make("bench", *variables)
        assert out.returncode == 2 and says in one_sentence(out.stderr)
    argv, _ = cli.make_argv("bench", {"LAB_MAKE_NAME": "twin", "LAB_MAKE_ARGS": "speed --reference 'a b'"})
    assert argv == ["bench", "twin", "speed", "--reference", "a b"]


@pytest.mark.integration
def test_host_targets_refuse_a_bad_inventory_in_one_sentence(no_f):
    for target in ("provision", "stop", "teardown"):
        out = make(target, "INVENTORY=nowhere.yml; touch F")
        assert out.returncode == 2
        assert "no such inventory file" in one_sentence(out.stderr)
    out = make("stop", "VLLM_VENV=a\tb")
    assert out.returncode == 2 and "VLLM_VENV='a\\tb' is not allowed" in one_sentence(out.stderr)


@pytest.mark.integration
def test_container_inventory_takes_its_paths_from_make_variables(tmp_path):
    play = tmp_path / "show.yml"
    play.write_text("- hosts: vllm_servers\n  gather_facts: false\n  tasks:\n"
                    "    - ansible.builtin.debug:\n"
                    "        msg: 'venv={{ lab_host_venv }} root={{ lab_host_root }} serve={{ vllm_root }}'\n")
    exe = Path(sys.executable).with_name("ansible-playbook")
    env = {**os.environ, "LAB_MAKE_VLLM_VENV": "/opt/vllm{{ x }}", "LAB_MAKE_LAB_ROOT": "/scratch/lab"}
    out = subprocess.run([str(exe), "-i", str(REPO / "inventory/container.yml"), str(play)],
                         capture_output=True, text=True, env=env, check=False, timeout=120)
    # The text is data: a '{{ }}' in it is not templated.
    assert "venv=/opt/vllm{{ x }} root=/scratch/lab serve=/scratch/lab/serve" in out.stdout, out.stdout
    out = subprocess.run([str(exe), "-i", str(REPO / "inventory/container.yml"), str(play)],
                         capture_output=True, text=True, check=False, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("LAB_MAKE_")})
    # Without them: the environment of the Python that runs Ansible, and /tmp/vllm-lab.
    default = re.search(r"venv=(\S+) root=/tmp/vllm-lab serve=/tmp/vllm-lab/serve", out.stdout)
    assert default and (Path(default.group(1)) / "bin/python").exists(), out.stdout


@pytest.mark.integration
def test_make_provision_stop_teardown_on_a_private_host(tmp_path):
    from tests.support.processes import private_inventory
    inv = private_inventory(tmp_path, lab_host_lab_install=False)
    venv = tmp_path / "host/venv"
    out = make("provision", f"INVENTORY={inv}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (venv / ".vllm-lab-provisioned").is_file() and "changed" in out.stdout
    out = make("stop", f"INVENTORY={inv}")
    assert out.returncode == 0, out.stdout + out.stderr
    out = make("teardown", f"INVENTORY={inv}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not venv.exists() and not (tmp_path / "host/serve").exists()


# -- the lab's exit status through make (scripts/lab-make) ------------------------------------
def lab_make(*args: str) -> subprocess.CompletedProcess:
    """`scripts/lab-make -s ARGS`, as cron or CI would run it."""
    return subprocess.run([str(REPO / "scripts/lab-make"), "-s", *args, f"LAB_PYTHON={sys.executable}"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.integration
def test_lab_make_exits_with_the_labs_status_where_make_exits_2(tmp_path):
    lint = ["lint", "SET=serve.no-such-flag=1"]
    assert make(*lint).returncode == 2  # make's own status for any failed recipe
    assert lab_make(*lint).returncode == 1, lab_make(*lint).stderr  # the lab's: a lint error
    deadline = ["sweep", "BACKEND=predict", "HARDWARE=cpu-demo", "PARAM=max-num-seqs", "VALUES=8,16",
                "SET=serve.max-num-seqs=16", "DEADLINE=2s", f"OUT={tmp_path}"]  # no reference point joins
    stopped = lab_make(*deadline)
    assert stopped.returncode == 75, stopped.stderr
    assert "lab: stopped for DEADLINE=" in stopped.stderr and "0 of 2 runs done" in stopped.stderr
    # A failure of make's own (a variable the target needs) keeps make's status.
    assert lab_make("sweep", f"OUT={tmp_path}").returncode == 2
    assert lab_make("lint").returncode == 0


@pytest.mark.integration
def test_a_signal_to_lab_make_stops_the_lab_once_with_its_status(tmp_path):
    """cron or CI ends a job with SIGTERM to the process it started: the wrapper hands it to make
    and the lab, and exits with the lab's 143."""
    import json
    import signal

    cmd = [str(REPO / "scripts/lab-make"), "-s", "sweep", "BACKEND=predict", "HARDWARE=cpu-demo",
           "PARAM=max-num-seqs", "VALUES=8,16,32,64,128,256", "DURATION=600", "REPEATS=5", f"OUT={tmp_path}",
           f"LAB_PYTHON={sys.executable}"]
    wrapper = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat = tmp_path / ".work/status.json"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (beat.exists() and beat.read_text().strip()):
            assert wrapper.poll() is None, wrapper.communicate()
            time.sleep(0.1)
        wrapper.send_signal(signal.SIGTERM)
        _, err = wrapper.communicate(timeout=60)
    finally:
        if wrapper.poll() is None:  # make runs in a group of its own: stop it by that group
            from tests.support.processes import process_table
            for fields in process_table().values():
                if int(fields[1]) == wrapper.pid and int(fields[2]) != os.getpgrp():
                    os.killpg(int(fields[2]), signal.SIGKILL)
            wrapper.kill()
            wrapper.wait()
    assert wrapper.returncode == 143, err
    assert "stopped by SIGTERM" in err and "noted" not in err and "stopping the servers first" not in err
    assert json.loads(beat.read_text())["state"] == "interrupted"


# -- each value checked up front, in the words the user typed ----------------------------------

@pytest.mark.parametrize("extra, says", [
    (["--deadline", "9999-12-31T23:59"], "DEADLINE='9999-12-31T23:59' is not a deadline: more than 366 days ahead"),
    (["--deadline", "99999999999h"], "DEADLINE='99999999999h' is not a deadline: more than 366 days ahead"),
    (["--deadline", "0001-01-01T00:00"], "DEADLINE='0001-01-01T00:00' is not a deadline"),
    (["--out", "/dev/null"], "OUT='/dev/null' is not a folder"),
    (["--out", "{file}"], "is not a folder: OUT must be a folder"),
    (["--out", "{file}/below"], "is not a folder ("),
])
def test_a_deadline_past_a_year_or_an_out_that_is_no_folder_is_one_sentence(tmp_path, capsys, extra, says):
    (tmp_path / "file").write_text("kept\n")
    extra = [x.replace("{file}", str(tmp_path / "file")) for x in extra]
    env = {f"LAB_MAKE_{k}": v for k, v in {"BACKEND": "predict", "HARDWARE": "cpu-demo",
                                           "PARAM": "max-num-seqs", "VALUES": "8",
                                           "SET": "load.shape.level=2 load.stop.duration_s=2",
                                           "OUT": str(tmp_path / "out"),
                                           extra[0][2:].upper(): extra[1]}.items()}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        rc = cli.main(["make", "sweep"])
    err = capsys.readouterr().err
    assert rc == 2 and says in one_sentence(err)
    assert (tmp_path / "file").read_text() == "kept\n" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("target, variables, says", [
    ("stress", {"SHAPE": "step", "LEVELS": "1e-300,1e300"},
     "LEVELS: load.shape.level=1e+300: not a valid scenario value"),
    ("stress", {"SHAPE": "step", "LEVELS": "1,x"}, "LEVELS: 'x' is not a value of load.shape.level"),
    ("claims", {"CLAIMS": "3-1"}, "CLAIMS: '3-1' is an empty range; write it from the lower number up"),
    ("claims", {"CLAIMS": "1-"}, "CLAIMS: '1-' is not a claim number or range (1-9)"),
])
def test_levels_and_claims_are_named_as_typed_and_an_empty_range_is_refused(tmp_path, capsys, target,
                                                                          variables, says):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"BACKEND": "predict", "HARDWARE": "cpu-demo", "OUT": str(tmp_path), **variables}.items():
            mp.setenv(f"LAB_MAKE_{k}", v)
        rc = cli.main(["make", target])
    assert rc == 2 and says in one_sentence(capsys.readouterr().err)
    assert not (tmp_path / "lab.db").exists() or not Store(tmp_path / "lab.db").runs().shape[0]
