"""Secrets and runs that measured nothing, without a server: redaction, the command-line refusal,
the failed-requests verdict and its hint, the store's new status, and the traffic config's key."""

import json
import sqlite3

import pandas as pd
import pytest

from vllm_lab import flags, scenarios, store
from vllm_lab.failures import request_failures
from vllm_lab.scenarios import ScenarioError
from vllm_lab.store import SCHEMA, SCHEMA_VERSION, RunRecord, Store, run_identity
from vllm_lab.traffic.spec import FAILED_REQUESTS_THRESHOLD, Load

KEY = "sk-unit-secret-5f3a"


def test_secret_flags_are_marked_and_redacted_at_any_depth_and_spelling():
    assert flags.FLAGS["api-key"].secret and not flags.FLAGS["max-num-seqs"].secret
    assert all(flags.is_secret(n) for n in ("api-key", "api_key", "vllm_api_key", "HF_TOKEN", "hf-token"))
    assert not any(flags.is_secret(n) for n in ("max-num-batched-tokens", "model", "tokenizer"))
    data = {"serve": {"model": "m", "api-key": KEY}, "base": {"serve": {"api_key": KEY}},
            "list": [{"vllm_api_key": KEY}], "empty": {"api-key": None}}
    out = flags.redact(data)
    assert KEY not in json.dumps(out) and out["serve"] == {"model": "m", "api-key": "***"}
    assert out["empty"] == {"api-key": None} and data["serve"]["api-key"] == KEY  # a copy


def test_a_secret_on_the_command_line_is_refused():
    with pytest.raises(ScenarioError, match="serve.api-key: a secret is not taken on the command line"):
        scenarios.resolve("default", overrides=[f"serve.api-key={KEY}"])


def test_the_threshold_is_per_scenario_and_left_out_of_the_record_at_its_default():
    assert "failed_requests_threshold" not in Load().model_dump(mode="json")  # run keys unchanged
    s = scenarios.resolve("default", overrides=["load.failed_requests_threshold=0.2"])
    assert s.load.failed_requests_threshold == 0.2
    assert s.to_record()["load"]["failed_requests_threshold"] == 0.2
    assert scenarios.resolve("default").load.failed_requests_threshold == FAILED_REQUESTS_THRESHOLD


def _samples(*rows):
    """rows: (count, error, http_status); error "" is a success."""
    out = []
    for n, error, code in rows:
        out += [{"status": "error" if error else "ok", "error": error, "http_status": code}] * n
    return pd.DataFrame(out)


def test_the_dominant_failure_and_its_hint():
    f = request_failures(_samples((100, "http_error", 401)))
    assert f.rate == 1.0 and f.dominant == "HTTP 401" and f.dominant_count == 100
    assert "serve.api-key" in f.message() and "vllm_api_key" in f.message() and "VLLM_API_KEY" in f.message()
    f = request_failures(_samples((90, "", 200), (8, "http_error", 0), (2, "http_error", 404)))
    assert f.failed == 10 and f.dominant == "no connection" and "reachable" in f.hint
    assert request_failures(_samples((5, "http_error", 503))).hint.startswith("the server answered")
    assert request_failures(pd.DataFrame()).rate == 1.0  # nothing sent: nothing measured


def test_timeouts_are_the_server_being_slow_not_failed_requests():
    # An overloaded stress level times out; that is its measurement, and the knee reads it.
    f = request_failures(_samples((50, "", 200), (50, "timeout", 0)))
    assert f.failed == 0 and f.rate == 0.0


def test_a_version_2_store_takes_the_new_status_and_keeps_its_runs(tmp_path):
    db = tmp_path / "lab.db"
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA.replace(", 'failed-requests'", ""))
    conn.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    conn.execute("INSERT INTO experiments VALUES ('e', 'sweep', 'default', 0, '{}')")
    conn.execute("INSERT INTO runs (experiment_id, run_key, step, scenario_name, scenario_json, status,"
                 " started, ended) VALUES ('e', 'k1', 'sweep', 'default', '{}', 'client-limited', 0, 1)")
    conn.commit()
    conn.close()
    st = Store(db)
    st.record_run(RunRecord("e", "k2", "sweep", "default", {}, "failed-requests", 1, 2))
    assert dict(zip(st.runs("e")["run_key"], st.runs("e")["status"])) == {
        "k1": "client-limited", "k2": "failed-requests"}
    assert set(store.LEFT_OUT) == {"client-limited", "failed-requests", "unsteady", "unaudited"}
    st.close()
    assert sqlite3.connect(db).execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)


def test_a_version_3_store_takes_the_unsteady_and_unaudited_statuses_and_keeps_its_runs(tmp_path):
    db = tmp_path / "lab.db"
    conn = sqlite3.connect(db)
    conn.executescript(SCHEMA.replace(", 'unsteady', 'unaudited'", ""))
    conn.execute("INSERT INTO meta VALUES ('schema_version', '3')")
    conn.execute("INSERT INTO experiments VALUES ('e', 'baseline', 'default', 0, '{}')")
    conn.execute("INSERT INTO runs (experiment_id, run_key, step, scenario_name, scenario_json, status,"
                 " started, ended) VALUES ('e', 'k1', 'baseline', 'default', '{}', 'ok', 0, 1)")
    conn.commit()
    conn.close()
    with Store(db) as st:
        st.record_run(RunRecord("e", "k2", "baseline", "default", {}, "unsteady", 1, 2))
        st.record_run(RunRecord("e", "k3", "baseline", "default", {}, "unaudited", 2, 3))
        assert list(st.runs("e")["status"]) == ["ok", "unsteady", "unaudited"]
    assert sqlite3.connect(db).execute("SELECT value FROM meta").fetchone()[0] == str(SCHEMA_VERSION)


def test_the_store_keeps_no_secret_and_the_run_key_is_no_hash_of_it(tmp_path):
    s = scenarios.resolve("default").with_serve(**{"api-key": KEY})
    st = Store(tmp_path / "lab.db")
    st.create_experiment("e", "tune", "default", {"base": s.to_record()})
    st.record_run(RunRecord("e", run_identity(s.to_record(), 0), "tune", "default", s.to_record(), "ok",
                            0, 1, point={"serve.api-key": KEY}))
    st.close()
    assert run_identity(s.to_record(), 0) == run_identity(s.with_serve(**{"api-key": "other"}).to_record(), 0)
    for path in tmp_path.iterdir():
        assert KEY.encode() not in path.read_bytes(), path


# -- one redaction for what is shown or kept: secret keys at any depth, a URL's userinfo -----------

def _lab(argv, capsys, env=None, monkeypatch=None):
    from vllm_lab import cli
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    rc = cli.main(argv)
    captured = capsys.readouterr()
    return rc, captured.err, captured.out


def _one_sentence(rc, err):
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("lab: "), (rc, err)
    assert "Traceback" not in err and "internal error" not in err


def test_a_url_keeps_no_userinfo_wherever_it_is_redacted():
    assert flags.redact_url("postgresql://u:s3cretPW@127.0.0.1:1/db") == "postgresql://***@127.0.0.1:1/db"
    assert flags.redact_url("see http://admin:p@ss@h:9/x and https://h/y") == \
        "see http://***@h:9/x and https://h/y"
    assert flags.redact({"storage": "mysql://root:pw@db/x", "n": 1}) == {"storage": "mysql://***@db/x", "n": 1}


def test_a_mapping_shown_in_an_error_hides_each_nested_secret(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text('serve: {model: "", api-key: sk-LEAKED-123, hf-token: hf_LEAKED}\n')
    rc, err, out = _lab(["show", "--scenario", str(path)], capsys)
    _one_sentence(rc, err)
    assert "serve.model is required" in err and "LEAKED" not in err + out


def test_a_space_refuses_a_secret_flag_and_choices_that_are_no_scalars(tmp_path, capsys):
    for body, says in (("space: {api-key: {choices: [a, b]}}", "key space.api-key: a secret is not searched"),
                       ("space: {max-num-seqs: {choices: [[1, 2], {a: 1}]}}",
                        "each of choices must be a number, a string, true/false or null"),
                       ("space: {max-num-seqs: {choices: [8]}}\nmeasure: {hf-token: [x]}",
                        "key measure.hf-token: a secret is not searched")):
        (tmp_path / "space.yaml").write_text(body + "\n")
        rc, err, _ = _lab(["tune", "--backend", "predict", "--hardware", "cpu-demo", "--trials", "1",
                           "--out", str(tmp_path / "out"), "--space", str(tmp_path / "space.yaml")], capsys)
        _one_sentence(rc, err)
        assert says in err
        assert not (tmp_path / "out" / "lab.db").exists()


def test_an_unreachable_study_storage_is_one_sentence_without_its_password(tmp_path, capsys):
    for url in ("postgresql://u:s3cretPW@127.0.0.1:1/db", "nonsense://u:s3cretPW@h/x", "no url at all"):
        rc, err, out = _lab(["tune", "--backend", "predict", "--hardware", "cpu-demo", "--trials", "1",
                             "--out", str(tmp_path), "--study-storage", url], capsys)
        _one_sentence(rc, err)
        assert "cannot reach the study storage" in err and "s3cretPW" not in err + out
        assert ("(password hidden)" in err) == ("@" in url)
        assert not (tmp_path / "lab.db").exists()  # refused before anything is recorded


def test_a_watched_urls_password_is_neither_shown_nor_kept(tmp_path, capsys):
    from vllm_lab import watch
    url = "http://admin:s3cretPW@127.0.0.1:9"
    assert watch.experiment_id(url) == watch.experiment_id("http://127.0.0.1:9") == "watch-127-0-0-1-9"
    rc, err, out = _lab(["watch", "--url", url, "--out", str(tmp_path)], capsys)
    _one_sentence(rc, err)
    assert "s3cretPW" not in err + out and "http://***@127.0.0.1:9" in err
    if (tmp_path / "lab.db").exists():
        with sqlite3.connect(tmp_path / "lab.db") as conn:
            assert not any("s3cretPW" in str(row) for row in conn.execute("SELECT * FROM experiments"))
