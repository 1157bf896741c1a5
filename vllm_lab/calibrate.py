"""Calibration: the runs that pin a twin profile to real hardware, and the fit from their results.

The plan measures what each coefficient of the step-time model is sensitive to: single requests at
several prompt lengths (prefill compute), closed loops of several sizes with fixed lengths (decode
batches and their memory traffic) and a saturating one (the API server's streaming cost); then the
traffic users tune for (`REALISTIC`): variable lengths at 64 and 256 users (and at 256 behind
short fixed prompts), Poisson arrivals at
half and four fifths of the predicted capacity (where prefill chunks and decodes share steps all
the time), and chat with a shared system prompt; and the KV cache's read at two contexts
(`CONTEXTS`). All of it on one server start, since only the load
changes; then one closed loop with ``--enforce-eager`` on a second (``EAGER``): the CPU's launch
cost of an eager step, which no other run reads. The fit then moves the profile's coefficients
until the twin's predictor reproduces those runs (``vllm_lab.twin.fit``), each run replayed
request for request (``FIT_STATUSES``: an unsteady fixed-length loop too, read over all its
requests as vllm bench serve reads a run). Where the runs carry the GPU's energy counter, the
power a second of its kernels draws is fitted last, on the fitted profile (``fit_power``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from vllm_lab.plans import Point, apply_value
from vllm_lab.prediction import prediction_samples, replayed_prompts
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store
from vllm_lab.summary import steady_window
from vllm_lab.twin import power
from vllm_lab.twin.fit import BenchPoint, compare, fit_host_scale, fit_profile, load_point, replay
from vllm_lab.twin.profile import Profile

# name, prompt tokens, output tokens, concurrent users, requests; the shapes of the reference set.
PLAN = [
    ("p128", 128, 16, 1, 10), ("p2048", 2048, 16, 1, 10), ("p8192", 8192, 16, 1, 8),
    ("c1", 512, 128, 1, 10), ("c8", 512, 128, 8, 64), ("c32", 512, 128, 32, 192),
    ("c128", 512, 128, 128, 384), ("c512", 512, 128, 512, 1024),
]


# name, workload over the base's, arrival (closed: users; open: share of the predicted capacity),
# and the run's size (closed: requests; open: seconds of arrivals).
FIXED_512 = {"source": "synthetic", "input": {"dist": "fixed", "mean": 512},
             "output": {"dist": "fixed", "mean": 128}}
REALISTIC = [
    ("v64", {"source": "sharegpt-like"}, "closed", 64, 320),
    ("v256", {"source": "sharegpt-like"}, "closed", 256, 768),
    # The same replies behind short fixed prompts: beside v256, the API server's one event loop at
    # its limit with fewer prompt tokens to take in, so its costs per request and per streamed
    # token come apart (and where each run holds its excess: admission or the output queue).
    ("v256p64", {"source": "sharegpt-like", "input": {"dist": "fixed", "mean": 64}}, "closed", 256, 768),
    ("o50", FIXED_512, "open", 0.5, 20),
    ("o80", FIXED_512, "open", 0.8, 20),
    ("chat64", {"source": "sharegpt-like", "api": "chat", "shared_prefix_ratio": 0.3}, "closed", 64, 256),
]


# The KV cache's read, apart from the weights': 64 users, each its own cached prompt of 512 or
# 4,096 tokens (all but the user's last 4% a prompt of its own, computed once and kept), 512-token
# replies. The batch and its decodes are the same in both; only the context each sequence attends
# over differs, and vLLM's step with it (on an H100 42.5 ns a KV token: reports/examples/h100, "A
# fifteenth host"). On the first server start, after REALISTIC.
CONTEXTS = [
    (f"kv{n}", {"source": "synthetic", "input": {"dist": "fixed", "mean": n},
                "output": {"dist": "fixed", "mean": 512}, "shared_prefix_ratio": 0.96,
                "prefix_groups": 64}, "closed", 64, 192)
    for n in (512, 4096)
]


# Short prompts and long replies from 32 users with --enforce-eager, on a second server start:
# nearly every step a batch of decodes the CPU launches op by op, so the run's TPOT is the host's
# eager launch cost (the twin's eager_layer_overhead_s). On the H200's host and an H100's it was
# 0.8 and 0.48 ms a layer, and it does not follow the compiled launches the other runs read.
EAGER = ("eager32", 64, 256, 32, 96)


# The runs of the plan that ``FIT=host`` measures: loads where the host's CPU sets the latencies
# (single requests, small closed loops, variable lengths at 64 users, Poisson at half the capacity,
# chat), none at an API server's limit, where a run's state is chance. Seven of the seventeen; not
# the long contexts, which read the GPU, nor the eager run, whose server start the host's CPU scale
# does not need.
HOST_PLAN = ("p2048", "c1", "c8", "c32", "v64", "o50", "chat64")


def host_points(points: list[Point]) -> list[Point]:
    """The calibration runs a host's CPU scale is fitted to (``HOST_PLAN``)."""
    return [p for p in points if p.values["point"] in HOST_PLAN]


def calibration_points(base: Scenario, plan=PLAN, realistic=REALISTIC, eager=EAGER,
                       contexts=CONTEXTS) -> list[Point]:
    """The calibration runs on ``base``'s serve flags: fixed lengths and closed loops, then the
    realistic traffic (variable lengths, Poisson arrivals, chat) and the long contexts, every run
    counted; then ``eager`` (None: none) with --enforce-eager, a server start of its own."""
    points = _fixed_points(base, plan) + _realistic_points(base, [*realistic, *contexts])
    if eager:
        points += _fixed_points(base.with_serve(**{"enforce-eager": True}), [eager])
    return points


def _realistic_points(base: Scenario, realistic) -> list[Point]:
    """The traffic users tune for, its open loops at shares of the predicted capacity."""
    if not realistic:
        return []
    from vllm_lab import stress

    points = []
    tok = base.workload.tokenizer and str(base.workload.tokenizer)
    capacity = stress.predicted_capacity(apply_value(base, "workload", {**FIXED_512, "tokenizer": tok}))
    for name, workload, arrival, level, size in realistic:
        wl = {"api": "completions", "ignore_eos": True, "tokenizer": tok, **workload}
        if arrival == "closed":
            load = {"mode": "closed", "shape": {"kind": "constant", "level": level},
                    "stop": {"duration_s": 600, "max_requests": size}}
        else:
            rate = round(level * capacity, 2)
            load = {"mode": "open", "shape": {"kind": "constant", "level": rate},
                    "max_in_flight": 4096, "stop": {"duration_s": 600, "max_requests": round(rate * size)}}
        s = apply_value(apply_value(base, "workload", wl), "load", load)
        lin, lout = s.workload.lengths()
        # The same keys as the fixed points' (a report's table has one column each), and traffic.
        points.append(Point(s, {"point": name, "prompt": round(lin.mean), "output": round(lout.mean),
                                "users": load["shape"]["level"], "traffic": arrival}))
    return points


def _fixed_points(base: Scenario, plan) -> list[Point]:
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
        points.append(Point(s, {"point": name, "prompt": prompt, "output": output, "users": users,
                                "traffic": "fixed"}))
    return points


# The runs a calibration fits: every run vLLM served whole. A closed loop of a few waves of
# identical requests (the plan's c128 and c512) never holds a steady window, so the lab marks it
# unsteady, but read over all its requests, as vllm bench serve reads a run and the predictor
# replays it, it measured what it is there for: a saturated engine and API server.
FIT_STATUSES = ("ok", "unsteady")


def calibration_runs(store: Store, experiment_id: str) -> tuple[pd.DataFrame, list[BenchPoint]]:
    """The experiment's runs of ``FIT_STATUSES``, and each as the fit's point, replayed."""
    runs = store.runs(experiment_id)
    runs = runs[runs["status"].isin(FIT_STATUSES)]
    return runs, [replayed(store, experiment_id, run) for _, run in runs.iterrows()]


def bench_points(store: Store, experiment_id: str) -> list[BenchPoint]:
    """The experiment's runs of ``FIT_STATUSES`` as the fit's points, each replayed."""
    return calibration_runs(store, experiment_id)[1]


def replayed(store: Store, experiment_id: str, run, name: str | None = None) -> BenchPoint:
    """A run as a fit point: its requests in the order sent, an open loop's send times,
    and its figures on the bench's definitions (throughput over first send to last reply,
    percentiles over every request), which is how the predictor's run is read. ``name``: the
    point's, else the run's ``point`` value (a run of any experiment, a baseline's too)."""
    scenario = Scenario.model_validate_json(run["scenario_json"])
    df = store.samples(experiment_id, run["run_key"])
    df = df[df["status"] == "ok"].sort_values("start_ts")
    start = float(df["start_ts"].min())
    end = float((df["start_ts"] + df["e2e_s"]).max())
    open_loop = scenario.load.open_loop
    prompts, chat = replayed_prompts(scenario, df["prompt_tokens"].astype(int).tolist())
    return BenchPoint(
        name=name or run["point"]["point"], num_prompts=len(df), input_len=round(df["prompt_tokens"].mean()),
        output_len=round(df["output_tokens"].mean()),
        max_concurrency=None if open_loop else int(scenario.load.shape.level),
        request_rate=float(scenario.load.shape.level) if open_loop else float("inf"), burstiness=1.0,
        measured={"output_throughput": float(df["output_tokens"].sum()) / max(end - start, 1e-9),
                  "p50_ttft_ms": float(df["ttft_s"].median()) * 1000,
                  "p50_tpot_ms": float(df["tpot_s"].median()) * 1000},
        flags=dict(scenario.serve), prompt_lens=prompts,
        output_lens=df["output_tokens"].astype(int).tolist(),
        arrival_times=(df["start_ts"] - start).tolist() if open_loop else None, chat=chat,
        kind="chat" if chat else "open" if open_loop else (
            "closed fixed" if df["prompt_tokens"].nunique() == df["output_tokens"].nunique() == 1
            else "closed variable"))


def replayed_runs(store: Store, experiment_id: str, label: str) -> list[BenchPoint]:
    """Every run of an experiment in the order started (a staircase's levels, a baseline's
    repeats), each ``replayed`` and named "<label> #<i>": runs held out of a fit, to read it on."""
    return [replayed(store, experiment_id, run, f"{label} #{i + 1}")
            for i, (_, run) in enumerate(store.runs(experiment_id).iterrows())]


# What a calibration fits: every coefficient the plan pins ("all"), or the host's CPU scale alone
# ("host": the profile's GPU on another host, fit.fit_host_scale), or nothing ("none": the plan
# measured and the fit left to FIT_ONLY on another machine, so a GPU host is not kept for minutes
# of CPU work).
FITS = ("all", "host", "none")


def fit(store_path: Path, experiment_id: str, base: Profile, model, out: Path,
        reference: list[Path] = (), scope: str = "all") -> tuple[Profile, list[dict]]:
    """Fit ``base``'s coefficients (``scope`` "all") or its host's CPU scale (``scope`` "host") to a
    calibration experiment, write the profile, return the errors.

    ``reference``: `vllm bench serve` result files from the same machine, fitted together with the
    lab's runs: two instruments on one server keep the twin honest to both.
    """
    with Store(store_path) as store:
        runs, measured = calibration_runs(store, experiment_id)
    points = measured + [load_point(Path(f)) for f in reference]
    if len(points) < 3:
        raise ValueError(f"experiment {experiment_id} has {len(points)} ok calibration runs; "
                         f"the fit needs at least 3")
    if scope == "all":
        base = with_kv_read(base, model, measured)
    profile = fit_host_scale(points, base, model)[1] if scope == "host" else fit_profile(points, base, model)
    if scope == "all":
        profile = fit_power(runs, measured, profile, model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(profile.to_yaml())
    return profile, compare(points, profile, model)


def with_kv_read(profile: Profile, model, points: list[BenchPoint]) -> Profile:
    """``profile`` with the KV cache's read efficiency that the plan's context pair (``CONTEXTS``)
    measured, read before the fit rather than fitted: the same batch and decodes at two contexts,
    so their TPOT differs by the cache read alone, ``users x (4,096 - 512)`` KV tokens a step,
    each at its bytes over the bandwidth plus the block term. The base's where the pair is missing.
    (A least-squares fit over the plan left it where it started: the pair's two runs are outweighed
    by fifteen that barely read the cache.)"""
    from vllm_lab.twin.engine import Engine

    pair = {pt.name: pt for pt in points if pt.name in {name for name, *_ in CONTEXTS}}
    if len(pair) < 2:
        return profile
    (short, long_) = sorted(pair.values(), key=lambda pt: pt.input_len)
    tokens = short.max_concurrency * (long_.input_len - short.input_len)
    per_token = (long_.measured["p50_tpot_ms"] - short.measured["p50_tpot_ms"]) / 1e3 / tokens
    co = profile.coefficients
    full = profile.model_copy(update={"coefficients": co.model_copy(update={"kv_bandwidth_efficiency": 1.0})})
    stm = Engine.from_flags(short.flags, full, model).stm
    read = per_token - stm.block_s_per_token
    efficiency = min(1.0, max(0.1, stm.kv_s_per_token / read)) if read > 0 else 1.0
    return profile.model_copy(update={"coefficients": co.model_copy(
        update={"kv_bandwidth_efficiency": round(efficiency, 3)})})


# A run's power is fitted on when both its steady window and the replay's last this long: over a
# second or two the energy counter and the GPU's clocks have not settled (the H100's shortest
# calibration runs read 38-68% off the twin).
POWER_MIN_WINDOW_S = 5.0
POWER_MIN_RUNS = 3


def power_runs(runs: pd.DataFrame, points: list[BenchPoint], profile: Profile,
               model) -> list[power.WindowSteps]:
    """Of ``calibration_runs``, those that carry the GPU's energy counter, each point replayed on
    ``profile`` and read over the replay's own steady window, beside the power measured over the
    run's."""
    out = []
    for (_, run), point in zip(runs.iterrows(), points, strict=True):
        summary = json.loads(run["summary_json"])
        # Real GPUs' counters only: the twin's server exports its own power model as one.
        if (run["backend"] != "vllm" or summary.get("energy_source") != "energy counter"
                or not run["duration_s"] or run["duration_s"] < POWER_MIN_WINDOW_S):
            continue
        predicted = replay(point, profile, model)
        window = steady_window(prediction_samples(predicted.requests))
        if window is None or window.end - window.start < POWER_MIN_WINDOW_S:
            continue
        gpus = int(point.flags.get("tensor-parallel-size", 1))
        out.append(power.WindowSteps.of(predicted.step_log, window.start, window.end,
                                        float(summary["power_mean_w"]), gpus))
    return out


def fit_power(runs: pd.DataFrame, points: list[BenchPoint], profile: Profile, model) -> Profile:
    """``profile`` with the power a second of its GPU's kernels draws fitted to the calibration's
    energy counters (``twin.power.fit``; ``runs`` and ``points`` as ``calibration_runs`` gives
    them), where at least ``POWER_MIN_RUNS`` runs on real vLLM carry one; else unchanged."""
    runs = power_runs(runs, points, profile, model)
    if len(runs) < POWER_MIN_RUNS:
        return profile
    fitted = power.fit(runs, power.PowerModel.of(profile.hardware))
    hardware = profile.hardware.model_copy(update={
        "power_memory_w": round(fitted.memory_w, 1), "power_compute_w": round(fitted.compute_w, 1),
        "power_cap_w": round(fitted.cap_w, 1)})
    return profile.model_copy(update={"hardware": hardware})
