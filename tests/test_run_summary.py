"""The typed run summary: generated from the one catalog, every key the lab writes in it, a stored
summary's unknown keys kept, a misspelled name an error, the run's status typed."""

import json

import pandas as pd
import pytest

from vllm_lab import audit
from vllm_lab.backends import Measurement, PredictBackend
from vllm_lab.failures import request_failures
from vllm_lab.run_summary import FIELDS, RunSummary
from vllm_lab.scenarios import resolve
from vllm_lab.store import STATUSES, RunRecord, RunStatus, Store, run_identity
from vllm_lab.summary import CATALOG, FACTS, summarize


def test_every_entry_of_the_catalog_is_a_typed_attribute_described_by_it():
    assert set(FIELDS) == set(CATALOG) | {f.name for f in FACTS}
    s = RunSummary()
    assert all(getattr(s, name) is None for name in FIELDS) and s.record() == {}
    assert RunSummary.describe("goodput") == f"{CATALOG['goodput'].label} (req/s)"
    with pytest.raises(AttributeError):
        s.goodputt = 1.0  # a misspelled name is an error, not a new key
    with pytest.raises(KeyError, match="not a summary metric"):
        s.figure("goodputt")


def test_every_key_the_lab_writes_is_in_the_catalog():
    """What summarize, the audit, the failure count and the predictor write: nothing left over."""
    m = PredictBackend().measure(resolve("default", overrides=["load.shape.level=4"]), None, None)
    assert m.status == RunStatus.OK and m.summary.extra == {}, m.summary.extra
    assert m.summary.goodput > 0 and m.summary.meets_slo in (True, False)
    figures = summarize(m.samples.assign(worker=0, user=m.samples.index % 4), resolve("default").slo)
    assert RunSummary.of(figures).extra == {}
    view = audit.ServerView(10, 1000, 500, {k: 0.1 for k in audit.HISTOGRAMS},
                            {f"{k}_p{q}": 0.1 for k in audit.HISTOGRAMS for q in (50, 99)}, 5.0)
    check = audit.Audit({}, {}, 0.01, 0.02, 0.0, True, "late")
    failures = request_failures(pd.DataFrame({"status": ["ok", "error"], "error": ["", "http_error"],
                                              "http_status": [200, 401]}))
    for part in (view.as_summary(), check.as_summary(), failures.as_summary()):
        assert RunSummary.of(part).extra == {}, part


def test_a_stored_summary_keeps_keys_outside_the_catalog(tmp_path):
    """A store written by another lab holds keys this catalog does not know: they are read,
    kept, and written back as they were; the catalog's columns come back into the summary."""
    scenario = resolve("default")
    with Store(tmp_path / "lab.db") as store:
        store.create_experiment("e", "sweep", "default")
        store.record_run(RunRecord(
            experiment_id="e", run_key=run_identity(scenario.to_record(), 0), step="sweep",
            scenario_name="default", scenario=scenario.to_record(), status="ok", started=1.0,
            ended=2.0, summary={"output_throughput": 12.5, "meets_slo": True, "from_before": [1, 2]}))
        row = store.runs("e").iloc[0]
    assert row["summary"] == {"meets_slo": True, "from_before": [1, 2]}  # as the store keeps it
    s = RunSummary.of_row(row)
    assert s.output_throughput == 12.5 and s.meets_slo and s.extra == {"from_before": [1, 2]}
    assert json.loads(json.dumps(s.record())) == {"output_throughput": 12.5, "meets_slo": True,
                                                  "from_before": [1, 2]}
    assert s["output_throughput"] == 12.5 and dict(s) == s.record()  # a mapping of its entries


def test_a_run_status_is_one_of_the_stores():
    assert [str(s) for s in STATUSES] == ["ok", "failed-start", "oom", "crashed", "timeout",
                                          "client-limited", "failed-requests", "unreachable",
                                          "unsteady", "unaudited", "loadgen-failed"]
    assert Measurement("oom", 0.0, 1.0).status is RunStatus.OOM
    with pytest.raises(ValueError):
        Measurement("fine", 0.0, 1.0)
