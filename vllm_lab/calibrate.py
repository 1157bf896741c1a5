"""Calibration: the runs that pin a twin profile to real hardware, and the fit from their results.

The plan measures what each coefficient of the step-time model is sensitive to: single requests at
several prompt lengths (prefill compute), closed loops of several sizes with fixed lengths (decode
batches and their memory traffic) and a saturating one (the API server's streaming cost). All of it
on one server start, since only the load changes. The fit then moves the profile's coefficients
until the twin's predictor reproduces those runs (``vllm_lab.twin.fit``).
"""

from __future__ import annotations

from pathlib import Path

from vllm_lab.plans import Point, apply_value
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store
from vllm_lab.twin.fit import BenchPoint, compare, fit_profile, load_point
from vllm_lab.twin.profile import Profile

# name, prompt tokens, output tokens, concurrent users, requests; the shapes of the reference set.
PLAN = [
    ("p128", 128, 16, 1, 10), ("p2048", 2048, 16, 1, 10), ("p8192", 8192, 16, 1, 8),
    ("c1", 512, 128, 1, 10), ("c8", 512, 128, 8, 64), ("c32", 512, 128, 32, 192),
    ("c128", 512, 128, 128, 384), ("c512", 512, 128, 512, 1024),
]


def calibration_points(base: Scenario, plan=PLAN) -> list[Point]:
    """The calibration runs on ``base``'s serve flags: fixed lengths, closed loops, counted requests."""
    points = []
    for name, prompt, output, users, requests in plan:
        s = base
        for path, value in (
                ("workload", {"source": "synthetic", "api": "completions", "ignore_eos": True,
                              "tokenizer": base.workload.tokenizer and str(base.workload.tokenizer),
                              "input": {"dist": "fixed", "mean": prompt},
                              "output": {"dist": "fixed", "mean": output}}),
                ("load", {"mode": "closed", "shape": {"kind": "constant", "level": users},
                          "stop": {"duration_s": 600, "max_requests": requests}})):
            s = apply_value(s, path, value)
        points.append(Point(s, {"point": name, "prompt": prompt, "output": output, "users": users}))
    return points


def bench_points(store: Store, experiment_id: str) -> list[BenchPoint]:
    """The experiment's ok runs as the fit's points (what each measured, and how it was run)."""
    runs = store.runs(experiment_id)
    out = []
    for _, run in runs[runs["status"] == "ok"].iterrows():
        p = run["point"]
        n = int(run["requests"])
        out.append(BenchPoint(
            name=p["point"], num_prompts=n, input_len=int(p["prompt"]), output_len=int(p["output"]),
            max_concurrency=int(p["users"]), request_rate=float("inf"), burstiness=1.0,
            measured={"output_throughput": float(run["output_throughput"]),
                      "p50_ttft_ms": float(run["ttft_p50"]) * 1000,
                      "p50_tpot_ms": float(run["tpot_p50"]) * 1000},
            flags=dict(Scenario.model_validate_json(run["scenario_json"]).serve)))
    return out


def fit(store_path: Path, experiment_id: str, base: Profile, model, out: Path,
        reference: list[Path] = ()) -> tuple[Profile, list[dict]]:
    """Fit ``base``'s coefficients to a calibration experiment, write the profile, return the errors.

    ``reference``: `vllm bench serve` result files from the same machine, fitted together with the
    lab's runs: two instruments on one server keep the twin honest to both.
    """
    with Store(store_path) as store:
        points = bench_points(store, experiment_id)
    points += [load_point(Path(f)) for f in reference]
    if len(points) < 3:
        raise ValueError(f"experiment {experiment_id} has {len(points)} ok calibration runs; "
                         f"the fit needs at least 3")
    profile = fit_profile(points, base, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_yaml())
    return profile, compare(points, profile, model)
