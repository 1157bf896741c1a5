"""Benchmark: does a stress ramp find the knee within 10% of where the twin's queue grows without bound?

Ground truth: the twin's capacity in requests/s with a queue that never empties (the predictor,
closed loop with twice max-num-seqs users, completions per second in the middle half of the run):
past that arrival rate the waiting queue grows without bound. The ramp is what `make stress
SHAPE=ramp BACKEND=predict` runs: a staircase of open-loop levels (fractions of a pre-screen estimate,
shifted here by +13% so the ladder does not start on the answer) refined twice inside its bracket.

    .venv/bin/python scripts/bench_stress.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from vllm_lab import plans, stress
from vllm_lab.backends import PredictBackend
from vllm_lab.scenarios import resolve
from vllm_lab.store import Store

CASES = [("h200", ["serve.max-num-seqs=64"]), ("h200", ["serve.max-num-seqs=256"]),
         ("h200", []), ("cpu-demo", ["workload.source=alpaca-like", "serve.max-num-seqs=8", "load.stop.duration_s=120"])]


def ramp(scenario, db: Path, exp: str) -> dict:
    """The staircase and two refinement rounds, as cmd_stress takes them."""
    levels = [round(v * 1.13, 3) for v in stress.staircase_levels(scenario, None)]
    for _ in range(3):
        plan = plans.Plan(exp, "stress", stress.staircase_points(scenario, levels), {"shape": "ramp"})
        plans.execute(plan, PredictBackend(), db, db.parent / "w")
        store = Store(db)
        table = stress.levels_table(store, exp, store.runs(exp))
        store.close()
        extra = stress.refine_levels(table)
        if not extra:
            break
        levels = sorted(set(levels) | set(extra))
    return {**stress.find_knee(table), "runs": len(table)}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-stress-"))
    worst = 0.0
    for i, (hw, sets) in enumerate(CASES):
        s = stress.stress_scenario(resolve("default", hw, ["load.stop.duration_s=30", *sets]), "ramp")
        t0 = time.perf_counter()
        truth = stress.predicted_capacity(s)
        found = ramp(s, work / "lab.db", f"ramp-{i}")
        err = abs(found["knee_unbounded"] / truth - 1) if found["knee_unbounded"] else float("inf")
        worst = max(worst, err)
        print(f"{hw} {' '.join(sets) or '(defaults)'}: queue grows past {truth:.2f} req/s; ramp knee "
              f"{found['knee_unbounded']:.2f} req/s ({err:.1%} off, {found['runs']} runs, "
              f"{time.perf_counter() - t0:.1f} s); max sustainable under the SLO {found['max_sustainable']}")
    print(f"worst error {worst:.1%}; goal <= 10%: {'met' if worst <= 0.10 else 'NOT met'}")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
