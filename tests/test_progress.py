"""Progress of long commands: plain lines off a terminal, the heartbeat and `make status`."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_lab import progress
from vllm_lab.traffic.runner import LiveFigures

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"^\d\d:\d\d:\d\d ")


@dataclass
class FakePoint:
    values: dict
    repeat: int = 0
    extra: dict = field(default_factory=dict)


def plain_progress(tmp_path: Path, stream: io.StringIO, backend: str = "twin") -> progress.Progress:
    return progress.Progress("sweep", "exp-1", backend, tmp_path, stream=stream, window_s=30, plain=True)


def test_point_labels_read_as_people_write_them():
    assert progress.point_label({"max-num-seqs": 8}) == "max-num-seqs=8"
    assert progress.point_label({"a": 0.5, "b": True}) == "a=0.5, b=true"
    assert progress.point_label({}) == "defaults"


@pytest.mark.parametrize("env", [{"CI": "true"}, {"NO_COLOR": ""}, {"TERM": "dumb"}])
def test_escape_codes_only_on_a_terminal_that_wants_them(monkeypatch, env):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    for name in ("CI", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert progress.fancy(Tty()) and not progress.fancy(io.StringIO())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not progress.fancy(Tty())


def test_plain_mode_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_FIGURES_EVERY_S", 0.0)
    out = io.StringIO()
    p = plain_progress(tmp_path, out)
    points = [FakePoint({"max-num-seqs": v}, r) for v in (8, 16) for r in range(2)]
    with progress.tracking(p):
        p.begin(points, points, groups=2)
        p.point_started(points[0].values, 0)
        p.phase("starting")
        p.phase("measuring", window_s=30)
        p.figures(requests=12, tok_s=340.0, errors=1)
        p.point_done(points[0].values, 0, "ok", {"output_throughput": 345.0, "goodput": 1.5,
                                                 "ttft_p50": 0.08, "tpot_p50": 0.012})
        p.point_started(points[1].values, 1)
        p.point_done(points[1].values, 1, "oom", {}, "oom: CUDA out of memory\nTraceback ...")
    text = out.getvalue()
    lines = text.splitlines()
    assert "\x1b" not in text
    assert lines[0].startswith("sweep: experiment exp-1, 2 point(s), 4 run(s)")
    assert all(STAMP.match(ln) for ln in lines[1:]), text
    assert any("point 1/2 max-num-seqs=8 · run 1/2: server starting (expected ~15 s)" in ln for ln in lines)
    assert any("measuring" in ln and "12 requests, 340 tok/s, 1 errors" in ln for ln in lines), text
    assert any("point 1/2 max-num-seqs=8 · run 1/2: 345 tok/s, goodput 1.50 req/s" in ln for ln in lines)
    # a failure is one line with its cause, not the traceback
    assert any(ln.endswith("run 2/2: oom: CUDA out of memory · ETA " + ln.split("ETA ")[-1])
               for ln in lines if "oom" in ln), text
    assert "Traceback" not in text
    beat = json.loads((tmp_path / ".work/status.json").read_text())
    assert beat["state"] == "finished" and beat["runs_done"] == 2 and beat["pid"] == os.getpid()
    # what this host measured seeds the next command's estimate
    assert "start_s" in json.loads((tmp_path / ".work/timings.json").read_text())["twin"]


def test_eta_counts_the_starts_and_runs_left(tmp_path):
    p = progress.Progress("sweep", "e", "predict", tmp_path, stream=None, window_s=10)
    points = [FakePoint({"x": v}) for v in range(4)]
    p.begin(points, points, groups=4)
    assert p.eta() == pytest.approx(4 * (10 + progress.DEFAULT_RUN_EXTRA_S["predict"]))
    p.run_times = [2.0]
    p.done_runs = 1
    assert p.eta() == pytest.approx(3 * 2.0)


def test_closing_table_marks_the_best(tmp_path):
    # The console prints the page's own table (reports.console): read from the store, the best
    # by the one rule, runs counted as the page counts them ("0 of 1").
    from vllm_lab import scenarios
    from vllm_lab.reports import console
    from vllm_lab.store import RunRecord, Store, run_identity

    store = Store(tmp_path / "lab.db")
    store.create_experiment("s", "sweep", "default", {"param": "max-num-seqs"})
    for seqs, status, figures in ((8, "ok", {"output_throughput": 100.0, "goodput": 1.0}),
                                  (16, "ok", {"output_throughput": 200.0, "goodput": 2.0}),
                                  (32, "oom", {})):
        record = scenarios.resolve("default", "h200").with_serve(**{"max-num-seqs": seqs}).to_record()
        store.record_run(RunRecord(
            experiment_id="s", run_key=run_identity(record, 0), step="sweep", scenario_name="default",
            scenario=record, status=status, started=1.0, ended=61.0, point={"max-num-seqs": seqs},
            repeat=0, host="h", gpu_model="h200", gpu_count=1, vllm_version="0.26.0", backend="twin",
            error="" if status == "ok" else "oom: KV cache",
            summary={"ttft_p50": 0.1, "tpot_p50": 0.01, "meets_slo": True, **figures} if figures else {}))
    store.close()
    out = io.StringIO()
    progress.closing_table(console.results(tmp_path / "lab.db", "s"), out, plain=True)
    text = out.getvalue()
    assert "max-num-seqs=16 (best)" in text and "best: max-num-seqs=16" in text
    assert re.search(r"max-num-seqs=32\s+0 of 1.*oom", text)


def test_live_figures_read_whole_lines_only(tmp_path):
    (tmp_path / "w.jsonl").write_text(json.dumps({"status": "ok", "output_tokens": 10}) + "\n"
                                      + json.dumps({"status": "error", "output_tokens": 0}) + "\n"
                                      + '{"status": "o')
    live = LiveFigures(tmp_path)
    time.sleep(0.01)
    fig = live.read()
    assert (fig["requests"], fig["errors"]) == (2, 1) and fig["tok_s"] > 0
    with open(tmp_path / "w.jsonl", "a") as fh:
        fh.write('k", "output_tokens": 5}\n')
    assert live.read()["requests"] == 3 and live.tokens == 15


@pytest.mark.integration
def test_status_running_and_last_seen(tmp_path):
    p = progress.Progress("baseline", "exp-2", "vllm", tmp_path, stream=None, window_s=60)
    points = [FakePoint({}, r) for r in range(3)]
    p.begin(points, points, groups=1)
    p.point_started({}, 0, "gpu-1")
    p.phase("starting")
    now = time.time()
    text = progress.describe_status(tmp_path, now=now)
    assert text.startswith("running: baseline experiment exp-2")
    assert "point 1/1 defaults · run 1/3: starting since" in text
    p.finish()
    text = progress.describe_status(tmp_path, {"id": "exp-2", "step": "baseline", "statuses": {"ok": 1}})
    assert text.startswith("not running; last seen") and "finished after 0/3 runs" in text
    assert "store: newest experiment exp-2 (baseline): 1 ok" in text
    # a process that died without finishing: its pid is gone
    beat = json.loads((tmp_path / ".work/status.json").read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    beat.update(state="running", pid=dead.pid)
    (tmp_path / ".work/status.json").write_text(json.dumps(beat))
    assert "its process is gone" in progress.describe_status(tmp_path)
    assert progress.describe_status(tmp_path / "none").startswith("not running: no lab command")


def make(*args: str, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = ["make", "-s", *args, f"LAB_PYTHON={sys.executable}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color"}
    env.pop("CI", None)
    if kw.get("background"):
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.integration
def test_piped_sweep_is_plain_and_make_status_follows_it(tmp_path):
    """A piped `make sweep` (a terminal's TERM, but stdout is a pipe): no escape codes, point i/N;
    `make status` during the run says running, after it says not running and when it was seen."""
    # The scenario's own max-num-seqs is one of the four: no reference point joins them.
    sweep = make("sweep", "PARAM=max-num-seqs", "BACKEND=predict", "VALUES=8,16,32,64",
                 "SET=serve.max-num-seqs=64", "REPEATS=24", f"OUT={tmp_path}", background=True)
    beat = tmp_path / ".work/status.json"
    during, still = "", False
    try:
        deadline = time.time() + 120
        while time.time() < deadline and sweep.poll() is None:
            if beat.exists() and json.loads(beat.read_text()).get("runs_done", 0) >= 1:
                during = make("status", f"OUT={tmp_path}").stdout
                # Still running once status has answered: it was running the whole time it looked.
                still = json.loads(beat.read_text())["state"] == "running"
                break
            time.sleep(0.05)
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, 9)
    assert sweep.returncode == 0, out
    assert "\x1b" not in out
    assert re.search(r"^\d\d:\d\d:\d\d point 1/4 max-num-seqs=8 · run 1/24: \d+ tok/s", out, re.MULTILINE), out
    assert "point 4/4 max-num-seqs=64 · run 24/24" in out
    assert re.search(r"^best: max-num-seqs=\d+$", out, re.MULTILINE) and out.rstrip().splitlines()[-1].startswith("report: ")
    if during and still:  # the plan can outrun a make start on a fast host: then only "after"
        assert "running: sweep experiment sweep-default-max-num-seqs-" in during, during
        assert re.search(r"point \d/4 max-num-seqs=\d+ · run \d+/24", during), during
    after = make("status", f"OUT={tmp_path}")
    assert after.returncode == 0, after.stderr
    assert after.stdout.startswith("not running; last seen") and "finished after 96/96 runs" in after.stdout
    assert "store: newest experiment sweep-default-max-num-seqs-" in after.stdout


def test_live_reaches_the_lab_as_switches():
    from vllm_lab import cli
    argv, _ = cli.make_argv("sweep", {"LAB_MAKE_PARAM": "max-num-seqs", "LAB_MAKE_LIVE": "1",
                                      "LAB_MAKE_LIVE_HOST": "0.0.0.0"})
    args = cli.build_parser().parse_args(argv)
    assert args.live and args.live_host == "0.0.0.0"
    argv, _ = cli.make_argv("status", {"LAB_MAKE_OUT": "elsewhere"})
    assert argv == ["status", "--out=elsewhere"]
    with pytest.raises(cli.UsageError, match="LIVE="):
        cli.make_argv("sweep", {"LAB_MAKE_PARAM": "max-num-seqs", "LAB_MAKE_LIVE": "maybe"})


def _lab(argv: list[str], capsys) -> tuple[int, str]:
    from vllm_lab import cli
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("make_it, says", [
    (lambda p: os.mkfifo(p), "a FIFO; the status file must be a regular file"),
    (lambda p: p.write_text('{"state": "fini'), "not the JSON record the lab writes"),
    (lambda p: p.write_text('{"state": "finished", "updated": 1e400}'), "a field is not what"),
    (lambda p: p.write_text('{"state": "finished", "started": "x"}'), "a field is not what"),
    (lambda p: p.write_text("[]"), "not the JSON record the lab writes"),
])
def test_a_status_file_that_is_no_record_is_one_sentence_never_a_hang(tmp_path, capsys, make_it, says):
    (tmp_path / ".work").mkdir()
    make_it(tmp_path / ".work" / "status.json")
    rc, err = _lab(["status", "--out", str(tmp_path)], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("lab: "), err
    assert says in err and "status.json" in err and "delete it" in err


def test_a_fifo_or_garbage_as_the_timings_file_costs_an_estimate_not_a_hang(tmp_path, capsys):
    work = tmp_path / ".work"
    work.mkdir()
    os.mkfifo(work / progress.TIMINGS_FILE)
    p = progress.Progress("sweep", "exp-1", "predict", tmp_path, stream=None, window_s=5)
    assert p._read_timings() == {}
    (work / progress.TIMINGS_FILE).unlink()
    (work / progress.TIMINGS_FILE).write_text('{"predict": {"run_s": 1e400, "start_s": "x"}}')
    assert p._read_timings() == {}
    os.unlink(work / progress.TIMINGS_FILE)
    os.mkfifo(work / progress.TIMINGS_FILE)
    rc, err = _lab(["sweep", "--backend", "predict", "--hardware", "cpu-demo", "--out", str(tmp_path),
                    "--param", "max-num-seqs", "--values", "8", "--repeats", "1",
                    "--set", "load.shape.level=2", "--set", "load.stop.duration_s=2"], capsys)
    assert rc == 0, err
    assert (work / progress.TIMINGS_FILE).is_file()  # the FIFO replaced by the pace learned
