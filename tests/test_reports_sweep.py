"""vllm_lab.reports (the sweep and baseline builders): an experiment's report folder (index.html, report.md, summary.csv, PNGs) built
from a small store written here with the Store API, whose answers are known."""

from __future__ import annotations

import pandas as pd
import pytest

from vllm_lab import reports as report
from vllm_lab import scenarios
from vllm_lab.store import RunRecord, Store, StoreError, run_identity

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

T0 = 1_790_000_000.0
FIGURES = {"output_throughput": 1000.0, "request_throughput": 4.0, "goodput": 3.0, "slo_attainment": 0.9,
           "requests": 100.0, "ttft_p50": 0.1, "ttft_p90": 0.2, "ttft_p99": 0.4, "tpot_p50": 0.01,
           "tpot_p90": 0.015, "tpot_p99": 0.02, "e2e_p50": 1.0, "e2e_p90": 1.5, "e2e_p99": 2.0,
           "queue_len_mean": 0.1, "queue_len_max": 1.0, "kv_usage_mean": 0.3, "kv_usage_max": 0.5,
           "preemptions": 0.0, "meets_slo": True}


def _record(store: Store, exp: str, step: str, repeat: int = 0, point: dict | None = None,
            status: str = "ok", error: str = "", **figures) -> None:
    scenario = scenarios.resolve("default", "h200")
    if point:
        scenario = scenario.with_serve(**point)
    record = scenario.to_record()
    store.record_run(RunRecord(
        experiment_id=exp, run_key=run_identity(record, repeat), step=step, scenario_name="default",
        scenario=record, status=status, started=T0 + repeat, ended=T0 + repeat + 60, point=point or {},
        repeat=repeat, host="gpu-1", gpu_model="h200", gpu_count=1, vllm_version="0.26.0",
        backend="twin", error=error, summary={**FIGURES, **figures} if status == "ok" else {}))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """A sweep of max-num-seqs (8: slow, 16: best under the SLO, 32: fastest but misses it, 64: out
    of memory) with two repeats a point, a baseline of three runs, and an experiment with no run."""
    path = tmp_path_factory.mktemp("store") / "lab.db"
    store = Store(path)
    store.create_experiment("sweep-seqs", "sweep", "default", {"param": "max-num-seqs"})
    for repeat in (0, 1):
        _record(store, "sweep-seqs", "sweep", repeat, {"max-num-seqs": 8},
                output_throughput=500.0 + 10 * repeat, goodput=2.0)
        _record(store, "sweep-seqs", "sweep", repeat, {"max-num-seqs": 16},
                output_throughput=1000.0 + 10 * repeat, goodput=4.0)
        _record(store, "sweep-seqs", "sweep", repeat, {"max-num-seqs": 32},
                output_throughput=1500.0, goodput=1.0, ttft_p99=3.0, meets_slo=False)
        _record(store, "sweep-seqs", "sweep", repeat, {"max-num-seqs": 64}, status="oom",
                error="oom: CUDA out of memory. Tried to allocate 1002.00 MiB")
    store.create_experiment("baseline-h200", "baseline", "default")
    for repeat, throughput in enumerate((900.0, 1000.0, 1100.0)):
        _record(store, "baseline-h200", "baseline", repeat, output_throughput=throughput)
    store.create_experiment("not-yet", "sweep", "default", {"param": "max-num-seqs"})
    store.close()
    return path


@pytest.fixture(scope="module")
def sweep(store_path, tmp_path_factory):
    return report.build(store_path, "sweep-seqs", tmp_path_factory.mktemp("reports"))


def test_a_sweep_report_has_its_files(sweep):
    folder = sweep.parent
    assert sweep.name == "index.html" and folder.name == "sweep-seqs"
    for name in ("index.html", "report.md", "summary.csv", "throughput.png", "latency.png", "server.png"):
        assert (folder / name).stat().st_size > 0, name
    assert (folder / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_summary_has_one_row_per_point_with_the_means_of_ok_runs(sweep):
    table = pd.read_csv(sweep.parent / "summary.csv").set_index("max-num-seqs")
    assert list(table.index) == [8, 16, 32, 64]
    assert table.loc[16, "output_throughput"] == pytest.approx(1005.0)
    assert table.loc[16, "output_throughput_cv"] == pytest.approx(pd.Series([1000.0, 1010.0]).std() / 1005)
    assert list(table["runs"]) == [2, 2, 2, 2] and list(table["ok_runs"]) == [2, 2, 2, 0]
    assert table.loc[64, "status"] == "oom" and pd.isna(table.loc[64, "output_throughput"])
    assert "CUDA out of memory" in table.loc[64, "error"]
    assert list(table["meets_slo"]) == [True, True, False, False]


def test_the_headline_names_the_best_value_under_the_slo_not_the_fastest(sweep):
    md = (sweep.parent / "report.md").read_text()
    assert md.startswith("# sweep-seqs\n")
    assert "**Best under the SLO: max-num-seqs=16 — goodput 4.00 req/s, 1005 output tokens/s" in md
    # It says what was measured, where and under which load, and what was not.
    assert ("Measured: 4 values of max-num-seqs (6 of 8 runs ok) on the twin, a simulated h200; "
            "closed loop, constant 32 users, 15 s per run. Not measured: batches of more than 32 "
            "sequences, which this load (32 closed-loop users) never makes") in md
    assert "left out: max-num-seqs=64 (oom); a GPU (BACKEND=vllm measures one).**" in md
    # Each report states where its figures come from.
    assert "h200 · meta-llama/Meta-Llama-3-8B-Instruct · vLLM 0.26.0 · twin (simulated)" in md
    assert "Step: sweep · scenario: default" in md and "max-num-seqs=swept" in md
    assert "- max-num-seqs=64: oom — oom: CUDA out of memory" in md  # the failure is said, not hidden
    assert "![throughput](throughput.png)" in md


def test_the_html_is_self_contained(sweep):
    page = sweep.read_text()
    assert page.count('src="data:image/png;base64,') == 3 and 'src="http' not in page
    assert "Best under the SLO: max-num-seqs=16" in page and "make report EXPERIMENT=sweep-seqs" in page
    assert "<td>oom</td>" in page


def test_a_report_rebuilt_from_the_same_store_is_the_same(store_path, sweep, tmp_path):
    again = report.build(store_path, "sweep-seqs", tmp_path)
    for name in ("report.md", "summary.csv"):
        assert (again.parent / name).read_text() == (sweep.parent / name).read_text(), name


def test_a_baseline_report_is_a_table_with_its_spread(store_path, tmp_path):
    index = report.build(store_path, "baseline-h200", tmp_path)
    md = (index.parent / "report.md").read_text()
    # The statistic is named: a mean of the runs with half its 95% interval (248 = t(2) x 100 / sqrt 3).
    assert ("**Baseline: 1,000 ± 248 output tokens/s, goodput 3.00 ± 0 req/s, TTFT p50 100 ± 0 ms, "
            "TPOT p50 10.0 ± 0 ms (means of 3 runs ± half the 95% interval).**") in md
    assert "spread (coefficient of variation) of output throughput over 3 runs: 10.0%" in md
    assert not list(index.parent.glob("*.png"))  # no swept value: nothing to plot against


def test_an_experiment_without_runs_is_refused(store_path, tmp_path):
    with pytest.raises(StoreError, match="experiment not-yet has no runs yet"):
        report.build(store_path, "not-yet", tmp_path)


def test_no_point_meeting_the_slo_is_the_headline(tmp_path):
    store = Store(tmp_path / "lab.db")
    store.create_experiment("all-slow", "sweep", "default", {"param": "max-num-seqs"})
    for value in (8, 16):
        _record(store, "all-slow", "sweep", 0, {"max-num-seqs": value}, meets_slo=False)
    store.close()
    index = report.build(tmp_path / "lab.db", "all-slow", tmp_path / "out")
    md = (index.parent / "report.md").read_text()
    assert "**No value of max-num-seqs met every SLO. Measured: 2 values of max-num-seqs" in md


def test_the_servers_view_names_its_figures_and_draws_no_empty_chart(tmp_path, monkeypatch):
    """Legends read as the catalog names the figures, with units on the axes; a figure no run
    scraped (here the queue) gets no panel rather than an empty one."""
    from vllm_lab.reports import sweep as sweep_report

    path = tmp_path / "lab.db"
    store = Store(path)
    store.create_experiment("no-queue", "sweep", "default", {"param": "max-num-seqs"})
    for seqs in (8, 16):
        _record(store, "no-queue", "sweep", 0, {"max-num-seqs": seqs}, queue_len_mean=None,
                queue_len_max=None)
    store.close()
    drawn, save = {}, sweep_report.save

    def keep(fig, where):
        drawn[where.name] = [(ax.get_ylabel(), [t.get_text() for t in ax.get_legend().get_texts()])
                             for ax in fig.axes if ax.get_legend()]
        return save(fig, where)

    monkeypatch.setattr(sweep_report, "save", keep)
    report.build(path, "no-queue", tmp_path / "reports")
    server = dict(drawn["server.png"])
    assert list(server) == ["KV cache usage (% of the cache)", "preemptions per run (count)"]
    assert server["KV cache usage (% of the cache)"] == ["KV cache usage (mean)", "KV cache usage (max)"]
    assert not any("_" in text for _, texts in drawn["server.png"] for text in texts)


def test_a_point_with_some_runs_left_out_is_counted_not_called_left_out():
    from vllm_lab.reports.sweep import _left_out
    partial = pd.Series({"max-num-seqs": 1024, "runs": 5, "ok_runs": 4, "status": "ok,unsteady"})
    whole = pd.Series({"max-num-seqs": 64, "runs": 2, "ok_runs": 0, "status": "oom"})
    assert _left_out(partial, ["max-num-seqs"]) == "1 of 5 runs at max-num-seqs=1024 (unsteady)"
    assert _left_out(whole, ["max-num-seqs"]) == "max-num-seqs=64 (oom)"
