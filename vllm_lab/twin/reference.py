"""The twin's reference measurements as fit points, by traffic kind, with the held-out split.

``reference/h200-vllm0.26/`` holds `vllm bench serve` result files (closed loops of fixed lengths,
single requests of long prompts) and ``traffic-2026-12-01/``: one H200 measurement of every traffic
kind, `vllm bench serve` and the lab's client taking turns on one server (closed loops of 1 to
1024 users, a ShareGPT-format file of variable lengths at 64 and 256 users, Poisson at 25 and 40
req/s, gamma arrivals of burstiness 0.5, chat), then the same server restarted with
``--max-num-batched-tokens 2048``; and ``traffic-2026-12-02/``: another H200 host a day later,
closed loops of 1 to 512 users once, then 64 users and the ShareGPT file at 64 (three bench runs,
five of the lab) and Poisson at 30 and 45 req/s (three of each), taking turns; and
``traffic-2026-12-02b/``: a third host, where vLLM's API server is the limit (the ShareGPT file at
128-512 users, Poisson to 60 req/s, the realtime-chat scenario's traffic at 20-42 req/s, the lab's
fixed-length prompts sent by both clients, ``--long-prefill-token-threshold 256``); and
``traffic-2026-12-02c/``: a fourth host, the API server's costs taken apart with its event loop's
CPU measured (long replies to short prompts at 64-512 users, long prompts at 1-64, the ShareGPT
file and realtime-chat up to the loop's limit, four API-server processes); and
``traffic-2026-12-03/``: open loops on one arrival schedule (Poisson at 40 req/s, two pairs, on one
host; gamma arrivals of burstiness 0.5 at 30 req/s, one pair, on another), each lab run replaying
the send times and lengths of the bench run before it; ``traffic-2026-12-03b/``: the same at
25 req/s, three pairs, on a third host, and two
more gamma pairs on a fourth machine start; ``traffic-2026-12-03c/``: the lab's own max-num-seqs
sweeps (`reports/examples/h200-llama8b`: the default scenario's ShareGPT-like lengths, closed loops
of 64 and 256 users at 16-1024 sequences, five runs each); ``traffic-2026-12-04/``: `make
calibrate`'s plan on one more host (single requests, closed loops of 512/128, the lab's
ShareGPT-like traffic at 64 and 256 users and behind 64-token prompts at 256, Poisson at half and
four fifths of the predicted capacity, chat), every run with the API server's CPU;
``traffic-2026-12-05/``: the ShareGPT file at 256 users 18 times over five server starts, with the
API server's garbage collections probed (``REPEATS``). Each run is replayed request for request, a
scenario's traffic with the prefixes its requests share.

Which runs the fit may see was chosen before fitting, by workload and by configuration
(`FITTED`): the older bench files, and of the measurement's bench runs one of each traffic kind at
vLLM's defaults (closed 16 and 256 users, the ShareGPT file at 64, Poisson at 25 req/s). Held
out: every other load of those kinds (closed 1, 64, 512 and 1024 users, the ShareGPT file at
256, Poisson at 40, gamma), the chat kind whole, the whole ``max-num-batched-tokens=2048``
configuration, every run of the lab's client (another client, another draw of each load), and
the second measurement whole (another host, other draws, rates the fit never saw). Of the third,
``FRONTEND_FITTED`` names the runs the API server's terms may be fitted to (``frontend_fit_set``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_lab.twin.fit import HOST_SCALES, BenchPoint, load_point

ROOT = Path(__file__).resolve().parent / "reference" / "h200-vllm0.26"
TRAFFIC = ROOT / "traffic-2026-12-01"
# Measurements taken after the fit, held out whole.
LATER = (ROOT / "traffic-2026-12-02", ROOT / "traffic-2026-12-02b", ROOT / "traffic-2026-12-02c",
         ROOT / "traffic-2026-12-03", ROOT / "traffic-2026-12-03b", ROOT / "traffic-2026-12-03c",
         ROOT / "traffic-2026-12-04")
# One point taken many times (``traffic-2026-12-05``: 18 runs of the ShareGPT file at 256 users over
# five server starts): read for its runs' own spread (``repeat_spread``), not pooled into the kinds'
# held-out figures, where one point would outweigh the rest.
REPEATS = (ROOT / "traffic-2026-12-05",)
# vLLM's API server with scripts/gc_probe in it (its event loop's wait timed every 20 ms, its
# collections and CPU a line a second, ``api-server-probe.csv.gz``), on Poisson at 40 req/s and the
# ShareGPT file at 256 users: read for where a request waits (``api_server_probe``), not pooled into
# the kinds' held-out figures, the probe being a part of the server it measured.
PROBED = ROOT / "traffic-2026-12-05b"

# The measurement's runs whose configuration the fit sees: (tool, case, level).
FITTED = {("bench", "closed", 16), ("bench", "closed", 256), ("bench", "sharegpt", 64),
          ("bench", "poisson", 25)}
# The API server's limit (``traffic-2026-12-02b``): the runs its terms are fitted to, chosen
# before fitting (fit.FRONTEND_PARAMS, the engine's terms held). The bench's ShareGPT file at 256
# and 512 users, Poisson at 60 req/s and the realtime-chat traffic at 36 req/s (the chat API);
# held out: the ShareGPT file at 128, every run of the lab's client, Poisson at 10 and 50,
# realtime-chat at 20, 30 and 42, the fixed-length file and the long-prefill threshold.
FRONTEND = ROOT / "traffic-2026-12-02b"
# ``traffic-2026-12-02c``: the API server's costs taken apart on a fourth host (the bench's long
# replies to short prompts at 64-512 users, long prompts to short replies at 1-64 users), then
# its limit on the same host (the ShareGPT file at 128 and 256 users, realtime-chat at 30-52
# req/s, four API-server processes). Its terms may be fitted to the streaming runs at 128 and 512
# users and the long prompts at 16 users, chosen before fitting; the rest is held out.
FRONTEND_C = ROOT / "traffic-2026-12-02c"
FRONTEND_FITTED = {
    FRONTEND: {("bench", "sharegpt", 256), ("bench", "sharegpt", 512), ("bench", "poisson", 60),
               ("lab", "realtime-chat/poisson", 36)},
    FRONTEND_C: {("bench", "closed", 128), ("bench", "closed", 512), ("bench", "closed", 16)}}
# How each case of the measurement is read: a fidelity table per kind.
KINDS = {"closed": "closed fixed", "filefixed": "closed fixed", "sharegpt": "closed variable",
         "sharegpt-like": "closed variable",
         "poisson": "open", "gamma b=0.5": "open", "chat": "chat"}
# The traffic `vllm bench serve` can send too; any other workload is a scenario's (SCENARIO_PROMPTS).
BENCH_WORKLOADS = ("random", "sharegpt", "chat", "filefixed")
CONFIGS = {"defaults": {}, "max-num-batched-tokens=2048": {"max-num-batched-tokens": 2048},
           "long-prefill-token-threshold=256": {"long-prefill-token-threshold": 256},
           "api-server-count=4": {"api-server-count": 4},
           **{f"max-num-seqs={n}": {"max-num-seqs": n} for n in (16, 32, 64, 128, 256, 1024)}}


def request_rows(samples: pd.DataFrame, tag: str) -> pd.DataFrame:
    """One run's ok requests as a measurement's ``requests.csv.gz`` keeps them (what
    ``traffic_points`` replays): in send order, times from its first send, the longest gap between
    tokens where the samples kept them."""
    df = samples[samples.status == "ok"].sort_values("start_ts")
    t0 = df.start_ts.min()
    # A sample's gaps are a list (JSON) or an array (parquet); none where the request had one token.
    itl_max = ([float(np.max(x)) if isinstance(x, list | np.ndarray) and len(x) else float("nan")
                for x in df.itl_s] if "itl_s" in df else float("nan"))
    return pd.DataFrame({"tag": tag, "start_s": df.start_ts - t0, "ttft_s": df.ttft_s,
                         "e2e_s": df.e2e_s, "prompt_tokens": df.prompt_tokens,
                         "output_tokens": df.output_tokens, "itl_max_s": itl_max,
                         "scheduled_s": df.scheduled_ts - t0})


def bench_files(root: Path = ROOT) -> list[BenchPoint]:
    """The `vllm bench serve` result files of the older reference set (all fitted)."""
    return [load_point(f) for f in sorted(root.glob("*.json"))]


def runs_of(folder: Path) -> list[dict]:
    """A measurement folder's runs as ``runs.jsonl`` lists them (one per line, in run order)."""
    return [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]


def traffic_points(folder: Path = TRAFFIC) -> list[tuple[BenchPoint, bool]]:
    """Every run of a traffic measurement as (point, fitted), replayed request for request."""
    later = folder in LATER
    requests = pd.read_csv(folder / "requests.csv.gz")
    by_tag = {tag: g for tag, g in requests.groupby("tag", sort=False)}
    out = []
    for run in runs_of(folder):
        rq = by_tag[run["tag"]].sort_values("start_s")
        fig = run["figures"]
        span = "output_throughput" if run["tool"] == "bench" else "bench_def_output_throughput"
        measured = {"output_throughput": fig[span], "p50_ttft_ms": fig["ttft_p50"] * 1e3,
                    "p50_tpot_ms": fig["tpot_p50"] * 1e3, "p99_ttft_ms": fig["ttft_p99"] * 1e3}
        srv = run.get("server") or {}
        if {"server_ttft_mean", "server_queue_mean", "server_prefill_mean"} <= set(srv):
            measured["api_ms"] = 1e3 * (srv["server_ttft_mean"] - srv["server_queue_mean"]
                                        - srv["server_prefill_mean"])
        if "server_prefill_mean" in srv:
            measured["prefill_ms"] = 1e3 * srv["server_prefill_mean"]
        if "server_frontend_lag_mean" in srv:
            measured["lag_ms"] = 1e3 * srv["server_frontend_lag_mean"]
        api_cpu = srv["server_api_cpu"] if "server_api_cpu" in srv else loop_cpu(run.get("cpu") or {})
        if api_cpu is not None:
            measured["api_cpu"] = api_cpu
        open_loop = run["arrival"] != "closed"
        prompts, chat = rq.prompt_tokens.astype(int).tolist(), run["case"] == "chat"
        if run["workload"] not in BENCH_WORKLOADS:  # a scenario's traffic, sent by the lab alone
            prompts, chat = scenario_prompts(run["workload"], prompts)
        # Requests in the order they were sent: the closed loop's pool hands them out so.
        lengths = (round(rq.prompt_tokens.mean()), round(rq.output_tokens.mean()))
        pt = BenchPoint(
            name=f"{run['tool']} {run['case']} {run['level']:g}"
                 # Fixed lengths other than the parity runs' 512/128 (the API server's costs
                 # taken apart) are named by them: two such runs may share a case and a level.
                 + (f" {lengths[0]}/{lengths[1]}" if run["case"] == "closed"
                    and abs(lengths[0] - 512) > 8 else "")
                 # A scenario's replies behind prompts of one length (make calibrate's v256p64
                 # beside v256): named by its prompt length.
                 + (f" p{lengths[0]}" if run["workload"] not in BENCH_WORKLOADS
                    and rq.prompt_tokens.nunique() == 1 else "")
                 + ("" if run["config"] == "defaults" else f" [{run['config']}]"),
            num_prompts=len(rq), input_len=round(rq.prompt_tokens.mean()),
            output_len=round(rq.output_tokens.mean()),
            max_concurrency=None if open_loop else int(run["level"]),
            request_rate=float(run["level"]) if open_loop else float("inf"),
            burstiness=float(run.get("burstiness") or 1.0), measured=measured,
            flags=dict(CONFIGS[run["config"]]),
            prompt_lens=prompts, output_lens=rq.output_tokens.astype(int).tolist(),
            arrival_times=(rq.start_s - rq.start_s.min()).tolist() if open_loop else None,
            chat=chat, kind=KINDS.get(run["case"], "chat" if chat else "open"))
        key = (run["tool"], run["case"], run["level"])
        fitted = run["config"] == "defaults" and (
            key in FRONTEND_FITTED[folder] if folder in FRONTEND_FITTED
            else not later and key in FITTED)
        out.append((pt, fitted))
    return out


def loop_cpu(cpu: dict) -> float | None:
    """The cores the API server's busiest thread (its event loop) used while the run was under
    way, from the parity script's samples of it: the slope between 20% and 80% of its CPU seconds
    (the script's call also covers the tool's start and the drain, when the loop idles)."""
    series = np.asarray(cpu.get("server_api_busiest_thread_series") or [], dtype=float)
    if len(series) < 3 or series[-1, 1] < 0.5:
        return None
    total = series[-1, 1]
    i, j = np.searchsorted(series[:, 1], [0.2 * total, 0.8 * total])
    j = min(j, len(series) - 1)
    span = series[j, 0] - series[i, 0]
    return float((series[j, 1] - series[i, 1]) / span) if span > 0 else None


# The lab's scenarios measured here, their prompts as their workloads built them then: the
# shared system prompt's tokens (vllm_lab.traffic.workloads.shared_prefix_length: 30% of
# realtime-chat's mean of 163, rounded), the prefix groups, chat or not, and the served model
# whose chat template wraps each message. Kept as measured, so a scenario edited later does not
# change what these runs were (tests/test_twin_agreement.py holds the shipped ones to it).
SCENARIO_PROMPTS = {"realtime-chat": (49, 1, True, "meta-llama/Meta-Llama-3-8B-Instruct"),
                    "default": (0, 1, False, "meta-llama/Meta-Llama-3-8B-Instruct")}


def scenario_prompts(name: str, lengths: list[int]) -> tuple[list, bool]:
    """A scenario's measured requests as its workload built them (``SCENARIO_PROMPTS``), and
    whether they were chat."""
    from vllm_lab.twin.prompts import shared_prefix_prompts, template_tokens

    shared, groups, chat, model = SCENARIO_PROMPTS[name]
    template = template_tokens(model, None, shared > 0) if chat else 0
    return shared_prefix_prompts(lengths, shared, groups, template), chat


def fit_set() -> list[BenchPoint]:
    """The points the H200 profile's engine terms are fitted to."""
    return bench_files() + [p for p, fitted in traffic_points() if fitted]


def frontend_fit_set() -> list[BenchPoint]:
    """The points its API-server terms are fitted to: the engine's fit set (which they must not
    make worse) and the measurement of the API server's limit."""
    return fit_set() + [p for folder in FRONTEND_FITTED
                        for p, fitted in traffic_points(folder) if fitted]


def held_out_set(folders: tuple[Path, ...] = (TRAFFIC,)) -> list[BenchPoint]:
    """The measurements' points the fit never saw."""
    return [p for folder in folders for p, fitted in traffic_points(folder) if not fitted]


# The fidelity goals per traffic kind: median |error| of each metric, and the worst for the first three.
GOALS = {"output_throughput": (0.10, 0.25), "p50_ttft_ms": (0.10, 0.25),
         "p50_tpot_ms": (0.10, 0.25), "p99_ttft_ms": (0.15, None)}
# Read beside them, with no goal: the API server's share of TTFT (vLLM's own histograms), the
# engine's (its prefill histogram: from a request's first scheduling to its first token), its
# streams' lag, and the cores it used (its process's CPU counter, or in the older measurements its
# event loop's thread as sampled beside the run).
DIAGNOSTICS = ("api_ms", "prefill_ms", "lag_ms", "api_cpu")


def errors(points: list[BenchPoint], profile, model) -> pd.DataFrame:
    """Per point and metric: its kind, measured, predicted and the relative error."""
    from vllm_lab.twin.fit import compare

    return pd.DataFrame(compare(points, profile, model, metrics=(*GOALS, *DIAGNOSTICS)))


def by_kind(errs: pd.DataFrame) -> pd.DataFrame:
    """Median and worst |error| per kind and metric, with whether the goals hold."""
    rows = []
    for (kind, metric), g in errs[errs["metric"].isin(GOALS)].groupby(["kind", "metric"], sort=False):
        a = g["error"].abs()
        median_goal, worst_goal = GOALS[metric]
        ok = a.median() <= median_goal and (worst_goal is None or a.max() <= worst_goal)
        rows.append({"kind": kind, "metric": metric, "runs": len(g), "median": a.median(),
                     "worst": a.max(), "goal": f"{median_goal:.0%}" + (
                         f" / {worst_goal:.0%}" if worst_goal else ""), "met": ok})
    return pd.DataFrame(rows)


def parts_by_kind(errs: pd.DataFrame) -> pd.DataFrame:
    """Per kind, the median signed error of each diagnostic (``DIAGNOSTICS``) over the runs that
    measured it: which side of a request's way (the engine's prefill, the API server) the twin
    reads short or long, where the medians of |error| by kind only say how far."""
    d = errs[errs["metric"].isin(DIAGNOSTICS)]
    return (d.groupby(["kind", "metric"], sort=False)["error"].agg(["count", "median"])
            .rename(columns={"count": "runs"}).reset_index())


def by_api_load(errs: pd.DataFrame, metric: str = "p50_ttft_ms") -> pd.DataFrame:
    """The median |error| of ``metric`` and the share of runs past 25%, for the runs where the
    twin's own API server is below ``frontend.LIMIT_CPU`` and for those at or past it: how far a
    user may trust a prediction by what the prediction itself says."""
    from vllm_lab.twin.frontend import LIMIT_CPU

    d = errs[errs["metric"] == metric]
    rows = []
    for label, runs in ((f"below {LIMIT_CPU:g} of a core", d[d["twin_api_cpu"] < LIMIT_CPU]),
                        (f"at or past {LIMIT_CPU:g}", d[d["twin_api_cpu"] >= LIMIT_CPU])):
        a = runs["error"].abs()
        rows.append({"twin's API server": label, "runs": len(runs), "median": a.median(),
                     "past 25%": (a > 0.25).mean(), "kinds": ", ".join(sorted(set(runs["kind"])))})
    return pd.DataFrame(rows)


def api_limit_band(errs: pd.DataFrame, folders: tuple[Path, ...], profile, model) -> pd.DataFrame:
    """The held-out runs past ``frontend.LIMIT_CPU`` (``errs``: ``held_out_errors`` of
    ``folders``), each with its measured TTFT p50, the twin's (the engine's limit) and the twin's
    at the API server's own limit (``profile.at_api_limit``: all the excess waiting for
    admission), and whether the measured one lies between them, 10% either side allowed."""
    from vllm_lab.twin.fit import predicted_metrics, replay
    from vllm_lab.twin.frontend import LIMIT_CPU
    from vllm_lab.twin.profile import at_api_limit

    limit, rows = at_api_limit(profile), []
    for folder in folders:
        ttft = errs[(errs["folder"] == folder.name) & (errs["metric"] == "p50_ttft_ms")]
        points = held_out_set((folder,))
        assert len(points) == len(ttft), folder  # one row a point, in the set's order
        for pt, (_, row) in zip(points, ttft.iterrows()):
            if row["twin_api_cpu"] >= LIMIT_CPU:
                high = predicted_metrics(replay(pt, limit, model))["p50_ttft_ms"]
                low, top = min(row["predicted"], high), max(row["predicted"], high)
                rows.append({"folder": folder.name, "point": pt.name, "kind": pt.kind,
                             "measured": row["measured"], "engine": row["predicted"],
                             "api_limit": high,
                             "inside": 0.9 * low <= row["measured"] <= 1.1 * top})
    return pd.DataFrame(rows)


def held_out_errors(folders: tuple[Path, ...], profile, model) -> pd.DataFrame:
    """``errors`` of each folder's held-out runs, the folder named: a point's repeats are its
    runs of one name in one folder (one host, one server start or a few)."""
    return pd.concat([errors(held_out_set((f,)), profile, model).assign(folder=f.name)
                      for f in folders], ignore_index=True)


# Folders that hold two hosts' runs (their READMEs say which): runs whose case names this word were
# taken on the folder's second host.
SECOND_HOST = {"traffic-2026-12-03": "gamma", "traffic-2026-12-03b": "gamma"}
# The scales the leave-one-out below tries: every other of fit.HOST_SCALES, 0.6-1.5 by 0.1 (each
# scale is one more prediction of every held-out run).
LOO_SCALES = HOST_SCALES[::2]


def host_of(folder: Path, point: str) -> str:
    """The host a folder's run was measured on: the folder's, or its second host's."""
    word = SECOND_HOST.get(folder.name)
    return folder.name + (" (second host)" if word and word in point else "")


def host_calibrated_errors(folders: tuple[Path, ...], profile, model,
                           scales: tuple[float, ...] = LOO_SCALES) -> pd.DataFrame:
    """``held_out_errors`` on hosts calibrated as ``make calibrate FIT=host`` would: each run
    predicted with its host's CPU scale (fit.best_host_scale) fitted on that host's other runs,
    never on itself (leave one out). The ``host`` and ``scale`` columns say which."""
    from vllm_lab.twin.fit import best_host_scale, compared, host_logs, predicted_metrics, replay
    from vllm_lab.twin.profile import on_host

    metrics = (*GOALS, *DIAGNOSTICS)
    rows = []
    for f in folders:
        pts = held_out_set((f,))
        # Every run predicted once at every scale: got[scale][run] is its predicted metrics.
        got = [[predicted_metrics(replay(p, on_host(profile, s), model)) for p in pts] for s in scales]
        logs = np.stack([host_logs(pts, g) for g in got])
        hosts = [host_of(f, p.name) for p in pts]
        for j, p in enumerate(pts):
            others = [i for i, h in enumerate(hosts) if h == hosts[j] and i != j]
            scale = best_host_scale(logs[:, others], scales)
            rows += [{**row, "folder": f.name, "host": hosts[j], "scale": scale}
                     for row in compared(p, got[scales.index(scale)][j], metrics)]
    return pd.DataFrame(rows)


def repeat_spread(errs: pd.DataFrame, min_runs: int = 3) -> pd.DataFrame:
    """Per kind and metric, over the points run at least ``min_runs`` times in one folder: how far
    a run lies from its point's median (``spread``, the median of |run / median - 1|: what even a
    prediction of that median would miss a single run by), and how far the twin's prediction lies
    from that median (``twin``, the median over the points). Where ``twin`` is near ``spread`` the
    twin's error is the measurement's own scatter; where it is well above, it is the twin's."""
    runs, points = [], []
    goals = errs[errs["metric"].isin(GOALS)]
    for (folder, point, metric), g in goals.groupby(["folder", "point", "metric"], sort=False):
        if len(g) < min_runs:
            continue
        median = g["measured"].median()
        runs += [{"kind": g["kind"].iloc[0], "metric": metric, "off": abs(v / median - 1)}
                 for v in g["measured"]]
        points.append({"kind": g["kind"].iloc[0], "metric": metric,
                       "twin": abs(g["predicted"].median() / median - 1)})
    if not points:
        return pd.DataFrame(columns=["kind", "metric", "points", "runs", "spread", "twin"])
    by = ["kind", "metric"]
    spread = pd.DataFrame(runs).groupby(by, sort=False)["off"].agg(runs="size", spread="median")
    twin = pd.DataFrame(points).groupby(by, sort=False)["twin"].agg(points="size", twin="median")
    return twin.join(spread)[["points", "runs", "spread", "twin"]].reset_index()


def host_spread(errs: pd.DataFrame) -> pd.DataFrame:
    """Per kind and metric, over the points measured in two folders or more (other hosts, other
    days): how far a folder's median of a point lies from the median over the folders
    (``spread``, the median of |folder / folders - 1|: what one profile would miss a host by
    even where it were exact for the typical one), and the twin's distance from each folder's
    median (``twin``, the median over the folders). Where ``twin`` is at or below ``spread``, a
    host's own calibration (``make calibrate``) is what can bring the twin closer."""
    goals = errs[errs["metric"].isin(GOALS)]
    folders = (goals.groupby(["kind", "metric", "point", "folder"], sort=False)
               [["measured", "predicted"]].median().reset_index())
    rows = []
    for (kind, metric, _), g in folders.groupby(["kind", "metric", "point"], sort=False):
        if len(g) < 2:
            continue
        median = g["measured"].median()
        rows += [{"kind": kind, "metric": metric, "off": abs(m / median - 1),
                  "twin": abs(p / m - 1)} for m, p in zip(g["measured"], g["predicted"])]
    if not rows:
        return pd.DataFrame(columns=["kind", "metric", "folders", "spread", "twin"])
    return (pd.DataFrame(rows).groupby(["kind", "metric"], sort=False)
            .agg(folders=("off", "size"), spread=("off", "median"), twin=("twin", "median"))
            .reset_index())


# Where a fit of the API server's terms starts (a share at its lower bound would not move).
FRONTEND_START = {"frontend_token_s": 1.1e-4, "frontend_delivery_share": 0.3,
                  "frontend_prompt_token_s": 3e-6}


def fit_frontend(profile_name: str = "h200-llama-3-8b", max_evals: int = 200):
    """The profile with its API-server terms (fit.FRONTEND_PARAMS) refitted to
    ``frontend_fit_set()`` from FRONTEND_START, the engine's terms and the chat cost held."""
    from vllm_lab.models import load_model_shape
    from vllm_lab.twin.fit import FRONTEND_PARAMS, fit_profile
    from vllm_lab.twin.profile import load_profile

    base = load_profile(profile_name)
    base = base.model_copy(update={"coefficients": base.coefficients.model_copy(
        update=FRONTEND_START)})
    return fit_profile(frontend_fit_set(), base, load_model_shape(base.model), max_evals=max_evals,
                       params=FRONTEND_PARAMS, starts=(1.0,))


if __name__ == "__main__":  # python -m vllm_lab.twin.reference PROFILE_OUT.yaml
    import sys

    from vllm_lab.twin.fit import FRONTEND_PARAMS

    fitted = fit_frontend()
    Path(sys.argv[1]).write_text(fitted.to_yaml())
    print({name: getattr(fitted.coefficients, name) for name, *_ in FRONTEND_PARAMS})


# --- the TTFT's shape (make bench NAME=twin ARGS=shape) ---------------------------------------

@functools.cache
def _server_raw(path: Path) -> dict[str, dict]:
    """A folder's ``server-raw.jsonl.gz``, run tag to its metrics, read once for all its runs."""
    import gzip

    with gzip.open(path, "rt") as f:
        return {r["tag"]: r["raw"] for r in map(json.loads, f)}


def server_shares(folder: Path, tag: str, edges: tuple[float, ...],
                  metric: str = "time_to_first_token_seconds") -> list[float] | None:
    """The share of a run's requests vLLM's own histogram ``metric`` put at or under each of
    ``edges`` (seconds; each a bucket bound), from the folder's ``server-raw.jsonl.gz``; None
    where the folder or the run has none."""
    path = folder / "server-raw.jsonl.gz"
    if not path.exists():
        return None
    buckets = _server_raw(path).get(tag, {}).get(f"vllm:{metric}_bucket")
    if not buckets:
        return None
    counts = {float(json.loads(k)["le"]): v for k, v in buckets.items()}
    total = max(counts.values())
    return [counts[e] / total if total else float("nan") for e in edges]


# vLLM's iteration-tokens buckets up to 8,192 tokens, the default max-num-batched-tokens.
STEP_EDGES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def step_token_shares(step_tokens: np.ndarray, edges: tuple[float, ...] = STEP_EDGES) -> list[float]:
    """The share of a prediction's steps that carried at most each of ``edges`` tokens, from its
    ``step_tokens`` rows of (tokens, steps): vLLM's iteration-tokens histogram, cumulated."""
    tokens, steps = step_tokens[:, 0], step_tokens[:, 1]
    total = steps.sum()
    return [float(steps[tokens <= e].sum() / total) if total else float("nan") for e in edges]


def step_sizes(folder: Path, profile, model, names: tuple[str, ...]) -> pd.DataFrame:
    """For the runs of ``folder`` named in ``names``: the share of the engine's steps by the tokens
    each carried (vLLM's iteration-tokens histogram against the twin's steps), per bucket of
    ``STEP_EDGES`` (``tokens`` is the bucket's upper bound, ``>8192`` the rest), and each
    side's count of steps in the row ``steps``."""
    from vllm_lab.twin.fit import replay

    runs = runs_of(folder)
    buckets = [*map(str, STEP_EDGES), f">{STEP_EDGES[-1]}"]
    rows = []
    for (pt, _fitted), run in zip(traffic_points(folder), runs):
        if pt.name not in names:
            continue
        measured = server_shares(folder, run["tag"], STEP_EDGES, "iteration_tokens_total")
        if measured is None:
            continue
        pred = replay(pt, profile, model)
        counts = _server_raw(folder / "server-raw.jsonl.gz")[run["tag"]]["vllm:iteration_tokens_total_count"]
        rows.append({"point": pt.name, "tokens": "steps", "vLLM": float(sum(counts.values())),
                     "twin": float(pred.step_tokens[:, 1].sum())})
        # Each bucket's share: the cumulated shares' steps, from 0 below the first to 1 past the last.
        rows += [{"point": pt.name, "tokens": bucket, "vLLM": float(v), "twin": float(t)}
                 for bucket, v, t in zip(buckets, np.diff([0.0, *measured, 1.0]),
                                         np.diff([0.0, *step_token_shares(pred.step_tokens), 1.0]))]
    return pd.DataFrame(rows)


def after_first_token_stamp(folders: tuple[Path, ...]) -> pd.DataFrame:
    """Per run with vLLM's TTFT histogram: the client's mean TTFT less vLLM's (``after_ms``): what
    the API server's streaming and the client add after vLLM stamps a request's first token,
    beside the run's output tokens a second (``tok_s``)."""
    rows = []
    for folder in folders:
        requests = pd.read_csv(folder / "requests.csv.gz")
        for run in runs_of(folder):
            server = run.get("server") or {}
            if "server_ttft_mean" not in server:
                continue
            rq = requests[requests.tag == run["tag"]]
            span = (rq.start_s + rq.e2e_s).max() - rq.start_s.min()
            rows.append({"folder": folder.name, "kind": KINDS.get(run["case"], "chat"),
                         "case": run["case"], "level": run["level"], "config": run["config"],
                         "tok_s": rq.output_tokens.sum() / span,
                         "after_ms": 1e3 * (rq.ttft_s.mean() - server["server_ttft_mean"])})
    return pd.DataFrame(rows)


def api_server_probe(folder: Path = PROBED, middle: float = 0.6) -> pd.DataFrame:
    """Per run of a probed folder, over the middle ``middle`` of the seconds it kept the server busy
    (from the first to the last second of at least half its busiest seconds' CPU: a tool's own
    start and the drain left out): the API server's cores, the median over seconds of a callback's
    mean wait on its event loop and of its longest, and its share of time in collections."""
    probe = pd.read_csv(folder / "api-server-probe.csv.gz", comment="#")
    rows = []
    for run in runs_of(folder):
        during = probe[probe.ts.between(run["started"], run["started"] + run["wall_s"])]
        cpu = during.cpu_s.diff() / during.ts.diff()
        busy = np.flatnonzero(cpu >= 0.5 * cpu.quantile(0.9))
        during = during.iloc[busy[0]:busy[-1] + 1]
        skip = int(len(during) * (1 - middle) / 2)
        w = during.iloc[skip:len(during) - skip]
        span = w.ts.iloc[-1] - w.ts.iloc[0]
        gc_s = (w.s0 + w.s1 + w.s2).iloc[-1] - (w.s0 + w.s1 + w.s2).iloc[0]
        rows.append({"run": f"{run['tool']} {run['case']} {run['level']:g}",
                     "cores": (w.cpu_s.iloc[-1] - w.cpu_s.iloc[0]) / span,
                     "loop_mean_ms": w.loop_mean_ms.median(), "loop_max_ms": w.loop_max_ms.median(),
                     "gc_share": gc_s / span})
    return pd.DataFrame(rows)


def first_token_groups(send_s, ttft_s, tolerance_s: float = 0.0015) -> dict[str, float]:
    """Requests whose first tokens reached the client together (within ``tolerance_s`` of the one
    before): the prompts one engine step finished. Per group of two or more: how many requests a
    group holds on average (``per_group``, every request counted), the share of requests in such
    groups (``grouped``), the median and 90th percentile of their sends' spread (``spread_ms``,
    ``spread_p90_ms``), and the median TTFT of each group's first sent against the others'
    (``first_ms``, ``later_ms``): how long the engine gathers arrivals into one step, and what
    the first to arrive pays for it."""
    send, ttft = np.asarray(send_s, dtype=float), np.asarray(ttft_s, dtype=float)
    first_token = send + ttft
    order = np.argsort(first_token)
    group = np.empty(send.size, dtype=int)
    group[order] = np.concatenate([[0], np.cumsum(np.diff(first_token[order]) > tolerance_s)])
    frame = pd.DataFrame({"group": group, "send": send, "ttft": ttft})
    by_group = frame.groupby("group")["send"]
    grouped = by_group.transform("size") > 1
    many = frame[grouped]
    first = (by_group.transform("min") == frame["send"])[grouped]
    spread = many.groupby("group")["send"].agg(lambda s: s.max() - s.min())
    return {"per_group": send.size / frame["group"].nunique(), "grouped": float(grouped.mean()),
            "spread_ms": 1e3 * float(spread.median()),
            "spread_p90_ms": 1e3 * float(spread.quantile(0.9)),
            "first_ms": 1e3 * float(many.loc[first, "ttft"].median()),
            "later_ms": 1e3 * float(many.loc[~first, "ttft"].median())}


def ttft_by_recent_sends(send_s, measured, predicted, window_s: float = 0.05,
                         most: int = 4) -> pd.DataFrame:
    """Median TTFT, measured and predicted, by how many requests were sent in the ``window_s``
    before each (``most`` standing for that many or more): how much a burst of arrivals costs."""
    send = np.asarray(send_s, dtype=float)
    lo = np.searchsorted(send, send - window_s, side="right")
    recent = np.minimum(np.arange(send.size) - lo, most)
    frame = pd.DataFrame({"sent before": recent, "measured": np.asarray(measured) * 1e3,
                          "twin": np.asarray(predicted) * 1e3})
    return frame.groupby("sent before").agg(requests=("measured", "size"),
                                            measured=("measured", "median"),
                                            twin=("twin", "median"))
