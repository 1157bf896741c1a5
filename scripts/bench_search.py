"""Benchmark: does Optuna find the grid's best goodput in a quarter of the grid's trials?

Ground truth: a 6x6 grid of max-num-seqs x max-num-batched-tokens on the twin's predictor, for a
long-prompt open-loop scenario whose TTFT and TPOT SLOs both bind (the optimum is interior). Then
TPE over the same ranges (log-scaled integers) with a budget of 36/4 = 9 trials, 5 seeds; prints
the best goodput each seed reached against the grid's best, and the median ratio.

    .venv/bin/python scripts/bench_search.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from vllm_lab import plans, search
from vllm_lab.analysis.points import point_table
from vllm_lab.backends import PredictBackend
from vllm_lab.scenarios import resolve
from vllm_lab.store import Store

SCENARIO = {
    "description": "bench: long prompts, open loop, TTFT and TPOT SLOs that bind",
    "serve": {"model": "meta-llama/Meta-Llama-3-8B-Instruct"},
    "workload": {"source": "synthetic",
                 "input": {"dist": "lognormal", "mean": 2000, "std": 800, "min": 64, "max": 8000},
                 "output": {"dist": "lognormal", "mean": 200, "std": 100, "min": 8, "max": 1000}},
    "load": {"mode": "open", "shape": {"kind": "constant", "level": 14}, "stop": {"duration_s": 30}},
    "slo": {"ttft": {"threshold_ms": 800, "percentile": 99}, "tpot": {"threshold_ms": 18, "percentile": 99}},
}
GRID = {"max-num-seqs": [8, 16, 32, 48, 64, 128], "max-num-batched-tokens": [256, 512, 1024, 2048, 4096, 8192]}
SEEDS = (0, 1, 2, 3, 4)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-search-"))
    scen_file = work / "bench.yaml"
    scen_file.write_text(yaml.safe_dump(SCENARIO))
    scenario = resolve(str(scen_file))
    db = work / "lab.db"
    t0 = time.perf_counter()
    plan = plans.Plan("grid", "combo", search.combo_points(scenario, GRID), {"params": list(GRID)})
    plans.execute(plan, PredictBackend(), db, work / "w")
    grid_s = time.perf_counter() - t0
    with Store(db) as store:
        table = point_table(store.runs("grid"), list(GRID))
    best = table.sort_values("goodput", ascending=False).iloc[0]
    print(f"grid: {len(table)} points in {grid_s:.1f} s; best goodput {best['goodput']:.2f} req/s at "
          f"max-num-seqs={best['max-num-seqs']}, max-num-batched-tokens={best['max-num-batched-tokens']}")
    print(table.pivot(index="max-num-seqs", columns="max-num-batched-tokens", values="goodput").round(2))
    budget = len(table) // 4
    space = search.SearchSpace(space={p: search.ParamRange(low=min(v), high=max(v), log=True)
                                      for p, v in GRID.items()})
    ratios = []
    for seed in SEEDS:
        settings = search.TuneSettings(f"tune-{seed}", space, "goodput", budget,
                                       search.storage_url(None, db), seed=seed, startup_trials=4)
        t0 = time.perf_counter()
        search.run_trials(scenario, settings, PredictBackend(), db, work / "w")
        study = search.load_study(f"tune-{seed}", settings.storage)
        reached = max(t.value for t in study.trials if t.value is not None)
        ratios.append(reached / best["goodput"])
        print(f"seed {seed}: {budget} trials in {time.perf_counter() - t0:.1f} s, best goodput "
              f"{reached:.2f} ({ratios[-1]:.1%} of the grid's best) at {study.best_params}")
    median = statistics.median(ratios)
    print(f"median over {len(SEEDS)} seeds: {median:.1%} of the grid's best with {budget} trials "
          f"(grid: {len(table)}); goal >= 95%: {'met' if median >= 0.95 else 'NOT met'}")
    return 0 if median >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
