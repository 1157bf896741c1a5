"""The results store: round trip, two writers, interruption, resume, newer-schema refusal."""

import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from vllm_lab.store import SCHEMA_VERSION, RunRecord, Store, StoreError, run_identity


def make_run(exp: str, key: str, status: str = "ok", **summary) -> RunRecord:
    return RunRecord(experiment_id=exp, run_key=key, step="sweep", scenario_name="default",
                     scenario={"serve": {"max-num-seqs": 8}}, status=status, started=time.time(),
                     ended=time.time() + 1, point={"max-num-seqs": 8}, host="localhost",
                     gpu_model="H200", gpu_count=1, vllm_version="0.26.0", backend="twin",
                     summary={"output_throughput": 123.5, "ttft_p50": 0.1, "extra": "kept", **summary})


def samples(n: int = 5) -> pd.DataFrame:
    return pd.DataFrame({"request_id": [f"r{i}" for i in range(n)], "ttft_s": [0.1 + i / 1e6 for i in range(n)],
                         "itl_s": [[0.01, 0.02]] * n})


def test_round_trip(tmp_path):
    store = Store(tmp_path / "lab.db")
    store.create_experiment("e1", "sweep", "default", {"param": "max-num-seqs"})
    metrics = pd.DataFrame({"ts": [1.0, 2.0], "name": ["vllm:num_requests_waiting"] * 2,
                            "labels": ["", ""], "value": [3.0, 4.0]})
    store.record_run(make_run("e1", "k1"), samples(), metrics)
    runs = store.runs("e1")
    assert len(runs) == 1 and runs.loc[0, "output_throughput"] == 123.5
    assert runs.loc[0, "point"] == {"max-num-seqs": 8} and runs.loc[0, "summary"] == {"extra": "kept"}
    back = store.samples("e1", "k1")
    pd.testing.assert_frame_equal(back[["request_id", "ttft_s"]], samples()[["request_id", "ttft_s"]])
    assert list(back.loc[0, "itl_s"]) == [0.01, 0.02]  # unrounded lists survive
    assert store.server_metrics("e1", "k1")["value"].tolist() == [3.0, 4.0]
    assert store.experiment("e1")["meta"] == {"param": "max-num-seqs"}
    assert store.finished_keys("e1") == {"k1"}


def test_a_store_closes_at_the_end_of_its_with_block_however_it_ends(tmp_path):
    with Store(tmp_path / "lab.db") as store:
        store.create_experiment("e", "sweep", "default")
    with pytest.raises(sqlite3.ProgrammingError):
        store.experiments()  # closed
    with pytest.raises(StoreError), Store(tmp_path / "lab.db") as store:
        store.experiment("missing")
    with pytest.raises(sqlite3.ProgrammingError):
        store.experiments()


def test_run_identity_is_stable_and_ignores_provenance():
    a = run_identity({"serve": {"x": 1}, "sources": ["a.yaml"]}, 0)
    assert a == run_identity({"serve": {"x": 1}, "sources": ["b.yaml"]}, 0)
    assert a != run_identity({"serve": {"x": 1}}, 1) and a != run_identity({"serve": {"x": 2}}, 0)


def test_a_run_setting_added_later_keeps_older_runs_identity_at_its_default():
    from vllm_lab import scenarios

    now = scenarios.resolve("default").to_record()
    before = {**now, "run": {k: v for k, v in now["run"].items() if k != "warmup_runs"}}
    assert run_identity(now, 0) == run_identity(before, 0)  # an older experiment resumes
    warmed = {**now, "run": {**now["run"], "warmup_runs": 1}}
    assert run_identity(warmed, 0) != run_identity(now, 0)  # another way of measuring


def test_bad_status_and_step_are_refused(tmp_path):
    store = Store(tmp_path / "lab.db")
    with pytest.raises(StoreError, match="not one of"):
        store.create_experiment("e", "guess", "default")
    store.create_experiment("e", "sweep", "default")
    with pytest.raises(StoreError, match="run status 'fine'"):
        store.record_run(make_run("e", "k", status="fine"))
    assert store.runs("e").empty


def _writer(path, exp, n):
    store = Store(path)
    store.create_experiment(exp, "sweep", "default")
    for i in range(n):
        store.record_run(make_run(exp, f"{exp}-{i}"), samples(3))


def test_two_writers_at_once(tmp_path):
    path = tmp_path / "lab.db"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, f"w{j}", 25)) for j in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    runs = Store(path).runs()
    assert len(runs) == 50 and runs["run_key"].nunique() == 50


def _interrupted_writer(path):
    store = Store(path)
    store.create_experiment("e", "sweep", "default")
    store.record_run(make_run("e", "done"), samples())
    # Die in the middle of the next run's transaction: the row must not appear.
    store._conn.execute("BEGIN IMMEDIATE")
    store._conn.execute("INSERT INTO runs (experiment_id, run_key, step, scenario_name, scenario_json,"
                        " status, started, ended) VALUES ('e', 'half', 'sweep', 'd', '{}', 'ok', 0, 0)")
    os._exit(1)


def test_interrupted_run_loses_only_itself(tmp_path):
    path = tmp_path / "lab.db"
    p = multiprocessing.get_context("spawn").Process(target=_interrupted_writer, args=(path,))
    p.start()
    p.join(60)
    store = Store(path)
    assert store.finished_keys("e") == {"done"}  # resume measures "half" again
    assert len(store.samples("e", "done")) == 5


def test_newer_schema_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "lab.db"
    Store(path).create_experiment("e", "sweep", "default")
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than"):
        Store(path)
    assert path.read_bytes() == before


@pytest.mark.integration
@pytest.mark.untimed
def test_read_only_folder_is_one_sentence_and_keeps_the_store(tmp_path):
    folder = tmp_path / "reports"
    Store(folder / "lab.db").create_experiment("e", "sweep", "default")
    # chattr +i makes the folder read-only even for root (CI runs as root).
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode:
        pytest.skip("chattr +i is not permitted here")
    try:
        with pytest.raises(StoreError, match="not writable"):
            Store(folder / "other.db")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert Store(folder / "lab.db").experiment("e")["step"] == "sweep"


def test_not_a_database(tmp_path):
    path = tmp_path / "lab.db"
    path.write_text("this is not sqlite")
    with pytest.raises(StoreError, match="not a lab database"):
        Store(path)
    assert path.read_text() == "this is not sqlite"


def test_newest_experiment_by_prefix(tmp_path):
    store = Store(tmp_path / "lab.db")
    assert store.newest_experiment() is None
    store.create_experiment("sweep-a-1", "sweep", "default")
    time.sleep(0.01)
    store.create_experiment("sweep-b-1", "sweep", "default")
    assert store.newest_experiment() == "sweep-b-1"
    assert store.newest_experiment("sweep-a-") == "sweep-a-1"
    assert store.newest_experiment("SWEEP-A-") is None and store.newest_experiment("x") is None


def test_a_version_1_store_is_migrated_and_its_overloaded_runs_become_client_limited(tmp_path):
    # The committed H200 example was written by schema 1, which kept "client-overloaded" runs.
    old = Path(__file__).parent.parent / "reports/examples/h200-llama8b/lab.db"
    db = tmp_path / "lab.db"
    shutil.copy(old, db)
    before = sqlite3.connect(db).execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall()
    runs = Store(db).runs()
    assert dict(runs["status"].value_counts()) == {
        ("client-limited" if s == "client-overloaded" else s): n for s, n in before}
    assert sqlite3.connect(db).execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


def test_summary_columns_come_from_the_catalog_in_their_fixed_order():
    from vllm_lab import summary
    from vllm_lab.store import SUMMARY_COLUMNS
    # The column order of stores already written: a store exported with SELECT * relies on it.
    assert SUMMARY_COLUMNS == summary.COLUMNS == (
        "duration_s", "requests", "errors", "request_throughput", "output_throughput",
        "total_throughput", "goodput", "slo_attainment",
        "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
        "itl_p50", "itl_p90", "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99",
        "queue_len_mean", "queue_len_max", "kv_usage_mean", "kv_usage_max", "preemptions",
        "gpu_util_mean", "gpu_mem_used_max_gib")
    with pytest.raises(KeyError, match="ttft_p95"):
        summary.select("ttft_p50", "ttft_p95")
    assert summary.metric("ttft_p50").heading == "TTFT p50 ms" and summary.metric("ttft_p50").scale == 1000


def test_runs_between_relabel_and_sample_columns(tmp_path):
    store = Store(tmp_path / "lab.db")
    store.create_experiment("e1", "watch", "default")
    store.record_run(make_run("e1", "k1"), samples())
    store.record_run(make_run("e1", "k2"))
    t = store.runs("e1")["started"]
    assert len(store.runs_between(t.min(), t.max() + 1)) == 2
    assert store.runs_between(t.max() + 1, t.max() + 2).empty
    assert store.relabel_points("e1", {"max-num-seqs": 8}, {"role": "old-baseline"}) == 2
    assert store.runs("e1")["point"].tolist() == [{"role": "old-baseline"}] * 2
    assert list(store.samples("e1", "k1", columns=["request_id"]).columns) == ["request_id"]
    files = store.samples_files(store.runs("e1").sort_values("run_key"))
    assert files[0] is not None and files[0].exists() and files[1] is None
