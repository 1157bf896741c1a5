"""The experiment module: ids, the store path, resume, and DEADLINE (predictor and twin)."""

import json
import re
import shlex
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.support.processes import private_inventory
from vllm_lab import cli, serving
from vllm_lab.analysis import host_time
from vllm_lab.commands.autotune import AutotuneOptions, autotune
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.stopping import watched
from vllm_lab.commands.sweep import sweep
from vllm_lab.commands.tune import TuneOptions, tune
from vllm_lab.deadline import (
    EXIT_DEADLINE,
    RUN_OVERHEAD_S,
    Deadline,
    DeadlineError,
    DeadlineReached,
    Timing,
    Watchdog,
)
from vllm_lab.scenarios import resolve
from vllm_lab.store import Store, store_path

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

SMALL = ["--set", "load.shape.level=2", "--set", "load.stop.duration_s=5"]
SOURCE = Source("default", None, ("load.shape.level=2", "load.stop.duration_s=5"))


# -- DEADLINE as written ----------------------------------------------------------------------------

NOW = datetime(2026, 12, 1, 3, 0).astimezone()


@pytest.mark.parametrize("text, after", [
    ("25m", timedelta(minutes=25)), ("1h30m", timedelta(hours=1, minutes=30)), ("90s", timedelta(seconds=90)),
    ("05:30", timedelta(hours=2, minutes=30)), ("2026-12-01T05:30", timedelta(hours=2, minutes=30)),
])
def test_deadline_forms(text, after):
    assert Deadline.parse(text, NOW).at == pytest.approx((NOW + after).timestamp())


@pytest.mark.parametrize("text", ["", "soon", "25", "1x", "25:61", "02:00", "2026-11-30T05:30", "m"])
def test_bad_deadline_is_one_sentence(text):
    with pytest.raises(DeadlineError) as e:
        Deadline.parse(text, NOW)
    assert "\n" not in str(e.value) and "25m" in str(e.value)


def test_deadline_reaches_every_long_command_from_make(capsys):
    for target in ("baseline", "sweep", "combo", "tune", "stress", "claims", "calibrate"):
        assert ("DEADLINE", "--deadline") in cli.MAKE_TARGETS[target]
    argv, _ = cli.make_argv("sweep", {"LAB_MAKE_PARAM": "max-num-seqs", "LAB_MAKE_DEADLINE": "1h"})
    assert "--deadline=1h" in argv and cli.build_parser().parse_args(argv).deadline.left() > 3500


def test_bad_deadline_from_make_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("LAB_MAKE_DEADLINE", "tomorrow")
    assert cli.main(["make", "baseline"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lab: DEADLINE='tomorrow' is not a deadline:") and err.count("\n") == 1


def test_resume_command_repeats_the_make_variables():
    command = cli._make_resume_command("sweep", {
        "LAB_MAKE_PARAM": "max-num-seqs", "LAB_MAKE_BACKEND": "predict", "LAB_MAKE_SCENARIO": "default",
        "LAB_MAKE_SET": "load.shape.level=2 serve.x=1", "LAB_MAKE_DEADLINE": "5m", "LAB_MAKE_RESUME": ""})
    assert command("sweep-x-1") == ("make sweep 'SET=load.shape.level=2 serve.x=1' BACKEND=predict "
                                    "PARAM=max-num-seqs RESUME=1 EXPERIMENT=sweep-x-1")


# -- ids and the store ------------------------------------------------------------------------------

def test_store_path_and_unique_ids(tmp_path):
    assert store_path(tmp_path) == tmp_path / "lab.db"
    assert store_path(tmp_path, tmp_path / "x.db") == tmp_path / "x.db"
    scenario = SOURCE.resolve_checked()
    settings = Settings(backend="predict", out=tmp_path)
    first = experiment_id(settings, "sweep", scenario, "max-num-seqs")
    store = Store(settings.store_path)
    store.create_experiment(first, "sweep", scenario.name, {})
    store.close()
    second = experiment_id(settings, "sweep", scenario, "max-num-seqs")
    assert second != first and second.startswith(first[:-len("-YYYYmmdd-HHMMSS")])
    resumed = experiment_id(Settings(backend="predict", out=tmp_path, resume=True),
                                       "sweep", scenario, "max-num-seqs")
    assert resumed == first


# -- the deadline on the predictor ------------------------------------------------------------------

def _recorded(path: Path, exp: str) -> int:
    store = Store(path)
    try:
        return len(store.runs(exp))
    finally:
        store.close()


def test_predictor_stops_at_the_deadline_and_resume_completes(tmp_path, capsys):
    out = tmp_path / "reports"
    # A clock that runs normally until three runs are in the store, then is past the deadline.
    at = time.time() + 3600
    deadline = Deadline(at, "test", clock=lambda: time.time() if _recorded(out / "lab.db", "dl") < 3 else at + 1)
    settings = Settings(backend="predict", out=out, experiment="dl", deadline=deadline,
                        resume_command=lambda e: f"make sweep RESUME=1 EXPERIMENT={e}")
    rc = sweep(settings, SOURCE, "max-num-seqs", "8,16,32,64")
    err = capsys.readouterr().err
    assert rc == EXIT_DEADLINE, err
    # vLLM's default max-num-seqs joins the four values as the sweep's reference: five runs.
    assert "3 of 5 runs done, 2 left" in err and "make sweep RESUME=1 EXPERIMENT=dl" in err
    assert err.count("\n") == 1
    first = Store(out / "lab.db").runs("dl").set_index("run_key")["started"]
    rc = sweep(Settings(backend="predict", out=out, experiment="dl", resume=True), SOURCE,
                          "max-num-seqs", "8,16,32,64")
    assert rc == 0
    runs = Store(out / "lab.db").runs("dl").set_index("run_key")
    assert len(runs) == 5 and set(runs["status"]) == {"ok"}
    assert (runs.loc[first.index, "started"] == first).all()  # finished runs were not re-measured


def test_cli_deadline_too_close_starts_nothing_and_says_how_to_resume(tmp_path, capsys):
    argv = ["sweep", *SMALL, "--backend", "predict", "--out", str(tmp_path), "--param", "max-num-seqs",
            "--values", "8,16", "--deadline", "2s"]
    assert cli.main(argv) == EXIT_DEADLINE
    err = capsys.readouterr().err
    assert "0 of 3 runs done, 3 left" in err  # 8, 16 and vLLM's default, the reference
    command = shlex.split(err.split("resume with: ")[1])
    assert command[0] == "scripts/lab.py" and "--deadline" not in command
    assert cli.main(command[1:]) == 0
    assert _recorded(tmp_path / "lab.db", command[-1].split("=")[1]) == 3


def test_timing_uses_measured_starts_and_runs(tmp_path):
    scenario = SOURCE.resolve_checked()
    timing = Timing(live=True)
    # Nothing measured: the run's duration plus overhead, and the start timeout for a start.
    assert timing.expected("h", scenario, start=False) == 5 + RUN_OVERHEAD_S
    assert timing.expected("h", scenario, start=True) == scenario.run.start_timeout_s + 5 + RUN_OVERHEAD_S
    timing.add("h", True, 40.0)
    timing.add("h", False, 8.0)
    assert timing.expected("h", scenario, start=False) == 8.0
    assert timing.expected("h", scenario, start=True) == 40.0
    assert timing.expected("other", scenario, start=True) == 40.0  # another host: what was seen anywhere
    # A start followed by runs discarded: until one is measured, each is a run's expected time.
    warmed = scenario.model_copy(update={"run": scenario.run.model_copy(update={"warmup_runs": 2})})
    fresh = Timing(live=True)
    assert fresh.expected("h", warmed, start=True) == scenario.run.start_timeout_s + 3 * (5 + RUN_OVERHEAD_S)


def test_a_refused_point_says_what_it_needed_and_what_was_left():
    """A phase given 4 minutes on a host where this experiment never started a server: the
    start counts as the start timeout, so the point is refused, and the stop says so in numbers
    (the H100's eager staircase was refused four times without a word of why). Once a start is
    measured, the same minutes hold the point."""
    from vllm_lab.backends import Measurement
    from vllm_lab.deadline import STOP_MARGIN_S, DeadlineGuard, DeadlineReached
    from vllm_lab.store import RunStatus

    class Recorded:
        name, calls = "vllm", 0

        def measure(self, scenario, host, workdir):
            Recorded.calls += 1
            return Measurement(status=RunStatus.OK, started=0.0, ended=1.0)

    scenario = SOURCE.resolve_checked()
    at = time.time() + 240
    guard = DeadlineGuard(Recorded(), Deadline(at, "4m"), Timing(live=True))
    with pytest.raises(DeadlineReached) as refused:
        guard.measure(scenario, "gpu0", Path("."))
    need = scenario.run.start_timeout_s + 5 + RUN_OVERHEAD_S + STOP_MARGIN_S
    why = refused.value.why
    assert why.startswith(
        f"the next run needs about {need:.0f} s with the servers' stop, its server's start counted "
        f"as run.start_timeout_s="
        f"{scenario.run.start_timeout_s:g} until one is measured in this experiment, and "), why
    assert re.search(r", and 2[34]\d s were left$", why), why
    assert Recorded.calls == 0
    measured = Timing(live=True)
    measured.add("gpu0", True, 90.0)
    DeadlineGuard(Recorded(), Deadline(at, "4m"), measured).measure(scenario, "gpu0", Path("."))
    assert Recorded.calls == 1


def test_a_request_bounded_run_is_expected_to_last_what_its_requests_take():
    """make calibrate's runs end at a number of requests, under a 600-s cap: the guard expects
    each from the twin's prediction of its requests, not from the cap (a calibration given a
    deadline of a few minutes was refused before its first start), and never from a smaller
    run seen before it."""
    from vllm_lab import calibrate
    from vllm_lab.deadline import planned_run_s

    points = {p.values["point"]: p.scenario for p in calibrate.calibration_points(resolve("default", "h200"))}
    small, large = points["p128"], points["c512"]
    assert small.load.stop.duration_s == large.load.stop.duration_s == 600
    assert 0 < planned_run_s(small) < planned_run_s(large) < 120
    timing = Timing(live=True)
    assert timing.expected("h", small, start=False) == planned_run_s(small) + RUN_OVERHEAD_S
    timing.add("h", False, 3.0)
    assert timing.expected("h", large, start=False) == planned_run_s(large) + RUN_OVERHEAD_S
    timing.add("h", False, 500.0)  # a slower host than the profile's: what it measured counts
    assert timing.expected("h", small, start=False) == 500.0


# -- the deadline on the twin -----------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.slow
def test_twin_stops_at_the_deadline_servers_stopped_and_resume_completes(tmp_path, capsys):
    """One value and the reference (vLLM's default, 256) of two runs each; the clock passes the
    deadline once two runs are in: the reference's server is never started, the first's is
    stopped, a resume takes the rest."""
    inv = private_inventory(tmp_path)
    out = tmp_path / "reports"
    source = Source("default", "cpu-demo", ("load.shape.level=2", "load.stop.duration_s=3",
                                            "workload.source=alpaca-like", "run.warmup_requests=1",
                                            "run.start_timeout_s=60"))
    at = time.time() + 3600
    deadline = Deadline(at, "test", clock=lambda: time.time() if _recorded(out / "lab.db", "dl-twin") < 2 else at)
    settings = Settings(backend="twin", inventory=inv, out=out, experiment="dl-twin", repeats=2,
                        deadline=deadline)
    assert sweep(settings, source, "max-num-seqs", "4") == EXIT_DEADLINE
    assert "2 of 4 runs done, 2 left, servers stopped" in capsys.readouterr().err
    assert not any(p.read_text().split()[:1] for p in (tmp_path / "host").rglob("*.pid")), \
        "a twin is still running after the deadline"
    first = Store(out / "lab.db").runs("dl-twin").set_index("run_key")["started"]
    resumed = Settings(backend="twin", inventory=inv, out=out, experiment="dl-twin", repeats=2, resume=True)
    assert sweep(resumed, source, "max-num-seqs", "4") == 0
    runs = Store(out / "lab.db").runs("dl-twin").set_index("run_key")
    assert len(runs) == 4 and set(runs["status"]) == {"ok"}
    assert (runs.loc[first.index, "started"] == first).all()
    # Both commands kept their span, the stopped one too: its server's start and stop, the
    # resume's, and the four windows are accounted for on the page.
    with Store(out / "lab.db") as store:
        spans = store.experiment("dl-twin")["meta"]["host_time"]
        spent = host_time.account({"host_time": spans}, store.runs("dl-twin"))
    assert len(spans) == 2 and all(s["ended"] > s["began"] + s["provisioned_s"] for s in spans)
    assert spent.spans == 2 and spent.hosts == 1
    assert spent.total_s == pytest.approx(sum(s["ended"] - s["began"] for s in spans))
    assert spent.parts["measuring"] == pytest.approx(runs["duration_s"].sum())
    assert spent.parts["starts"] > sum(s["stops_s"] for s in spans) > 0
    assert "## Time on the hosts" in next(out.glob("dl-twin*/report.md")).read_text()


def test_watchdog_stops_a_run_that_outlasts_its_estimate():
    deadline = Deadline(time.time() + 0.5, "test")
    began = time.time()
    with pytest.raises(KeyboardInterrupt), Watchdog(deadline, margin=0.0) as watch:
        time.sleep(10)  # a run still going at the deadline
    assert watch.fired.is_set() and time.time() - began < 5
    with Watchdog(Deadline(time.time() + 0.3, "test"), margin=0.0) as watch:
        pass  # a block that ends in time is never interrupted afterwards
    time.sleep(0.5)
    assert not watch.fired.is_set()
    with Watchdog(Deadline(time.time() + 0.3, "test"), margin=0.0) as watch:
        watch.disarm()  # the lab is stopping: its servers' stop is not cut short
        time.sleep(0.6)
    assert not watch.fired.is_set()


def test_watched_block_turns_the_watchdog_interrupt_into_deadline_reached():
    with pytest.raises(DeadlineReached), watched(Deadline(time.time() + 0.3, "test"), object()):
        time.sleep(10)  # a run still going at the deadline
    with pytest.raises(KeyboardInterrupt), watched(None, object()):
        raise KeyboardInterrupt  # the user's Ctrl-C stays one


def test_tune_stopped_says_how_many_trials_are_left(tmp_path, capsys):
    argv = ["tune", *SMALL, "--backend", "predict", "--out", str(tmp_path), "--trials", "3",
            "--deadline", "2s"]
    assert cli.main(argv) == EXIT_DEADLINE
    err = capsys.readouterr().err
    assert "0 of 3 trials done, 3 left" in err and "--trials=3 --resume --experiment=tune-" in err


def test_tune_spread_over_hosts_stops_at_the_deadline_without_tracebacks(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(serving, "serve_hosts", lambda inventory: ["a", "b"])
    out = tmp_path / "reports"
    at = time.time() + 3600
    deadline = Deadline(at, "test", clock=lambda: time.time() if _recorded(out / "lab.db", "dl-tune") < 2 else at)
    settings = Settings(backend="predict", out=out, experiment="dl-tune", spread=True, deadline=deadline)
    rc = tune(settings, SOURCE, TuneOptions(trials=4, seed=1))
    err = capsys.readouterr().err
    assert rc == EXIT_DEADLINE, err
    assert "of 8 trials done" in err and "Traceback" not in err and "Exception in thread" not in err


def test_stress_ramp_stops_once_for_the_deadline(tmp_path, capsys):
    argv = ["stress", "--shape", "ramp", "--backend", "predict", "--out", str(tmp_path),
            "--set", "load.stop.duration_s=5", "--deadline", "2s"]
    assert cli.main(argv) == EXIT_DEADLINE
    err = capsys.readouterr().err
    assert err.count("lab: stopped for DEADLINE=") == 1 and "0 of " in err


def test_the_watchdogs_signal_landing_as_it_disarms_is_the_deadline_not_a_ctrl_c(monkeypatch):
    # On a loaded machine the watchdog can fire just as the guard stops the plan: its SIGINT then
    # lands while the block's exit disarms it (here: raised from disarm, as the handler would).
    disarm = Watchdog.disarm

    def fired_meanwhile(self):
        disarm(self)
        if not self.fired.is_set():
            self.fired.set()
            raise KeyboardInterrupt

    monkeypatch.setattr(Watchdog, "disarm", fired_meanwhile)
    with pytest.raises(DeadlineReached), watched(Deadline(time.time() + 3600, "1h"), object()):
        pass


def _family_runs(path: Path, exp: str) -> int:
    store = Store(path)
    try:
        return len(store.runs(exp, family=True))
    finally:
        store.close()


def test_autotune_stops_at_the_deadline_reports_what_it_has_and_resumes(tmp_path, capsys):
    """autotune's candidates are experiments of their own (<id>-defaults, <id>-c1): the deadline
    and its timing see them all; the stop still writes the report; the resume finishes the rest."""
    out = tmp_path / "reports"
    at = time.time() + 3600
    deadline = Deadline(at, "test", clock=lambda: time.time() if _family_runs(out / "lab.db", "at") < 4 else at + 1)
    source = Source("realtime-chat", None, ("load.stop.duration_s=15",))  # 15 s levels: sooner
    options = AutotuneOptions(gpu_minutes=20, trials=3, seed=1, top=1)
    settings = Settings(backend="predict", out=out, experiment="at", deadline=deadline,
                        resume_command=lambda e: f"make autotune RESUME=1 EXPERIMENT={e}")
    rc = autotune(settings, source, options)
    err = capsys.readouterr().err
    assert rc == EXIT_DEADLINE, err
    assert "make autotune RESUME=1 EXPERIMENT=at" in err and err.count("\n") == 1
    assert _family_runs(out / "lab.db", "at") == 4
    stopped = json.loads((out / "at" / "summary.json").read_text())
    assert stopped["candidates"][0]["status"] == "ok"  # the defaults' levels measured so far
    rc = autotune(Settings(backend="predict", out=out, experiment="at"), source, options)
    assert rc == 0
    done = json.loads((out / "at" / "summary.json").read_text())
    assert all(c["status"] == "ok" for c in done["candidates"]) and _family_runs(out / "lab.db", "at") > 4
    timing = Timing.from_store(out / "lab.db", "at", "predict")
    assert sum(map(len, timing.runs.values())) == _family_runs(out / "lab.db", "at")


def test_autotune_shows_its_levels_as_progress(tmp_path):
    """Each level is a progress run naming its candidate; make status reads the heartbeat."""
    out = tmp_path / "reports"
    rc = autotune(Settings(backend="predict", out=out, experiment="at"),
                             Source("realtime-chat", None, ("load.stop.duration_s=15",)),
                             AutotuneOptions(trials=3, seed=1, top=1))
    assert rc == 0
    beat = json.loads((out / ".work" / "status.json").read_text())
    assert beat["step"] == "autotune" and beat["state"] == "finished" and beat["runs_done"] >= 6
    assert re.fullmatch(r"level \d+/\d+ c1 · load\.shape\.level=[\d.]+: \d+ tok/s, .*", beat["last"]), beat


def test_watchdog_works_when_the_lab_was_started_with_sigint_ignored():
    """nohup or `make ... &` from a script starts the lab with SIGINT ignored: the deadline still
    stops a run, and the disposition is given back afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), \
                Watchdog(Deadline(time.time() + 0.3, "test"), margin=0.0):
            time.sleep(10)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
