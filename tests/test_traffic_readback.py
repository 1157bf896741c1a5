"""What Locust leaves in a run's folder under OUT/.work, read back bounded and without blocking: a
FIFO, a huge file, a link or a torn record in place of a file Locust writes is one sentence (the run
loadgen-failed) or left out with a line saying so, never a hang, a traceback or a write through
it; the lab makes each of its own files fresh before Locust starts."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from vllm_lab.traffic import runner, samples
from vllm_lab.traffic.runner import TrafficError
from vllm_lab.traffic.spec import Load, Workload

ROW = {"request_id": "w-0-0", "index": 0, "turn": 0, "worker": "w", "start_ts": 1.0,
       "scheduled_ts": 1.0, "sched_lag_s": 0.001, "ttft_s": 0.1, "e2e_s": 0.5, "itl_s": [0.01],
       "output_tokens": 4, "prompt_tokens": 8, "status": "ok", "error": ""}
SUMMARY = {"worker": "w", "loop_lag": {"p99": 0.002}, "cpu_fraction": 0.3}


def finishes(fn, *args):
    """fn(*args) run in a thread: its result, or a failure when it is still blocked after 60 s (a
    bound far past any read here: it catches a hang, it measures nothing)."""
    box: dict = {}

    def call():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test below
            box["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{fn.__name__} blocked"
    if "error" in box:
        raise box["error"]
    return box["result"]


def run_folder(tmp_path: Path, rows: int = 3) -> Path:
    out = tmp_path / "run"
    (out / "samples").mkdir(parents=True)
    lines = [json.dumps({**ROW, "index": i, "request_id": f"w-{i}-0", "start_ts": 1.0 + i})
             for i in range(rows)]
    (out / "samples" / "w.jsonl").write_text("\n".join(lines) + "\n")
    (out / "samples" / "w.summary.json").write_text(json.dumps(SUMMARY))
    (out / "stop_reason.json").write_text(json.dumps({"reason": "duration"}))
    return out


def result(out: Path, rc: int = 0, tail: str = ""):
    return finishes(runner._result, out, rc, tail, pd.DataFrame(), Load(), Workload())


def test_a_run_folder_as_locust_leaves_it_is_read_whole(tmp_path):
    r = result(run_folder(tmp_path))
    assert len(r.samples) == 3 and r.stop_reason == "duration"
    assert r.loop_lag_p99_s == 0.002 and r.cpu_fraction_max == 0.3 and len(r.workers) == 1


def huge(path: Path) -> None:
    with open(path, "wb") as f:  # sparse: a size past the bound, no disk taken
        f.truncate(runner.samples_mod.RECORD_BYTES + 1)


@pytest.mark.parametrize("make, says", [
    (os.mkfifo, "a FIFO; the worker summary must be a regular file"),
    (huge, "MiB; the worker summary may hold at most 1 MiB"),
    (lambda p: p.write_text('{"worker": "w", "loop_lag": {"p9'), "not the JSON object of a worker summary"),
    (lambda p: p.write_text('[' * 100_000), "not the JSON object of a worker summary"),
    (lambda p: p.write_text(json.dumps({**SUMMARY, "cpu_fraction": "high"})),
     "no event-loop lag p99 and CPU fraction (numbers >= 0)"),
    (lambda p: p.symlink_to("/dev/zero"), "a symbolic link; the worker summary is a file Locust writes"),
])
def test_a_worker_summary_that_is_no_record_is_left_out_with_a_line_saying_so(tmp_path, capsys, make, says):
    out = run_folder(tmp_path)
    path = out / "samples" / "w.summary.json"
    path.unlink()
    make(path)
    r = result(out)
    # The samples are kept; that worker's health is unknown, as a killed worker's is.
    assert len(r.samples) == 3 and r.workers == [] and r.loop_lag_p99_s == 0.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"traffic: {path}: ") and says in err[0], err
    assert "left out of the client's health" in err[0]


@pytest.mark.parametrize("make", [os.mkfifo, huge, lambda p: p.write_text('{"reason": ["x"]}'),
                                  lambda p: p.symlink_to("/dev/zero")])
def test_a_stop_reason_that_cannot_be_read_is_unknown(tmp_path, capsys, make):
    out = run_folder(tmp_path)
    path = out / "stop_reason.json"
    path.unlink()
    make(path)
    assert result(out).stop_reason == "unknown"
    err = capsys.readouterr().err
    assert err.startswith(f"traffic: {path}: ") and err.count("\n") == 1, err
    path.unlink()
    assert result(out).stop_reason == "killed"  # none written: Locust did not end the run itself


@pytest.mark.parametrize("make, says", [
    (os.mkfifo, "a FIFO; the samples file must be a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), "a symbolic link among the run's samples"),
    (lambda p: p.write_text(json.dumps({**ROW, "ttft_s": "fast"}) + "\n"),
     "column 'ttft_s' holds a value that is not a number"),
    (lambda p: p.write_text(json.dumps({**ROW, "prompt_tokens": 10**30}) + "\n"),
     "column 'prompt_tokens' holds a value that is not a whole number"),
    (lambda p: p.write_text(json.dumps({**ROW, "itl_s": 3}) + "\n"),
     "column 'itl_s' holds a value that is not a list of seconds"),
])
def test_a_samples_file_that_is_no_samples_fails_the_run_in_one_sentence(tmp_path, make, says):
    out = run_folder(tmp_path)
    make(out / "samples" / "x.jsonl")
    with pytest.raises(TrafficError) as e:
        result(out)
    message = str(e.value)
    assert message.startswith("the run's samples cannot be read: ") and says in message, message
    assert "\n" not in message


def test_lines_no_worker_writes_are_passed_over(tmp_path):
    out = run_folder(tmp_path)
    with open(out / "samples" / "w.jsonl", "a") as f:
        f.write("[1, 2]\n" + '{"index": ' + "9" * 5000 + "}\n" + "[" * 100_000 + "\n" + '{"torn": ')
    assert len(result(out).samples) == 3


@pytest.mark.integration
def test_locust_output_is_shown_by_its_end_read_from_the_labs_own_file(tmp_path):
    """A Locust that fails with no samples: its output's last 2000 bytes in the error, read from
    the file the lab made (whatever took its name since is not read)."""
    out = runner._fresh_out_dir(tmp_path / "run")
    noisy = "import sys; print('x' * 100_000); print('the last words'); sys.exit(3)"
    load = Load(stop={"duration_s": 1}, request_timeout_s=1)
    rc, tail = finishes(runner._run_locust, [sys.executable, "-c", noisy], dict(os.environ), out,
                        load, [], 1, lambda h, first: [], None)
    assert rc == 3 and tail.endswith("the last words\n") and len(tail) == runner.TAIL_BYTES
    (out / "locust.stdout").unlink()
    os.mkfifo(out / "locust.stdout")  # read by name, this would wait for a writer
    with pytest.raises(TrafficError, match="locust exited with 3 and wrote no samples") as e:
        result(out, rc, tail)
    assert str(e.value).endswith("the last words\n")


def test_the_run_folder_is_made_fresh_and_nothing_is_written_through_what_was_there(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    (out / "traffic_config.json").symlink_to(victim / "keep")
    os.mkfifo(out / "locust.stdout")
    os.mkfifo(out / "locust.log")
    (out / "samples").symlink_to(victim)
    (out / "stop_reason.json").write_text(json.dumps({"reason": "duration"}))
    out = finishes(runner._fresh_out_dir, out)
    cfg = finishes(runner._write_config, out, {"base_url": "http://x"})
    assert json.loads(cfg.read_text()) == {"base_url": "http://x"} and not cfg.is_symlink()
    assert (cfg.stat().st_mode & 0o777) == 0o600
    assert (out / "samples").is_dir() and not (out / "samples").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["samples", "traffic_config.json"]
    assert (victim / "keep").read_text() == "mine" and sorted(p.name for p in victim.iterdir()) == ["keep"]


def test_a_name_taken_between_the_clearing_and_the_write_is_one_sentence(tmp_path):
    out = runner._fresh_out_dir(tmp_path / "run")
    (out / "traffic_config.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TrafficError, match="appeared while the run was being set up"):
        runner._write_config(out, {})
    assert not (tmp_path / "elsewhere").exists()


def test_live_figures_read_only_regular_sample_files(tmp_path):
    (tmp_path / "w.jsonl").write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "status": "error"}) + "\n")
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "w.jsonl")
    (tmp_path / "junk.jsonl").write_text('[1]\n{"output_tokens": ' + "9" * 5000 + "}\n"
                                         + "[" * 100_000 + "\n")
    figures = finishes(samples.LiveFigures(tmp_path).read)
    # Two samples, once each: the link is not followed, the FIFO not opened, the junk not counted.
    assert figures["requests"] == 2 and figures["errors"] == 1


@pytest.mark.integration
def test_a_run_into_a_folder_strewn_with_fifos_and_links_measures_as_usual(tmp_path):
    """FIFOs where Locust and the lab write their files, links where the config and the samples
    go: the run neither waits on a FIFO nor writes through a link, and reads its samples whole."""
    from tests.support.processes import TwinProcess

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    for name in ("locust.stdout", "locust.log", "stop_reason.json", "locust_stats.csv"):
        os.mkfifo(out / name)
    (out / "traffic_config.json").symlink_to(victim / "keep")
    (out / "samples").symlink_to(victim)
    twin = TwinProcess(tmp_path)
    try:
        r = finishes(runner.run_load, twin.url, "llama-3-8b",
                     Workload(source="synthetic", input={"mean": 8}, output={"mean": 4}),
                     Load(shape={"level": 1}, stop={"duration_s": 30, "max_requests": 4}), out)
    finally:
        twin.stop()
    assert len(r.samples) >= 4 and set(r.samples["status"]) == {"ok"} and r.stop_reason == "max_requests"
    assert (victim / "keep").read_text() == "mine" and sorted(p.name for p in victim.iterdir()) == ["keep"]
    assert all(p.is_file() and not p.is_symlink() for p in out.iterdir() if p.name != "samples")
