"""The twin's benchmarks: fidelity against real vLLM, direction of each knob, predictor speed.

    .venv/bin/python scripts/bench_twin.py [fidelity|hosts|shape|direction|speed|steps ...] [--reference DIR]

``hosts`` (not in the default set: about 70 s) re-reads the held-out runs with each host calibrated
as ``make calibrate FIT=host`` would, from its other runs. ``shape`` (not in the default set) shows
what the medians by kind do not: the part of a TTFT after vLLM's own first-token stamp, and the
spread of the twin's TTFT against vLLM's and the client's on open loops. ``fidelity`` ends with
the other GPUs' profiles against their own calibration and the runs held out of it (``OTHER_GPUS``).
``steps`` (not in the default set) prices each step vLLM's engine ran alone
(scripts/bench_step_times.py, ``STEP_FILES``) and sets it beside the twin's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from vllm_lab.models import load_model_shape
from vllm_lab.scenarios import Scenario
from vllm_lab.twin.fit import compare, load_point
from vllm_lab.twin.predictor import (
    CLIENT_TURNAROUND_S,
    Closed,
    PredictRequest,
    predict,
    sharegpt_like,
)
from vllm_lab.twin.profile import load_profile, on_host
from vllm_lab.twin.steptime import chunk_pairs

# The measurements the H200 profile is fitted to (vllm bench serve result files, kept with the twin).
REFERENCE = Path(__file__).resolve().parents[1] / "vllm_lab/twin/reference/h200-vllm0.26"


def fidelity(profile, model, ref: Path) -> None:
    """Predicted vs measured output throughput, TTFT p50 and TPOT p50 for every reference file."""
    points = [load_point(f) for f in sorted(ref.glob("*.json"))]
    print(f"\n## Fidelity: {profile.name} vs {ref}")
    print(f"{'file':14s} {'metric':18s} {'measured':>10s} {'twin':>10s} {'error':>8s}")
    print_compared(compare(points, profile, model), 14)


def print_compared(rows: list[dict], width: int) -> None:
    """``fit.compare``'s rows, a line each (the point's name ``width`` wide), then each metric's
    median and worst |error|."""
    for r in rows:
        print(f"{r['point']:{width}s} {r['metric']:18s} {r['measured']:10.2f} {r['predicted']:10.2f} "
              f"{r['error']:+8.1%}")
    for metric in ("output_throughput", "p50_ttft_ms", "p50_tpot_ms"):
        errs = [abs(r["error"]) for r in rows if r["metric"] == metric]
        print(f"{metric:18s} median |error| {statistics.median(errs):6.1%}   worst {max(errs):6.1%}")


# GPUs other than the H200, each with its own profile, fitted by make calibrate to a committed
# example's store: (profile, store, the calibration's experiment, experiments held out of it).
# The H100's held-out staircases are those of the hosts whose CPU is the profile's (the first,
# `-h`, whose defaults measured where the profile put them, and `-d`, whose API server spent the
# profile host's CPU a token); `-b` and `-g` were other CPUs.
EXAMPLES = Path(__file__).resolve().parents[1] / "reports/examples"
OTHER_GPUS = (("h100-llama-3-8b", EXAMPLES / "h100/lab.db", "h100-calibrate",
               ("h100-baseline-repeats",
                *(f"autotune-realtime-chat-h100{host}-{c}" for host in ("", "-h")
                  for c in ("defaults", "c1", "c2")),
                "h100-chat-eager-d", "h100-chat-defaults-d")),)
# Autotunes on other hosts of those GPUs, whose defaults' staircase read the host's CPU scale
# (summary.json's host_scale): their other candidates' staircases, held out of that reading, are
# predicted on the profile moved to the host, as autotune aimed them.
HOSTS_READ = (("h100-llama-3-8b", EXAMPLES / "h100/lab.db",
               ("autotune-realtime-chat-h100-g", "autotune-realtime-chat-h100-i")),)
# Hosts calibrated on themselves (the profile make calibrate wrote for the host) and runs held
# out of that calibration, each read on that profile and on the shipped one (which never saw the
# host): (shipped profile, store, the host's profile, held-out experiments).
CALIBRATED_HOSTS = (("h100-llama-3-8b", EXAMPLES / "h100/lab.db",
                     EXAMPLES / "h100/h100-calibrate-b/h100-llama-3-8b.yaml",
                     ("h100-baseline-60s", "h100-chat-stairs-b")),
                    ("h100-llama-3-8b", EXAMPLES / "h100/lab.db",
                     EXAMPLES / "h100/h100-calibrate-c/h100-llama-3-8b.yaml",
                     ("h100-chat-defaults-c",)))


def other_gpus(model) -> None:
    """Each other GPU's profile against its calibration (fitted) and the runs held out of it,
    every run replayed request for request."""
    from vllm_lab import calibrate
    from vllm_lab.store import Store

    for name, store_path, fitted_exp, held_exps in OTHER_GPUS:
        profile = load_profile(name)
        with Store(store_path) as store:
            sets = [("fitted", calibrate.bench_points(store, fitted_exp))]
            sets += [("held out", calibrate.replayed_runs(store, exp, exp)) for exp in held_exps]
        for label, points in sets:
            print(f"\n## Fidelity on {profile.hardware.name}, {label}: {name} vs {store_path.parent.name}")
            print_compared(compare(points, profile, model), 26)
    for name, store_path, autotunes in HOSTS_READ:
        for exp in autotunes:
            scale = json.loads((store_path.parent / exp / "summary.json").read_text())["host_scale"]
            with Store(store_path) as store:
                points = [p for c in ("c1", "c2") for p in calibrate.replayed_runs(store, f"{exp}-{c}", f"{exp}-{c}")]
            print(f"\n## Fidelity on another host, held out: {name} on the host {exp}'s defaults read "
                  f"(CPU x{scale})")
            print_compared(compare(points, on_host(load_profile(name), scale), model), 32)
    for shipped, store_path, fitted_path, held_exps in CALIBRATED_HOSTS:
        with Store(store_path) as store:
            points = [p for exp in held_exps for p in calibrate.replayed_runs(store, exp, exp)]
        for label, profile in ((f"{fitted_path.parent.name}'s profile", load_profile(fitted_path)),
                               (f"the shipped {shipped}", load_profile(shipped))):
            print(f"\n## Fidelity on a host calibrated on itself, held out: {label} on "
                  f"{', '.join(held_exps)}")
            print_compared(compare(points, profile, model), 26)


# Closed-loop runs on the same H200, held out of the fit: file -> the flags over vLLM's defaults.
# Each lab run carries the client turnaround its samples showed (figures.turnaround_mean).
HELD_OUT = REFERENCE / "lab-closed-loop-2026-12-01"
HELD_OUT_FLAGS = {"defaults-runs.jsonl": {}, "eager-runs.jsonl": {"enforce-eager": True}}
HELD_OUT_METRICS = (("output_throughput", "output_throughput", 1.0),
                    ("ttft_p50", "ttft_p50", 1e3), ("tpot_p50", "tpot_p50", 1e3),
                    ("server_queue_mean", "queue_mean", 1e3))


def held_out_prediction(flags, profile, model, users: int, requests: int, whole_run: bool,
                        turnaround_s: float = CLIENT_TURNAROUND_S, seeds: int = 5) -> dict:
    """The predictor's figures for one closed-loop run of 512/128-token requests, as it was summarized:
    over the lab's steady window, or first send to last reply (``whole_run``, vllm bench serve).

    The closed loop's users come back after the turnaround the run's client measured (these lab
    runs predate the lab's fix: 10-16 ms), and the figures are the mean over ``seeds`` runs of
    the predictor: with identical requests the TTFT p50 of one run jumps between batches."""
    from vllm_lab.prediction import prediction_samples
    from vllm_lab.scenarios import Slo
    from vllm_lab.summary import summarize

    runs = []
    for seed in range(seeds):
        p = predict(flags, profile, model, [PredictRequest(512, 128)] * requests,
                    Closed(users, turnaround_s=turnaround_s), seed=seed)
        s = summarize(prediction_samples(p.requests), Slo(),
                      duration_s=p.duration_s if whole_run else None)
        s["queue_mean"] = float(p.requests["queue_s"].mean())
        runs.append(s)
    return {k: statistics.fmean(r[k] for r in runs) for k in ("output_throughput", "ttft_p50",
                                                              "tpot_p50", "queue_mean")}


def held_out(profile, model, folder: Path = HELD_OUT) -> dict[str, list[float]]:
    """Every held-out run re-predicted: throughput, TTFT p50, TPOT p50, the server's queue mean.
    Returns each metric's |relative error| per run."""
    print(f"\n## Fidelity held out: {profile.name} vs {folder}")
    print(f"{'run':24s} {'metric':18s} {'measured':>10s} {'twin':>10s} {'error':>8s}")
    errs: dict[str, list[float]] = {m: [] for m, _k, _s in HELD_OUT_METRICS}
    cache: dict[tuple, dict] = {}
    for name, flags in HELD_OUT_FLAGS.items():
        for line in (folder / name).read_text().splitlines():
            run = json.loads(line)
            measured = {**run["figures"], **run.get("server", {})}
            turnaround = run["figures"].get("turnaround_mean", CLIENT_TURNAROUND_S)
            key = (name, run["users"], run["requests"], run["tool"], turnaround)
            if key not in cache:
                cache[key] = held_out_prediction(flags, profile, model, run["users"],
                                                 run["requests"], run["tool"] == "bench", turnaround)
            got = cache[key]
            label = f"{name.split('-')[0]} {run['users']} {run['run']}"
            for metric, key_p, scale in HELD_OUT_METRICS:
                m = measured.get(metric)
                if m is None:
                    continue
                e = (got[key_p] - m) / m
                errs[metric].append(abs(e))
                print(f"{label:24s} {metric:18s} {m * scale:10.2f} {got[key_p] * scale:10.2f} {e:+8.1%}")
    for metric, values in errs.items():
        if values:
            print(f"{metric:18s} median |error| {statistics.median(values):6.1%}   "
                  f"worst {max(values):6.1%}   ({len(values)} runs)")
    return errs


# Open-loop staircases measured on real vLLM and stored by the lab: each level is re-predicted from
# its recorded scenario. The defaults' levels fitted frontend_chat_s; the other candidates' are
# held out (api-server-count 4 among them).
STAIRCASES = Path(__file__).resolve().parents[1] / "reports/examples/autotune-h200/lab.db"
# frontend_chat_s was fitted to the first run's defaults only; the second run (-b) is held out whole.
FITTED_ON = ("autotune-realtime-chat-h200-defaults",)


def staircases(db: Path = STAIRCASES) -> None:
    """Each stored staircase level: TTFT p99, TPOT p99, the SLO verdict and, where the store kept
    vLLM's process series, the API-server process's CPU (cores), measured vs predicted."""
    from vllm_lab.audit import server_view
    from vllm_lab.backends import PredictBackend
    from vllm_lab.store import Store

    with Store(db) as store:
        runs = store.runs()
        views = {run.run_key: server_view(store.server_metrics(run.experiment_id, run.run_key))
                 for run in runs.itertuples()}
    print(f"\n## Fidelity on stored staircases: {db}")
    print(f"{'candidate':24s} {'set':8s} {'level':>7s} {'TTFT p99 ms':>17s} {'TPOT p99 ms':>15s} {'SLO':>13s}"
          f" {'API CPU':>13s}")
    agree = {"fit": [], "held-out": []}
    for run in runs.sort_values(["experiment_id", "started"]).itertuples():
        scenario = Scenario.model_validate(json.loads(run.scenario_json))
        p = PredictBackend().measure(scenario, None, Path(".")).summary
        kind = "fit" if run.experiment_id in FITTED_ON else "held-out"
        agree[kind].append(bool(run.summary["meets_slo"]) == bool(p["meets_slo"]))
        view = views[run.run_key]
        cpu = (f"{view.api_cpu:6.2f} /{p['server_api_cpu']:5.2f}"
               if view is not None and view.api_cpu is not None else "")
        print(f"{run.experiment_id.removeprefix('autotune-realtime-chat-h200-'):24s} {kind:8s} {run.point['load.shape.level']:7.2f} "
              f"{run.ttft_p99 * 1e3:8.0f} /{p['ttft_p99'] * 1e3:7.0f} {run.tpot_p99 * 1e3:6.1f} /"
              f"{p['tpot_p99'] * 1e3:6.1f} {bool(run.summary['meets_slo'])!s:>6s}/{p['meets_slo']!s:6s} {cpu}")
    for kind, same in agree.items():
        if same:
            print(f"SLO verdict agrees on {sum(same)} of {len(same)} {kind} levels")


def by_kind(profile, model) -> None:
    """The traffic measurement's runs, held out and fitted, re-predicted request for request: the
    errors by traffic kind against the goals (vllm_lab/twin/reference.py says which were fitted)."""
    import pandas as pd

    from vllm_lab.twin import reference

    pd.set_option("display.width", 200)
    # Every held-out run predicted once: the tables per folder below and the spreads after them.
    held = reference.held_out_errors((reference.TRAFFIC, *reference.LATER, *reference.REPEATS),
                                     profile, model)
    fitted = reference.errors([p for p, fit in reference.traffic_points() if fit], profile, model)
    sets = [("held out", reference.TRAFFIC, held[held["folder"] == reference.TRAFFIC.name]),
            ("fitted", reference.TRAFFIC, fitted)]
    sets += [("held out", later, held[held["folder"] == later.name]) for later in reference.LATER]
    for label, folder, errs in sets:
        print(f"\n## Fidelity by traffic kind, {label}: {profile.name} vs {folder.name}")
        print(errs.pivot_table(index="point", columns="metric", values="error", sort=False)
              .map(lambda v: f"{v:+.1%}").to_string())
        print_by_kind(errs)
    print("\n## The parts of TTFT, held out, every folder: median signed error by kind (vLLM's"
          " histograms: api_ms = TTFT less queue and prefill, prefill_ms = first scheduled to"
          " first token)")
    parts = reference.parts_by_kind(held)
    print(parts.assign(median=parts["median"].map("{:+.1%}".format)).to_string(index=False))
    print("\n## Held out, by the twin's own API-server load (its predicted cores a process): TTFT p50"
          " |error|, median and share past 25%")
    load = reference.by_api_load(held)
    print(load.assign(median=load["median"].map("{:.1%}".format),
                      **{"past 25%": load["past 25%"].map("{:.0%}".format)}).to_string(index=False))
    folders = (reference.TRAFFIC, *reference.LATER, *reference.REPEATS)
    band = reference.api_limit_band(held, folders, profile, model)
    print(f"\nPast it, the twin's TTFT p50 at the engine's limit and at the API server's "
          f"(profile.at_api_limit) hold the measured one between them (10% either side) on "
          f"{band['inside'].sum()} of {len(band)} runs; the upper bound is "
          f"{(band['api_limit'] / band['engine']).median():.1f}x the lower (median)")
    repeats = ("Points run three times or more in one folder: a run's distance from its point's "
               "median (spread) beside the twin's (twin), medians")
    hosts = ("Points measured in two folders or more (hosts, days): a folder's distance from the "
             "folders' median (spread) beside the twin's from the folder's (twin), medians")
    for title, table in ((repeats, reference.repeat_spread(held)),
                         (hosts, reference.host_spread(held))):
        print(f"\n## {title}")
        print(table.assign(spread=table["spread"].map("{:.1%}".format),
                           twin=table["twin"].map("{:.1%}".format)).to_string(index=False))


def print_by_kind(errs) -> None:
    """reference.by_kind's table of ``errs``, its medians and worsts in percent."""
    from vllm_lab.twin import reference

    table = reference.by_kind(errs)
    print(table.assign(median=table["median"].map("{:.1%}".format),
                       worst=table["worst"].map("{:.1%}".format)).to_string(index=False))


def hosts(profile, model) -> None:
    """Every held-out run by kind, pooled, with the shipped profile and with its host's CPU scale
    fitted on that host's other runs (reference.host_calibrated_errors): how much of the twin's
    error is the host's CPU, which one factor per host takes out."""
    import pandas as pd

    from vllm_lab.twin import reference

    pd.set_option("display.width", 200)
    folders = (reference.TRAFFIC, *reference.LATER)
    one = reference.held_out_errors(folders, profile, model)
    calibrated = reference.host_calibrated_errors(folders, profile, model)
    for title, errs in (("one profile for every host", one),
                        ("each host's CPU scale fitted on its other runs", calibrated)):
        print(f"\n## Held out, pooled, {title}: {profile.name}")
        print_by_kind(errs)
    scales = calibrated.groupby("host", sort=False)["scale"].agg(["min", "max"])
    print("\n## The hosts' CPU scales (the profile's host: 1)")
    print(scales.to_string())


# The TTFT bounds (seconds, each a bound of vLLM's histogram) the shape section reads shares at.
SHAPE_EDGES = (0.04, 0.06, 0.08, 0.1)


# The runs whose engine steps `shape` sets beside vLLM's: variable lengths below and at the API
# server's limit, and Poisson arrivals.
STEP_POINTS = ("lab sharegpt 64", "lab sharegpt 256", "bench poisson 25", "lab poisson 40")


def shape(profile, model) -> None:
    """Where a TTFT is spent beyond vLLM's own stamp of the first token, and how the twin's TTFT
    is spread against vLLM's: what the twin's medians by kind do not show."""
    import pandas as pd

    from vllm_lab.twin import reference
    from vllm_lab.twin.fit import replay

    pd.set_option("display.width", 200)
    after = reference.after_first_token_stamp((reference.TRAFFIC, *reference.LATER))
    print("\n## After vLLM stamps the first token: the client's mean TTFT less vLLM's (ms), "
          "medians over runs")
    table = (after.groupby(["kind", "case", "level"], sort=True)
             .agg(runs=("after_ms", "size"), tok_s=("tok_s", "median"),
                  after_ms=("after_ms", "median")))
    print(table.round(1).to_string())
    folder = reference.TRAFFIC
    runs = reference.runs_of(folder)
    requests = pd.read_csv(folder / "requests.csv.gz")
    edges = " / ".join(f"{e * 1e3:g}" for e in SHAPE_EDGES)
    print(f"\n## Open loops of {folder.name}: share of requests with TTFT at most {edges} ms")
    rows, bursts, groups = [], [], []
    for (point, _fitted), run in zip(reference.traffic_points(folder), runs):
        if point.arrival_times is None:
            continue
        measured = requests[requests.tag == run["tag"]].sort_values("start_s")
        predicted = replay(point, profile, model).requests
        server = reference.server_shares(folder, run["tag"], SHAPE_EDGES)
        rows.append({"point": point.name,
                     "vLLM's stamp": " ".join(f"{x:.2f}" for x in server or ()),
                     "client": " ".join(f"{(measured.ttft_s <= e).mean():.2f}" for e in SHAPE_EDGES),
                     "twin": " ".join(f"{(predicted.ttft_s <= e).mean():.2f}" for e in SHAPE_EDGES)})
        if point.name.endswith("poisson 40"):
            bursts.append((point.name, reference.ttft_by_recent_sends(
                measured.start_s, measured.ttft_s, predicted.ttft_s)))
        groups += [{"point": point.name, "side": "vLLM",
                    **reference.first_token_groups(measured.start_s, measured.ttft_s)},
                   {"point": point.name, "side": "twin",
                    **reference.first_token_groups(predicted.send_s, predicted.ttft_s)}]
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"\n## Open loops of {folder.name}: requests whose first tokens came together (one "
          "step's prompts): requests a group, share grouped, median spread of their sends and "
          "its 90th percentile, and TTFT of each group's first sent / the others (ms)")
    print(pd.DataFrame(groups).round(2).to_string(index=False))
    for name, table in bursts:
        print(f"\n## {name} ({folder.name}): median TTFT (ms) by requests sent in the 50 ms before")
        print(table.round(1).T.to_string())
    print(f"\n## The engine's steps by the tokens each carried ({folder.name}): share of steps, "
          "vLLM's iteration-tokens histogram / the twin's (steps: their count)")
    sizes = reference.step_sizes(folder, profile, model, STEP_POINTS)
    sizes["cell"] = [f"{v:.0f} / {t:.0f}" if k == "steps" else f"{v:.3f} / {t:.3f}"
                     for k, v, t in zip(sizes["tokens"], sizes["vLLM"], sizes["twin"])]
    print(sizes.pivot(index="tokens", columns="point", values="cell")
          .reindex(index=sizes["tokens"].unique(), columns=list(STEP_POINTS)).to_string())


def _run(flags, profile, model, reqs, users=256):
    p = predict(flags, profile, model, reqs, Closed(users))
    return p


def direction(profile, model, n: int = 3000) -> None:
    """Closed loop of 256 users, ShareGPT-like lengths: each knob moves the metrics as vLLM's would."""
    reqs = sharegpt_like(n, seed=1)
    print(f"\n## Direction: closed loop, 256 users, {n} ShareGPT-like requests, {profile.name}")
    head = f"{'setting':42s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TPOT p50':>9s} {'preempt':>8s} {'KV tok':>9s}"

    def row(label, flags, rq=reqs):
        p = _run(flags, profile, model, rq)
        print(f"{label:42s} {p.output_throughput:10.0f} {p.ttft['p50'] * 1e3:9.1f} "
              f"{p.tpot['p50'] * 1e3:9.2f} {p.num_preemptions:8d} {p.kv_cache_tokens:9d}")
        return p

    print(head)
    for seqs in (16, 32, 64, 128, 256, 512):
        row(f"max-num-seqs {seqs}", {"max-num-seqs": seqs})
    print("\nsame sweep with gpu-memory-utilization 0.2, max-model-len 8192 (KV-short):")
    print(head)
    for seqs in (16, 32, 64, 128, 256, 512):
        row(f"max-num-seqs {seqs}", {"max-num-seqs": seqs, "gpu-memory-utilization": 0.2,
                                     "max-model-len": 8192})
    print(head)
    for util in (0.92, 0.5, 0.2, 0.16, 0.15):
        row(f"gpu-memory-utilization {util}", {"gpu-memory-utilization": util, "max-model-len": 8192})
    row("enforce-eager false", {})
    row("enforce-eager true", {"enforce-eager": True})
    long = [PredictRequest(6000, 64) for _ in range(600)]
    for mnbt in (8192, 2048, 512):
        row(f"6000-token prompts, max-num-batched-tokens {mnbt}",
            {"max-num-batched-tokens": mnbt, "max-num-seqs": min(256, mnbt)}, long)


def speed(profile, model, n: int = 10_000) -> None:
    """CPU seconds for 10,000 ShareGPT-like requests at concurrency 256 (target: under 5 s)."""
    reqs = sharegpt_like(n, seed=0)
    t0 = time.process_time()
    p = predict({}, profile, model, reqs, Closed(256))
    cpu = time.process_time() - t0
    print(f"\n## Speed: {n} ShareGPT-like requests, concurrency 256: {cpu:.2f} CPU s "
          f"({p.duration_s:.0f} s simulated, {p.duration_s / cpu:.0f}x real time, target < 5 s)")


# vLLM's engine stepped alone on a GPU (scripts/bench_step_times.py: no API server, no async
# scheduling), with the profile of that GPU.
STEP_FILES = (("h200-llama-3-8b", REFERENCE / "traffic-2026-12-01/steps.jsonl"),
              ("h100-llama-3-8b", EXAMPLES / "h100/steps-h100-d.jsonl"))


def steps() -> None:
    """Each composition's step, measured and the twin's, by kind (decodes, a prompt chunk beside
    them, a prompt alone); then what the engine run synchronously adds to a decode batch: the
    scheduling and sampling the served engine overlaps with the GPU (a fixed part and a part a
    sequence, fitted over the batches)."""
    import numpy as np
    import pandas as pd

    from vllm_lab.twin.engine import Engine

    for name, path in STEP_FILES:
        profile = load_profile(name)
        stm = Engine.from_flags({}, profile, load_model_shape(profile.model)).stm
        rows = []
        for line in path.read_text().splitlines():
            r = json.loads(line)
            pairs = sum(chunk_pairs(n, c) for n, c in r["chunks"]) + r["decode_context"]
            kv = sum(n + c for n, c in r["chunks"]) + r["decode_context"]
            twin = float(stm.step_time(r["tokens"], r["seqs"], r["seqs"], pairs, kv, prefills=len(r["chunks"])))
            rows.append({"kind": r["kind"], "batch": r["batch"], "prompt": r["prefill"],
                         "measured_ms": r["step_s"] * 1e3, "twin_ms": twin * 1e3})
        df = pd.DataFrame(rows).groupby(["kind", "batch", "prompt"]).median()
        df["error"] = df.twin_ms / df.measured_ms - 1
        print(f"\n## The engine stepped alone: {name} vs {path.relative_to(EXAMPLES.parents[1])} (medians)")
        print(df.to_string(float_format=lambda v: f"{v:.2f}"))
        print("median |error| by kind: " + ", ".join(
            f"{k} {v:.1%}" for k, v in df.error.abs().groupby(level=0).median().items()))
        dec = df.loc["decode"].reset_index()
        slope, fixed = np.polyfit(dec.batch, dec.measured_ms - dec.twin_ms, 1)
        print(f"the synchronous engine adds to a decode batch {fixed:.2f} ms and {slope * 1e3:.1f} µs a sequence")


def main(argv=None) -> int:
    """Run the chosen benchmarks (all by default)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="*", default=["fidelity", "direction", "speed"],
                    choices=["fidelity", "hosts", "shape", "direction", "speed", "steps"])
    ap.add_argument("--reference", type=Path, default=REFERENCE)
    ap.add_argument("--profile", default="h200-llama-3-8b")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    model = load_model_shape(profile.model)
    if "fidelity" in args.which:
        if not args.reference.is_dir():
            print(f"error: --reference {args.reference}: no such folder", file=sys.stderr)
            return 2
        fidelity(profile, model, args.reference)
        if args.profile == "h200-llama-3-8b":
            by_kind(profile, model)
        if args.profile == "h200-llama-3-8b" and HELD_OUT.is_dir():
            held_out(profile, model)
        if args.profile == "h200-llama-3-8b" and STAIRCASES.exists():
            staircases()
        if args.profile == "h200-llama-3-8b":
            other_gpus(model)
    if "hosts" in args.which:
        hosts(profile, model)
    if "shape" in args.which:
        shape(profile, model)
    if "direction" in args.which:
        direction(profile, model)
    if "speed" in args.which:
        speed(profile, model)
    if "steps" in args.which:
        steps()
    return 0


if __name__ == "__main__":
    sys.exit(main())
