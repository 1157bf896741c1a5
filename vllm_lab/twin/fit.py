"""Fit a profile's coefficients to ``vllm bench serve`` result files by least squares.

Each file is replayed by the predictor in bench mode (same prompts count, lengths, concurrency,
rate and flags) and the log-ratios of output throughput, TTFT p50 and TPOT p50 against the
measurement are the residuals. Only a handful of physical coefficients move, so a fit on a few
points carries to other flags and loads through the roofline terms.

    python -m vllm_lab.twin.fit BASE_PROFILE FILE.json... [--out PROFILE.yaml]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_lab.twin.predictor import Closed, Open, Prediction, PredictRequest, bench_serve, predict
from vllm_lab.twin.profile import Profile, load_profile, on_host

# name, lower bound, upper bound (the search runs in log space)
FIT_PARAMS = [
    ("gemm_efficiency", 0.2, 1.0),
    ("attention_efficiency", 0.1, 1.0),
    ("bandwidth_efficiency", 0.4, 1.0),
    ("step_overhead_s", 1e-5, 0.02),
    ("seq_overhead_s", 1e-7, 2e-4),
    ("frontend_latency_s", 1e-4, 0.1),
    ("frontend_token_s", 1e-7, 2e-4),
    # A step larger than the largest CUDA graph launches its kernels from Python: a floor per
    # layer that open loops meet all the time (a prefill beside a few decodes), closed loops of
    # identical requests rarely (their prefills come in waves of thousands of tokens).
    ("compiled_layer_launch_s", 1e-4, 2e-3),
    # Under --enforce-eager the CPU launches every op of every layer: fitted only where a run was
    # served eager (the calibration plan's eager32), since no other run reads it and it follows no
    # other term (reports/examples/h100, "An eighth host").
    ("eager_layer_overhead_s", 5e-5, 3e-3),
]
# The API server's terms alone, fitted where it is the bottleneck (ShareGPT-like streams at
# hundreds of users, open loops near its limit) with the engine's terms held: the physics the
# engine's own measurements leave free. frontend_chat_s stays where the autotune staircases put it.
FRONTEND_PARAMS = [
    ("frontend_token_s", 3e-5, 3e-4),
    ("frontend_delivery_share", 0.01, 0.95),
    ("frontend_prompt_token_s", 1e-8, 3e-5),
]
METRICS = (("output_throughput", "output_throughput"), ("p50_ttft_ms", "ttft"),
           ("p50_tpot_ms", "tpot"))


@dataclass
class BenchPoint:
    """One measured run (a ``vllm bench serve`` result file, or a run of the lab's client) and what
    it was run with.

    A run with per-request records is replayed request for request: each request's prompt and
    output length in the order sent (``prompt_lens``, ``output_lens``) and, for an open loop, its
    send time (``arrival_times``, seconds from the first), so the predictor meets the very
    realization of the arrival process that was measured, not another draw of it.
    """

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    max_concurrency: int | None
    request_rate: float
    burstiness: float
    measured: dict[str, float]
    flags: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    prompt_lens: list[int | list[int]] | None = None  # a length, or token ids (shared prefixes)
    output_lens: list[int] | None = None
    arrival_times: list[float] | None = None
    chat: bool = False
    kind: str = "closed fixed"  # closed fixed | closed variable | open | chat: how fidelity is read


def load_point(path: Path, flags: dict[str, Any] | None = None) -> BenchPoint:
    """Read a ``vllm bench serve --save-result`` JSON (flags from its "flags" key if present)."""
    d = json.loads(Path(path).read_text())
    for key in ("num_prompts", "total_input_tokens", "total_output_tokens", "output_throughput",
                "p50_ttft_ms", "p50_tpot_ms"):
        if key not in d:
            raise ValueError(f"{path}: key {key!r} missing; expected a vllm bench serve result file")
    n = int(d["num_prompts"])
    rate = d.get("request_rate", "inf")
    return BenchPoint(
        name=Path(path).stem, num_prompts=n,
        input_len=max(1, round(d["total_input_tokens"] / n)),
        output_len=max(1, round(d["total_output_tokens"] / n)),
        max_concurrency=d.get("max_concurrency"),
        request_rate=math.inf if rate in ("inf", None) else float(rate),
        burstiness=float(d.get("burstiness") or 1.0),
        measured={k: float(d[k]) for k, _ in METRICS},
        flags=dict(flags if flags is not None else d.get("flags") or {}))


def replay(point: BenchPoint, profile: Profile, model, seed: int = 0) -> Prediction:
    """The predictor's run of one point: its own requests and arrivals where it recorded them."""
    if point.prompt_lens is None:
        return bench_serve(point.flags, profile, model, point.num_prompts, point.input_len,
                           point.output_len, point.max_concurrency, point.request_rate,
                           point.burstiness, seed=seed)
    reqs = [PredictRequest(p if isinstance(p, list) else int(p), int(o), point.chat)
            for p, o in zip(point.prompt_lens, point.output_lens)]
    if point.arrival_times is not None:
        arrivals: Closed | Open = Open(rate=point.request_rate, times=point.arrival_times)
    else:
        arrivals = Closed(users=point.max_concurrency or len(reqs))
    return predict(point.flags, profile, model, reqs, arrivals, seed=seed)


def predicted_metrics(pred: Prediction) -> dict[str, float]:
    """The fitted metrics as vllm bench names them (TTFT p99 is read, not fitted), and
    ``api_ms``: the mean of each request's TTFT outside the engine's queue and prefill, the time
    vLLM's API server holds it (what vLLM's TTFT histogram has beyond its queue and prefill
    histograms), ``prefill_ms`` (the mean of the engine's part: first scheduled to first token, as
    vLLM's prefill histogram), ``lag_ms`` (its stream's lag behind the engine) and ``api_cpu``: the
    cores its process was busy, vLLM's process_cpu_seconds_total over the run."""
    d = pred.requests
    api = float((d["ttft_s"] - d["queue_s"] - d["prefill_s"]).mean()) * 1e3
    return {"output_throughput": pred.output_throughput, "p50_ttft_ms": pred.ttft["p50"] * 1e3,
            "p50_tpot_ms": pred.tpot["p50"] * 1e3, "p99_ttft_ms": pred.ttft["p99"] * 1e3,
            "api_ms": api, "prefill_ms": float(d["prefill_s"].mean()) * 1e3,
            "lag_ms": float(d["stream_lag_s"].mean()) * 1e3,
            "api_cpu": pred.api_server_cpu}


def compare(points: list[BenchPoint], profile: Profile, model,
            metrics: tuple[str, ...] = tuple(k for k, _ in METRICS)) -> list[dict[str, Any]]:
    """Per point and metric (those it measured): measured, predicted, relative error."""
    return [row for pt in points
            for row in compared(pt, predicted_metrics(replay(pt, profile, model)), metrics)]


def compared(pt: BenchPoint, got: dict[str, float], metrics: tuple[str, ...]) -> list[dict[str, Any]]:
    """One point's rows of ``compare`` from its predicted metrics ``got``."""
    rows = []
    for key in metrics:
        if key not in pt.measured:
            continue
        m, p = pt.measured[key], got[key]
        rows.append({"point": pt.name, "kind": pt.kind, "metric": key, "measured": m,
                     "predicted": p, "error": (p - m) / m if m else math.nan,
                     "twin_api_cpu": got.get("api_cpu", math.nan)})
    return rows


def _with(profile: Profile, x: np.ndarray, params=FIT_PARAMS) -> Profile:
    co = profile.coefficients.model_copy(
        update={name: float(math.exp(v)) for (name, _lo, _hi), v in zip(params, x)})
    return profile.model_copy(update={"coefficients": co})


# Where the fit starts: the base profile, and the base moved to a host of half and twice its CPU
# time (profile.on_host). The predictor is a simulation of discrete steps, so its cost surface has
# several minima: on the sixth H100 host's plan (reports/examples/h100, h100-calibrate-b) the three
# starts ended at soft-L1 costs 0.120, 0.099 and 0.109, and the least read the runs held out of it
# best (from the base alone, the baseline's TTFT p50 +23%).
FIT_STARTS = (1.0, 0.5, 2.0)


def fit_profile(points: list[BenchPoint], base_profile: Profile, model=None,
                max_evals: int = 400, params=FIT_PARAMS,
                starts: tuple[float, ...] = FIT_STARTS) -> Profile:
    """Least-squares fit of the profile's coefficients ``params`` (name, lower, upper bound) to
    ``points``, the others held, from each of ``starts`` (``FIT_STARTS``); returns a new profile,
    the fit of least cost."""
    from vllm_lab.models import load_model_shape

    model = model or load_model_shape(points[0].model or base_profile.model)
    params = [p for p in params if p[0] != "eager_layer_overhead_s" or served_eager(points)]
    lo = np.log([p[1] for p in params])
    hi = np.log([p[2] for p in params])

    def residuals(x: np.ndarray) -> np.ndarray:
        prof = _with(base_profile, x, params)
        res = []
        for pt in points:
            got = predicted_metrics(replay(pt, prof, model))
            res.extend(math.log(max(got[k], 1e-9) / pt.measured[k]) for k, _ in METRICS)
        return np.array(res)

    from scipy.optimize import least_squares  # here: ~0.35 s to import, for a fit alone
    best = None
    for scale in starts:
        co = on_host(base_profile, scale).coefficients
        x0 = np.array([math.log(min(max(getattr(co, n), lo_ * 1.01), hi_ * 0.99))
                       for n, lo_, hi_ in params])
        sol = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1,
                            diff_step=0.02, max_nfev=max_evals)
        if best is None or sol.cost < best.cost:
            best = sol
    fitted = _with(base_profile, best.x, params)
    prov = fitted.provenance.model_copy(update={
        "fitted_on": [p.name for p in points],
        "fitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "method": "scipy least_squares (soft_l1) over the predictor in bench mode from "
                  f"{len(starts)} start(s), the least cost kept; residuals: log ratio of output "
                  "throughput, TTFT p50, TPOT p50",
        "errors": median_errors(points, fitted, model),
    })
    return fitted.model_copy(update={"provenance": prov})


def served_eager(points: list[BenchPoint]) -> bool:
    """Whether any point was served with --enforce-eager: the only runs that read its launch cost.
    Without one a fit keeps the base's, since the compiled launches it reads do not carry it
    (reports/examples/h100, "An eighth host": on one CPU fits put those at 0.68-0.75 ms a layer
    and the eager cost measured 0.48; on a faster one 0.34 and 0.41)."""
    return any(pt.flags.get("enforce-eager") for pt in points)


def median_errors(points: list[BenchPoint], profile: Profile, model) -> dict[str, float]:
    """The median |relative error| of each fitted metric over ``points`` (a profile's
    ``provenance.errors``)."""
    errs = np.abs(np.array([[predicted_metrics(replay(pt, profile, model))[k] / pt.measured[k] - 1
                             for k, _ in METRICS] for pt in points]))
    return {k: round(float(np.median(errs[:, i])), 4) for i, (k, _) in enumerate(METRICS)}


# The host CPU scales tried (profile.on_host): 0.6 (a host much faster than the profile's) to 1.5.
HOST_SCALES = tuple(round(0.6 + 0.05 * i, 2) for i in range(19))
# What a host's scale is judged on: the latencies its CPU sets (throughput barely moves with it).
HOST_METRICS = ("p50_ttft_ms", "p50_tpot_ms")


def host_log_errors(points: list[BenchPoint], profile: Profile, model,
                    scales: tuple[float, ...] = HOST_SCALES) -> np.ndarray:
    """log(predicted / measured) of HOST_METRICS for each scale (rows) and point (columns), the
    profile moved to each scale's host (``profile.on_host``)."""
    return np.stack([host_logs(points, [predicted_metrics(replay(pt, on_host(profile, s), model))
                                        for pt in points]) for s in scales])


def host_logs(points: list[BenchPoint], predicted: list[dict[str, float]]) -> np.ndarray:
    """log(predicted / measured) of HOST_METRICS for each point (rows), from its predicted
    metrics."""
    return np.array([[math.log(max(got[k], 1e-9) / pt.measured[k]) for k in HOST_METRICS]
                     for pt, got in zip(points, predicted)])


def best_host_scale(log_errors: np.ndarray, scales: tuple[float, ...] = HOST_SCALES) -> float:
    """The scale whose median |log error| over the points is least: a median, so the runs at an
    API server's limit, whose state is chance (reference/README.md), do not pull it."""
    return scales[int(np.argmin(np.median(np.abs(log_errors.reshape(len(scales), -1)), axis=1)))]


def fit_host_scale(points: list[BenchPoint], profile: Profile, model=None) -> tuple[float, Profile]:
    """A new host of the profile's GPU: the one factor on its CPU terms (``profile.on_host``) that
    best reproduces ``points`` measured there, to the nearest 1%, and the profile moved to it.

    Everything else the profile holds is the GPU's and stays: a host is calibrated from a few runs.
    """
    from vllm_lab.models import load_model_shape

    model = model or load_model_shape(profile.model)
    coarse = best_host_scale(host_log_errors(points, profile, model), HOST_SCALES)
    fine = tuple(round(coarse + 0.01 * k, 2) for k in range(-4, 5) if coarse + 0.01 * k > 0)
    scale = best_host_scale(host_log_errors(points, profile, model, fine), fine)
    moved = on_host(profile, scale)
    prov = moved.provenance.model_copy(update={
        "fitted_on": [p.name for p in points],
        "fitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "method": f"the host's CPU scale alone: {scale:g} x the host-CPU terms of the profile it "
                  f"started from (median |log error| of TTFT p50 and TPOT p50 over the runs)",
        "notes": (f"Moved to this host: its host-CPU terms (the engine core's step, sequence and "
                  f"launch costs, the API server's) x {scale:g}. " + moved.provenance.notes).strip(),
        "errors": median_errors(points, moved, model),
    })
    return scale, moved.model_copy(update={"provenance": prov})


def main(argv: list[str] | None = None) -> int:
    """CLI: fit BASE_PROFILE to bench files and write the result."""
    ap = argparse.ArgumentParser(prog="python -m vllm_lab.twin.fit", description=__doc__.split("\n")[0])
    ap.add_argument("base_profile", help="profile name or YAML path to start from")
    ap.add_argument("files", nargs="+", type=Path, help="vllm bench serve result JSON files")
    ap.add_argument("--out", type=Path, help="where to write the fitted profile (default: stdout)")
    ap.add_argument("--name", help="name of the fitted profile")
    ap.add_argument("--flags", default="{}", help="JSON of the engine flags the files were run with")
    args = ap.parse_args(argv)
    try:
        base = load_profile(args.base_profile)
        points = [load_point(f, json.loads(args.flags) or None) for f in args.files]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prof = fit_profile(points, base)
    if args.name:
        prof = prof.model_copy(update={"name": args.name})
    text = prof.to_yaml()
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    from vllm_lab.models import load_model_shape

    for row in compare(points, prof, load_model_shape(prof.model)):
        print(f"{row['point']:14s} {row['metric']:18s} {row['measured']:10.2f} "
              f"{row['predicted']:10.2f} {row['error']:+7.1%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
