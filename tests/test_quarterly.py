"""The quarterly report over a small hand-made store whose answers are known."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support import require
from vllm_lab import scenarios
from vllm_lab.reports import quarterly
from vllm_lab.store import RunRecord, Store, run_identity

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

Q3 = datetime(2026, 8, 1, tzinfo=UTC).timestamp()
Q4 = datetime(2026, 11, 1, tzinfo=UTC).timestamp()
NEXT = datetime(2027, 1, 15, tzinfo=UTC).timestamp()


def _record(store: Store, exp: str, step: str, t: float, repeat: int = 0, flags: dict | None = None,
            point: dict | None = None, status: str = "ok", samples: pd.DataFrame | None = None,
            host: str = "gpu-1", **summary) -> None:
    scenario = scenarios.resolve("default", "h200")
    if flags:
        scenario = scenario.with_serve(**flags)
    record = scenario.to_record()
    figures = {"output_throughput": 1000.0, "goodput": 3.0, "requests": 100.0, "ttft_p50": 0.1,
               "ttft_p99": 0.4, "tpot_p50": 0.01, "tpot_p99": 0.02, "gpu_util_mean": 90.0,
               "queue_len_mean": 0.1, "queue_len_max": 1.0, "kv_usage_max": 0.5, "preemptions": 0.0,
               "meets_slo": True, **summary}
    store.create_experiment(exp, step, "default",
                            {"params": list(point)} if point and step != "watch" else {})
    store.record_run(RunRecord(
        experiment_id=exp, run_key=run_identity({**record, "p": point, "t": t}, repeat), step=step,
        scenario_name="default", scenario=record, status=status, started=t, ended=t + 60,
        point=point or {}, repeat=repeat, host=host, gpu_model=scenario.hardware.name,
        vllm_version="0.26.0", backend="vllm", summary=figures if status == "ok" else {},
        error="oom: CUDA out of memory" if status == "oom" else ""), samples)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("quarterly") / "lab.db"
    store = Store(path)
    for r, v in enumerate((1000.0, 1010.0, 990.0)):
        _record(store, "baseline-q3", "baseline", Q3 + r, r, output_throughput=v, goodput=3.0)
    for r, v in enumerate((1200.0, 1190.0, 1210.0)):
        _record(store, "baseline-q4", "baseline", Q4 + r, r, output_throughput=v, goodput=3.0)
    for i, (seqs, good, meets) in enumerate(((64, 4.0, True), (128, 5.0, True), (256, 6.0, False))):
        for r in range(2):
            _record(store, "sweep-seqs-q4", "sweep", Q4 + 100 + 10 * i + r, r, {"max-num-seqs": seqs},
                    {"max-num-seqs": seqs}, goodput=good + 0.05 * r, meets_slo=meets,
                    output_throughput=1500.0 + 100 * i)
    # Outside the period: must not win.
    _record(store, "sweep-seqs-next", "sweep", NEXT, 0, {"max-num-seqs": 32}, {"max-num-seqs": 32},
            goodput=50.0)
    for i, level in enumerate((1, 2, 4, 8)):
        _record(store, "stress-q4", "stress", Q4 + 300 + i, 0, point={"load.shape.level": level},
                ttft_p99=0.2 * level, meets_slo=level <= 4, output_throughput=500.0 * level)
    _record(store, "sweep-gmu-q4", "sweep", Q4 + 400, 0, {"gpu-memory-utilization": 0.95},
            {"gpu-memory-utilization": 0.95}, status="oom")
    rng = np.random.default_rng(0)
    prompts = np.concatenate([rng.integers(100, 200, 98), [4000, 4500]])
    samples = pd.DataFrame({"request_id": [str(i) for i in range(100)], "start_ts": Q4 + np.arange(100),
                            "ttft_s": 0.1, "prompt_tokens": prompts, "status": "ok",
                            "itl_s": [[0.01, 0.02]] * 100})
    _record(store, "baseline-q4-long", "baseline", Q4 + 500, 0, samples=samples, ttft_p50=0.08,
            ttft_p99=1.5, queue_len_max=0.0, output_throughput=1205.0)
    for r in range(3):
        _record(store, "watch-a", "watch", Q4 + 600 + r, r, point={"role": "baseline"}, host="http://a:8000")
    _record(store, "watch-a", "watch", Q4 + 700, 3, point={"role": "probe"}, host="http://a:8000",
            regression=False)
    _record(store, "watch-a", "watch", Q4 + 800, 4, point={"role": "probe"}, host="http://a:8000",
            regression=True, output_throughput=500.0)
    # A claims experiment on a GPU host that kept its command's span: 10 minutes, of which its
    # run's window 6, its server's start 2 (and a 30-s stop), provisioning 1.
    _record(store, "claims-q4", "claims", Q4 + 1000, duration_s=360.0, server_start_s=120.0,
            warmup_s=20.0, drain_s=10.0)
    store.update_meta("claims-q4", host_time=[{"began": Q4 + 880, "provisioned_s": 60.0,
                                               "ended": Q4 + 1480, "stops_s": 30.0}])
    store.close()
    return path


@pytest.fixture(scope="module")
def report(store_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return quarterly.build(store_path, "2026Q4", out, pdf=False)  # the PDF is Chromium's: below


def test_period_parsing():
    p = quarterly.parse_period("2026q1")
    assert p.name == "2026Q1" and p.previous == "2025Q4"
    assert p.start == datetime(2026, 1, 1, tzinfo=UTC).timestamp()
    assert p.previous_start == datetime(2025, 10, 1, tzinfo=UTC).timestamp()
    assert quarterly.parse_period("2026Q4").end == datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    with pytest.raises(quarterly.ReportError, match="YYYYQn"):
        quarterly.parse_period("2026-12")


def test_analyses_on_known_data(store_path):
    p = quarterly.parse_period("2026Q4")
    runs = quarterly.load_runs(store_path, p.previous_start, p.end)
    now, before = runs[runs["started"] >= p.start], runs[runs["started"] < p.start]
    assert "sweep-seqs-next" not in set(runs["experiment_id"])
    cmp = quarterly.baseline_comparison(now, before)
    row = cmp.iloc[0]
    assert row["verdict"] == "faster" and row["p_value"] < 0.05
    assert row["throughput_change"] == pytest.approx(0.2, abs=0.01)
    points = quarterly.point_means(now)
    best = quarterly.best_configurations(now, points).iloc[0]
    assert best["point"] == {"max-num-seqs": 128}  # 256 has more goodput but misses the SLO
    assert best["margin_vs_baseline"] == pytest.approx(5.025 / 3.0 - 1, rel=1e-3)
    assert best["gain_is_real"] and best["margin_low"] > 0  # outside the repeats' noise
    # The knee and the maximum sustainable load by the stress report's own function.
    stress = quarterly.stress_summary(store_path, now).iloc[0]
    assert stress["knee"] == 4 and stress["max_sustainable"] == 4 and stress["peak_throughput"] == 4000
    watch = quarterly.watch_summary(now).iloc[0]
    assert watch["probes"] == 5 and watch["regressions"] == 1
    figures = quarterly.sample_figures(store_path, now)
    long_run = now["experiment_id"] == "baseline-q4-long"
    assert figures.loc[long_run, "prompt_p99"].iloc[0] > 3000
    kinds = {f.kind for f in quarterly.all_findings(now.join(figures))}
    assert kinds == {"oom", "long-prefill"}
    hours = quarterly.host_time_summary(store_path, p.start, p.end)
    assert list(hours["experiment_id"]) == ["claims-q4"]  # the predictor's keep none
    row = hours.iloc[0]
    assert row["host_minutes"] == pytest.approx(10.0) and row["measuring"] == pytest.approx(0.6)
    assert row["starts"] == pytest.approx(0.25) and row["lab"] == pytest.approx(1 - 0.6 - 0.25 - 0.05)
    assert quarterly.host_time_summary(store_path, Q3, p.start).empty  # not in the period before


def test_report_files_and_recommended_scenario(report):
    folder = report.parent
    for name in ("index.html", "report.md", "baseline.png", "best.png", "sweeps.png", "stress.png",
                 "watch.png"):
        assert (folder / name).stat().st_size > 0, name
    md = (folder / "report.md").read_text()
    assert "2026Q3" in md and "faster" in md and "Out of memory" in md and "long-prefill" in md
    assert ("10.0 host minutes over 1 experiment(s): the steady windows, the only part the figures "
            "come from, 60%") in md
    [rec] = sorted((folder / "recommended").glob("*.yaml"))
    scenario = scenarios.resolve(rec)  # a ready scenario file: it validates as one
    assert scenario.serve["max-num-seqs"] == 128 and scenario.hardware.gpu == "h200"
    assert "max-num-seqs: default -> 128" in rec.read_text()
    assert not (folder / "report.pdf").exists()


@pytest.mark.integration
@pytest.mark.untimed
def test_the_pdf_is_printed_by_chromium(store_path, tmp_path):
    require(None if quarterly.chromium() else
            "Chromium is not installed (scripts/install-system-deps.sh installs it)")
    index = quarterly.build(store_path, "2026Q4", tmp_path, pdf=True)
    assert (index.parent / "report.pdf").read_bytes()[:4] == b"%PDF"


def test_a_period_without_runs_says_so(store_path, tmp_path):
    with pytest.raises(quarterly.ReportError, match="no runs started in 2025Q1"):
        quarterly.build(store_path, "2025Q1", tmp_path, pdf=False)


def test_the_build_says_each_stage(store_path, tmp_path):
    """make report PERIOD= prints where it is: the runs read, the figures, the PDF."""
    said: list[str] = []
    quarterly.build(store_path, "2026Q4", tmp_path, pdf=False, say=said.append)
    assert len(said) == 2 and said[0].startswith("2026Q4: ") and " runs of " in said[0]
    assert said[1].startswith("2026Q4: analyses done, ") and said[1].endswith("figures drawn")


def test_the_quarter_names_each_autotunes_best_as_its_own_report_does(tmp_path):
    """reports/examples/autotune-h200: six autotunes (the first two from a store from before their
    experiments were recorded, their plans in their studies); the quarter names each one's best by
    analysis.autotune.outcome, the function the autotune's own report reads."""
    from vllm_lab import search
    from vllm_lab.analysis.autotune import outcome

    example = Path(__file__).resolve().parent.parent / "reports/examples/autotune-h200"
    db = tmp_path / "lab.db"
    db.write_bytes((example / "lab.db").read_bytes())
    (tmp_path / "lab.samples").symlink_to(example / "lab.samples")
    index = quarterly.build(db, "2026Q4", tmp_path / "out", pdf=False)
    p = quarterly.parse_period("2026Q4")
    now = quarterly.load_runs(db, p.start, p.end)
    table = quarterly.autotune_summary(db, now).set_index("experiment_id")
    assert list(table.index) == ["autotune-realtime-chat-h200", "autotune-realtime-chat-h200-b",
                                 "autotune-realtime-chat-h200-c", "autotune-realtime-chat-h200-d",
                                 "autotune-realtime-chat-h200-e", "autotune-realtime-chat-h200-f"]
    for name, row in table.iterrows():
        found = outcome(db, name, search.storage_url(None, db))
        assert row["best"] == found.best.candidate.name and row["verdict"] == found.verdict()
    assert table.loc["autotune-realtime-chat-h200", "best_flags"] == {"api-server-count": 4}
    md = (index.parent / "report.md").read_text()
    assert "## Autotune: the best found" in md and "api-server-count=4" in md
    assert table.loc["autotune-realtime-chat-h200-b", "verdict"] in md
