"""The twin's injected faults (--twin-fault): what a server that misbehaves sends, how the lab's
load generator names each failure, and a whole sweep with one point on such a server: recorded
failed with its cause, the other point kept, the report built, nothing left running."""

from __future__ import annotations

import http.client
import json
import sys

import pandas as pd
import pytest

from tests.support.processes import TwinProcess, private_inventory
from tests.support.sweep_run import REPO, SETS, sweep
from vllm_lab.store import Store
from vllm_lab.twin.cli_args import parse_serve_args


def stream(url: str, prompt: str = "hello there") -> tuple[int, list[bytes], bool]:
    """One streamed completion: its status, the SSE data lines it sent and whether it ended
    cleanly (the body's end reached, not the connection cut)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "llama-3-8b", "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        try:
            data, whole = resp.read(), True
        except http.client.IncompleteRead as cut:  # the chunked body ended before its last chunk
            data, whole = cut.partial, False
        lines = [x[5:].strip() for x in data.split(b"\n") if x.startswith(b"data:")]
        return resp.status, lines, whole
    finally:
        conn.close()


def test_an_unknown_fault_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["serve", "m", "--twin-fault", "ok,explode"])
    assert e.value.code == 2
    assert "invalid choice: 'explode' (choose from ok, http500, malformed, broken" in capsys.readouterr().err
    assert parse_serve_args(["serve", "m", "--twin-fault", "http500, broken"]).faults == ("http500", "broken")
    assert parse_serve_args(["serve", "m", "--twin-fault", "ok"]).faults == ()


@pytest.mark.integration
def test_each_fault_is_dealt_in_turn_and_the_server_stays_healthy(tmp_path):
    twin = TwinProcess(tmp_path, "--twin-fault", "ok,http500,malformed,broken")
    try:
        ok, failed, malformed, broken, again = (stream(twin.url) for _ in range(5))
        # ok: every event JSON, then [DONE].
        assert ok[0] == 200 and ok[2] and ok[1][-1] == b"[DONE]"
        assert all(json.loads(x) for x in ok[1][:-1])
        # http500: vLLM's error body, nothing streamed.
        assert failed[0] == 500 and failed[1] == []
        # malformed: one event that is not JSON after the first token; the stream goes on to [DONE].
        bad = [x for x in malformed[1] if x != b"[DONE]" and not _is_json(x)]
        assert malformed[0] == 200 and len(bad) == 1 and malformed[1][-1] == b"[DONE]"
        assert _is_json(malformed[1][0])  # the first token came first
        # broken: the first token, then the connection closed: no [DONE], the body cut.
        assert broken[0] == 200 and not broken[2] and b"[DONE]" not in broken[1]
        assert len(broken[1]) == 1 and _is_json(broken[1][0])
        # The deal starts over, and the server answered throughout.
        assert again[0] == 200 and again[1][-1] == b"[DONE]"
        assert twin.proc.poll() is None and "Traceback" not in twin.output()
    finally:
        twin.stop()


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


@pytest.mark.integration
def test_the_load_generator_names_each_injected_failure(tmp_path):
    """Locust against the faulty twin: each request recorded, each failure classified."""
    from vllm_lab.traffic import Load, Workload, run_load

    twin = TwinProcess(tmp_path, "--twin-fault", "ok,http500,malformed,broken")
    try:
        workload = Workload(source="synthetic", input={"mean": 8}, output={"mean": 4})
        load = Load(shape={"level": 1}, stop={"duration_s": 30, "max_requests": 8})
        result = run_load(twin.url, "llama-3-8b", workload, load, tmp_path / "run",
                          scrape_metrics=False)
    finally:
        twin.stop()
    df = result.samples.sort_values("index")
    # One user sends one request at a time: the deal is the order of sends.
    got = list(zip(df["status"], df["error"], df["http_status"].fillna(0).astype(int)))
    assert got[:4] == [("ok", "", 200), ("error", "http_error", 500), ("error", "broken_stream", 200),
                       ("error", "broken_stream", 200)], got


# `vllm serve --config FILE` as the inventory's vllm_executable: the twin itself, told to inject
# faults when the config holds the faulty point's max-num-seqs; its pid written first (it execs:
# that pid is the server's, the leader of its own group).
FAULTY_TWIN = '''#!{python}
import os, sys, yaml
cfg = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
with open({pids!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
faults = ["--twin-fault", {faults!r}] if cfg.get("max-num-seqs") == {faulty} else []
os.environ["PYTHONPATH"] = {repo!r}
os.execv(sys.executable, [sys.executable, "-m", "vllm_lab.twin.server", *sys.argv[1:], *faults])
'''


@pytest.mark.integration
@pytest.mark.slow
def test_a_sweep_records_a_point_whose_server_fails_its_requests_keeps_the_other_and_reports(tmp_path):
    """`make sweep` on two points, the second served by a twin that answers 500s, sends events
    that are not JSON and closes streams early: that point is recorded failed with its cause, the
    first is measured as usual, the sweep ends 0 with its report, and nothing is left running."""
    pids, fake = tmp_path / "servers.pids", tmp_path / "vllm"
    fake.write_text(FAULTY_TWIN.format(python=sys.executable, pids=str(pids), faulty=4,
                                       faults="http500,malformed,broken", repo=str(REPO)))
    fake.chmod(0o755)
    inv = private_inventory(tmp_path, vllm_executable=str(fake))
    with sweep(tmp_path, inv, "faulty", "max-num-seqs", "2,4", SETS, pids=pids) as run:
        output, out = run.output, run.out
        assert run.returncode == 0, output  # a failed point is data: the sweep itself succeeded
        assert "Traceback" not in output, output
        with Store(out / "lab.db") as store:
            runs = store.runs("faulty")
            by_value = {r["point"]["max-num-seqs"]: r for _, r in runs.iterrows()}
            faulty = store.samples("faulty", by_value[4]["run_key"])
        assert sorted(by_value) == [2, 4], output
        assert by_value[2]["status"] == "ok", by_value[2]["error"]
        status, error = by_value[4]["status"], by_value[4]["error"]
        assert status == "failed-requests" and "requests failed (100%)" in error, error
        # Each request's failure as the client read it: the 500s, the cut and the malformed streams.
        assert set(faulty["error"]) == {"http_error", "broken_stream"}, faulty["error"].value_counts()
        assert set(faulty.loc[faulty["error"] == "http_error", "http_status"]) == {500}
        # The console says which point failed and why; the report is built from both.
        assert "failed-requests" in output and "requests failed" in output, output
        index = out / "faulty/index.html"
        assert f"report: {index}" in output and index.is_file()
        table = pd.read_csv(out / "faulty/summary.csv").set_index("max-num-seqs")
        assert sorted(table.index) == [2, 4] and table.loc[4, "status"] == "failed-requests"
        # Nothing the test started is left: the lab's process group, each Locust's, both servers.
        assert run.groups and len(run.servers) == 2
        assert run.left_behind() == {}
