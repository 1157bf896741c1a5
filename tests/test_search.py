"""Combination grid and Optuna search on the predictor: spaces, failures as trials, workers, reports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from tests.support.processes import PostgresServer
from vllm_lab import plans, search
from vllm_lab import reports as report
from vllm_lab.analysis.points import best_point, best_rule
from vllm_lab.analysis.search import best_configs
from vllm_lab.backends import PredictBackend
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.tune import TuneOptions, tune
from vllm_lab.progress import point_label
from vllm_lab.reports.console import results
from vllm_lab.run_summary import RunSummary
from vllm_lab.scenarios import ScenarioError, resolve
from vllm_lab.store import Store

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

ROOT = Path(__file__).resolve().parent.parent
SETS = ["load.mode=open", "load.shape.level=20", "load.stop.duration_s=5"]


@pytest.fixture
def scenario():
    return resolve("default", None, SETS)


def test_parse_grid_and_bad_input(scenario):
    grid = search.parse_grid("max-num-seqs=8,16 max-num-batched-tokens=2048", None, scenario)
    assert grid == {"max-num-seqs": [8, 16], "max-num-batched-tokens": [2048]}
    grid = search.parse_grid("max-num-seqs=8,16", "max-num-seqs,max-num-batched-tokens", scenario)
    assert grid["max-num-seqs"] == [8, 16] and len(grid["max-num-batched-tokens"]) > 1
    with pytest.raises(ScenarioError, match="2 or 3 parameters"):
        search.parse_grid(None, "max-num-seqs", scenario)
    with pytest.raises(ScenarioError, match="GRID item"):
        search.parse_grid("max-num-seqs", None, scenario)
    with pytest.raises(ScenarioError, match="^GRID max-num-seqs: 'x' is not a value of max-num-seqs"):
        search.parse_grid("max-num-seqs=8,x max-num-batched-tokens=2048", None, scenario)
    with pytest.raises(ScenarioError, match="^GRID block-size: 7 is not allowed"):
        search.parse_grid("max-num-seqs=8 block-size=16,7", None, scenario)


def test_space_file_is_strict(tmp_path, scenario):
    good = search.load_space(str(ROOT / "scenarios/spaces/batching.yaml"), scenario)
    assert set(good.space) == {"max-num-seqs", "max-num-batched-tokens", "gpu-memory-utilization"}
    bad = tmp_path / "bad.yaml"
    bad.write_text("space:\n  max-num-seqs: {low: 8, hgih: 64}\n")
    with pytest.raises(ScenarioError, match="bad.yaml: key space.max-num-seqs.hgih"):
        search.load_space(str(bad), scenario)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("space:\n  max-num-seqz: {low: 8, high: 64}\n")
    with pytest.raises(ScenarioError, match="not a vLLM flag"):
        search.load_space(str(unknown), scenario)
    default = search.load_space(None, scenario)
    # The sweep's ladder, where the batch cap binds (plans.default_values), on a log scale.
    ladder = plans.default_values("max-num-seqs", scenario)
    assert default.space["max-num-seqs"].log and default.space["max-num-seqs"].low == min(ladder)


def test_combo_report_has_heatmaps_pareto_and_best(tmp_path, scenario):
    grid = {"max-num-seqs": [8, 64], "max-num-batched-tokens": [4, 2048]}  # 4 < seqs: refused
    plan = plans.Plan("combo-t", "combo", search.combo_points(scenario, grid), {"params": list(grid)})
    counts = plans.execute(plan, PredictBackend(), tmp_path / "lab.db", tmp_path / "w")
    assert counts.get("failed-start", 0) >= 1 and counts.get("ok", 0) >= 1  # failures are data
    index = report.build(tmp_path / "lab.db", "combo-t", tmp_path)
    folder = index.parent
    assert (folder / "heatmaps.png").exists() and (folder / "pareto.png").exists()
    best = resolve(str(folder / "best.yaml"))  # a ready scenario file
    assert best.serve["max-num-seqs"] in (8, 64)
    # Resume: nothing left to take.
    assert plans.execute(plan, PredictBackend(), tmp_path / "lab.db", tmp_path / "w") == {}


def test_tune_records_trials_runs_and_failures(tmp_path, scenario):
    space = search.SearchSpace(space={"max-num-seqs": search.ParamRange(choices=[16, 64, 256]),
                                      "max-num-batched-tokens": search.ParamRange(choices=[8, 4096])})
    settings = search.TuneSettings("tune-t", space, "goodput", 8,
                                   search.storage_url(None, tmp_path / "lab.db"), seed=3)
    counts = search.run_trials(scenario, settings, PredictBackend(), tmp_path / "lab.db", tmp_path / "w")
    assert sum(counts.values()) == 8
    study = search.load_study("tune-t", settings.storage)
    trials = study.get_trials()
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    # 8 tokens < max-num-seqs: vLLM refuses to start; the trial is pruned with its cause.
    assert all(t.user_attrs["cause"] == "failed-start" and t.user_attrs["error"] for t in pruned)
    assert all(t.params["max-num-batched-tokens"] == 8 for t in pruned)
    runs = Store(tmp_path / "lab.db").runs("tune-t")
    assert set(runs["step"]) == {"tune"}
    assert {t.user_attrs["run_key"] for t in trials} == set(runs["run_key"])  # every trial is a run
    # The lab's tables and Optuna's share the file.
    import sqlite3
    tables = {r[0] for r in sqlite3.connect(tmp_path / "lab.db").execute(
        "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "experiments", "studies", "trials"} <= tables
    meta = search.tune_meta(settings)
    Store(tmp_path / "lab.db").create_experiment("tune-t", "tune", "default", meta)
    index = report.build(tmp_path / "lab.db", "tune-t", tmp_path)
    assert (index.parent / "history.png").exists() and (index.parent / "best.yaml").exists()
    assert resolve(str(index.parent / "best.yaml")).serve["max-num-batched-tokens"] == 4096


def test_throughput_objective_uses_the_slo_as_constraint(tmp_path, scenario):
    s = resolve("default", None, SETS + ["slo.tpot.threshold_ms=1"])  # nothing can meet it
    space = search.SearchSpace(space={"max-num-seqs": search.ParamRange(low=8, high=64, log=True)})
    settings = search.TuneSettings("tune-c", space, "throughput", 3,
                                   search.storage_url(None, tmp_path / "lab.db"), seed=0)
    search.run_trials(s, settings, PredictBackend(), tmp_path / "lab.db", tmp_path / "w")
    study = search.load_study("tune-c", settings.storage)
    assert all(t.user_attrs["slo_violation"] > 0 for t in study.trials)
    assert best_configs(study, 1, "throughput") == []  # infeasible: no best


def test_pareto_uses_nsga2(tmp_path, scenario):
    import optuna
    space = search.SearchSpace(space={"max-num-seqs": search.ParamRange(low=8, high=256, log=True)})
    settings = search.TuneSettings("tune-p", space, "pareto", 4,
                                   search.storage_url(None, tmp_path / "lab.db"), seed=0)
    study = search.open_study("tune-p", settings.storage, "pareto")
    assert isinstance(study.sampler, optuna.samplers.NSGAIISampler) and len(study.directions) == 2
    search.run_trials(scenario, settings, PredictBackend(), tmp_path / "lab.db", tmp_path / "w")
    assert all(len(t.values) == 2 for t in search.load_study("tune-p", settings.storage).trials)


WORKER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from vllm_lab import search
    from vllm_lab.backends import PredictBackend
    from vllm_lab.scenarios import resolve
    db = Path(sys.argv[1])
    s = resolve("default", None, ["load.mode=open", "load.shape.level=10", "load.stop.duration_s=4"])
    space = search.SearchSpace(space={"max-num-seqs": search.ParamRange(low=8, high=512, log=True),
                                      "max-num-batched-tokens": search.ParamRange(low=1024, high=16384, log=True)})
    settings = search.TuneSettings("tune-w", space, "goodput", 6, search.storage_url(sys.argv[2] or None, db))
    search.run_trials(s, settings, PredictBackend(), db, db.parent / "w")
""")


@pytest.fixture(params=["sqlite", "postgresql"])
def study_storage(request, tmp_path):
    """The study's storage: the lab's own SQLite file (None), or a private PostgreSQL server's URL."""
    if request.param == "sqlite":
        yield None
        return
    with PostgresServer() as url:
        yield url


@pytest.mark.integration
@pytest.mark.untimed
def test_two_workers_share_one_study(tmp_path, study_storage):
    """Two processes on one study and one store: no trial lost, none duplicated, none left running,
    with the study in the lab's SQLite file or on a PostgreSQL server (STUDY_STORAGE)."""
    db = tmp_path / "lab.db"
    Store(db).close()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(db), study_storage or ""], cwd=ROOT)
             for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    study = search.load_study("tune-w", search.storage_url(study_storage, db))
    trials = study.get_trials()
    assert sorted(t.number for t in trials) == list(range(12))
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    runs = Store(db).runs("tune-w")
    assert runs["run_key"].is_unique
    assert {t.user_attrs["run_key"] for t in trials} == set(runs["run_key"])


def test_a_worker_that_loses_the_race_to_make_optunas_tables_joins_them(monkeypatch):
    """PostgreSQL tells the second of two workers making Optuna's tables at once that they exist,
    as a ProgrammingError (CI saw it): that worker opens the storage the other made."""
    import optuna
    import sqlalchemy.exc
    calls = []

    def rdb(url, engine_kwargs=None):
        calls.append(url)
        if len(calls) == 1:
            raise sqlalchemy.exc.ProgrammingError(
                "CREATE TABLE alembic_version", {}, Exception('relation "alembic_version" already exists'))
        return "storage"
    monkeypatch.setattr(optuna.storages, "RDBStorage", rdb)
    monkeypatch.setattr(search.time, "sleep", lambda s: None)
    assert search._storage("postgresql://lab@127.0.0.1:1/optuna") == "storage"
    assert len(calls) == 2


def test_the_one_rule_ranks_by_the_figure_it_is_given():
    """The same table, two figures: the goodput rule and the tokens-per-joule rule part, each
    naming the cheapest point within noise of its own top among those meeting the SLO."""
    table = pd.DataFrame({
        "max-num-seqs": [16, 64, 256, 1024], "runs": 1, "ok_runs": 1, "backend": "twin",
        "meets_slo": [False, True, True, True],
        "goodput": [30.0, 20.0, 19.9, 16.0], "output_throughput": [9e3, 6e3, 5.9e3, 5e3],
        "output_tokens_per_joule": [12.0, 8.0, 9.6, 10.0]})
    # Goodput: 64 on top, 256 within a single live run's noise of it, 16 misses the SLO: 64.
    assert best_point(table)["max-num-seqs"] == 64
    # Tokens per joule: 1024 on top, 256 within noise of it (and cheaper), 64 not: 256.
    assert best_point(table, "output_tokens_per_joule")["max-num-seqs"] == 256
    assert best_rule("output_tokens_per_joule") != best_rule() and "output tokens per joule" in \
        best_rule("output_tokens_per_joule")


def test_an_energy_tune_names_its_best_by_tokens_per_joule_everywhere(tmp_path):
    """OBJECTIVE=energy: the best is the one rule's pick on output tokens per joule among the
    points meeting the SLO (the predictor is exact: the most tok/J, ties to the cheapest); the
    headline, best.yaml, summary.json and the console's table name it alike."""
    space = tmp_path / "space.yaml"
    space.write_text("space:\n  max-num-seqs: {choices: [16, 64, 256]}\n"
                     "  max-num-batched-tokens: {choices: [512, 2048]}\n")
    settings = Settings(backend="predict", out=tmp_path, experiment="tune-energy")
    options = TuneOptions(trials=10, objective="energy", space=str(space), seed=0, startup_trials=10)
    assert tune(settings, Source("default", None, tuple(SETS)), options) == 0

    # The rule, computed here from the recorded runs: every point meeting the SLO, by tok/J.
    runs = Store(tmp_path / "lab.db").runs("tune-energy")
    points = {}
    for _, run in runs[runs["status"] == "ok"].iterrows():
        summary = RunSummary.of_row(run)
        if summary.meets_slo:
            key = (run["point"]["max-num-seqs"], run["point"]["max-num-batched-tokens"])
            points[key] = summary.figure("output_tokens_per_joule")
    most = max(points.values())
    expected = min(k for k, v in points.items() if v == most)  # the cheapest of the equals
    value = f"max-num-seqs={expected[0]}, max-num-batched-tokens={expected[1]}"

    folder = tmp_path / "tune-energy"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["ranked_by"] == "output_tokens_per_joule"
    assert summary["best"] == {"max-num-seqs": expected[0], "max-num-batched-tokens": expected[1]}
    assert summary["best_figures"]["output_tokens_per_joule"] == pytest.approx(most)
    assert summary["headline"].count("Best under the SLO by output tokens per joule: " + value) == 1
    best = resolve(str(folder / "best.yaml"))
    assert (best.serve["max-num-seqs"], best.serve["max-num-batched-tokens"]) == expected
    page = (folder / "index.html").read_text()
    assert summary["headline"].replace("'", "&#x27;") in page  # the page's headline is the file's
    assert best_rule("output_tokens_per_joule") in page.replace("&#x27;", "'")  # the rule stated
    # The console ends with the same best and the same headline (closing_table prints these
    # results as they are), tok/J in its table.
    shown = results(tmp_path / "lab.db", "tune-energy")
    assert shown.best == point_label(dict(zip(("max-num-seqs", "max-num-batched-tokens"), expected)))
    assert shown.headline == summary["headline"] and "tok/J" in shown.table


def test_importance_is_shown_only_for_a_flag_that_moved_the_objective_itself():
    """PED-ANOVA ranks every flag, noise included: a flag whose values' mean objectives lie within
    the noise gets "no measurable effect", not a share of the importance."""
    import optuna

    from vllm_lab.analysis.search import MIN_SPREAD, flag_effects, importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    dists = {"max-num-seqs": optuna.distributions.CategoricalDistribution([64, 128, 256]),
             "max-num-batched-tokens": optuna.distributions.CategoricalDistribution([2048, 8192])}
    for i in range(14):
        seqs, budget = (64, 128, 256)[i % 3], (2048, 8192)[i % 2]
        # Goodput follows max-num-seqs (x1.3 per step); the budget moves it by 0.5% at most.
        value = 10.0 * 1.3 ** (i % 3) * (1.005 if budget == 8192 else 1.0) * (1 + 0.001 * (i % 5))
        study.add_trial(optuna.trial.create_trial(
            params={"max-num-seqs": seqs, "max-num-batched-tokens": budget}, distributions=dists, value=value))
    effects = flag_effects([(t.params, t.values[0]) for t in study.trials])
    assert effects["max-num-seqs"] > 0.3 and effects["max-num-batched-tokens"] < MIN_SPREAD
    imp = importances(study)
    assert list(imp.values) == ["max-num-seqs"] and imp.no_effect == ("max-num-batched-tokens",)
    lines = imp.lines()
    assert any(line.startswith("max-num-batched-tokens: no measurable effect") for line in lines)
    assert not any("importance of max-num-batched-tokens" in line for line in lines)
