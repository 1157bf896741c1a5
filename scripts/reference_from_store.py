"""A lab store's live sweep or calibration runs as a reference folder of the twin (runs.jsonl and
requests.csv.gz, the format vllm_lab.twin.reference reads), each run's requests in send order.

    .venv/bin/python scripts/reference_from_store.py STORE_FOLDER OUT_FOLDER EXPERIMENT [EXPERIMENT ...]

A sweep's flag names the configuration (``max-num-seqs=64``: add it to reference.CONFIGS); a
calibration's runs (`make calibrate`: fixed lengths, closed and open loops, chat) are vLLM's
defaults, each named by its traffic as the bench's runs are (``closed``/``random`` for fixed
lengths, ``poisson`` for an open loop) or by the shipped scenario whose workload builds its
prompts (``default``, ``realtime-chat``). The throughput is the bench's definition (output tokens
over first send to last reply), since the predictor's replay has the fill and the drain too; the
other figures are the lab's summary, and ``server`` keeps vLLM's own account, the API server's CPU
(``server_api_cpu``) among it, with ``cpu`` holding its process counter as scraped (seconds since
the run's first send, CPU seconds).
"""

from __future__ import annotations

import gzip
import json
import sqlite3
import sys
from pathlib import Path

import pandas as pd

from vllm_lab.twin.reference import request_rows

SUMMARY = ("ttft_mean", "tpot_mean", "e2e_mean", "duration_s", "warmup_s", "drain_s", "window_reason",
           "window_share", "loadgen_processes", "client_cpu_max")


def convert(store: Path, out: Path, experiments: list[str]) -> int:
    """Write ``out``'s runs.jsonl and requests.csv.gz from the experiments' ok and unsteady runs."""
    db = sqlite3.connect(store / "lab.db")
    marks = ",".join("?" * len(experiments))
    found = db.execute(
        f"SELECT experiment_id, run_key, point_json, repeat, started, ended, samples_file, summary_json, status, "
        f"output_throughput, ttft_p50, ttft_p99, tpot_p50, scenario_json FROM runs "
        f"WHERE experiment_id IN ({marks}) AND samples_file != '' ORDER BY started", experiments)
    runs, requests = [], []
    for exp, key, point, repeat, started, ended, samples, summary, status, otp, t50, t99, p50, scenario in found:
        s, sc = json.loads(summary), json.loads(scenario)
        d = pd.read_parquet(store / "lab.samples" / samples)
        rows = request_rows(d, "")
        d = d[d.status == "ok"]
        case, workload, arrival, config, name = _describe(json.loads(point), sc)
        level = float(sc["load"]["shape"]["level"])
        users = int(level) if arrival == "closed" else None
        tag = f"{workload}-{arrival}{level:g}-{name}-lab-{int(started)}"
        figures = {k: s.get(k) for k in SUMMARY}
        figures.update(output_throughput=otp, ttft_p50=t50, ttft_p99=t99, tpot_p50=p50, completed=len(d),
                       bench_def_output_throughput=float(d.output_tokens.sum()
                                                         / (rows.start_s + rows.e2e_s).max()),
                       status=status, repeat=repeat, experiment=exp)
        run = {"case": case, "workload": workload, "arrival": arrival, "level": level,
               "burstiness": float(sc["load"].get("burstiness") or 1.0), "users": users,
               "requests": len(d), "run": "lab", "tool": "lab", "tag": tag, "started": started,
               "wall_s": ended - started, "figures": figures,
               "server": {k: v for k, v in s.items() if k.startswith("server_")}, "config": config}
        t0 = float(d.start_ts.min()) if len(d) else started
        cpu = db.execute("SELECT ts, value FROM server_metrics WHERE experiment_id = ? AND run_key = ? "
                         "AND name = 'process_cpu_seconds_total' ORDER BY ts", (exp, key)).fetchall()
        if cpu:
            run["cpu"] = {"server_api_process_cpu_series": [[round(ts - t0, 3), v] for ts, v in cpu]}
        runs.append(run)
        requests.append(rows.assign(tag=tag))
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    with gzip.open(out / "requests.csv.gz", "wt") as f:
        pd.concat(requests).to_csv(f, index=False, float_format="%.6f")
    return len(runs)


def _describe(point: dict, sc: dict) -> tuple[str, str, str, str, str]:
    """A run's case, workload, arrival, configuration and the name its tag carries."""
    if "traffic" not in point:  # a sweep's: one flag, the scenario's own traffic in a closed loop
        (flag, value), = point.items()
        return sc["workload"]["source"], sc["name"], "closed", f"{flag}={value}", f"{flag}{value}"
    # A calibration run: vLLM's defaults on the plan's traffic (vllm_lab.calibrate).
    w, name = sc["workload"], str(point["point"])
    if point["traffic"] == "fixed":
        return "closed", "random", "closed", "defaults", name
    if point["traffic"] == "open":
        arrival = str(sc["load"].get("arrival") or "poisson")
        return arrival, "random", arrival, "defaults", name
    workload = _scenario_with(w, sc["name"])
    return ("chat" if w.get("api") == "chat" else w["source"]), workload, "closed", "defaults", name


def _scenario_with(workload: dict, first: str) -> str:
    """The shipped scenario whose workload builds these prompts (source, API, shared prefix), as
    reference.traffic_points rebuilds them from its name; ``first`` when it does."""
    from vllm_lab import scenarios

    def same(name: str) -> bool:
        w = scenarios.resolve(name).workload
        return (w.source, w.api, w.shared_prefix_ratio, w.prefix_groups) == (
            workload["source"], workload.get("api", "completions"),
            float(workload.get("shared_prefix_ratio") or 0.0), int(workload.get("prefix_groups") or 1))

    for name in (first, *sorted(p.stem for p in scenarios.SCENARIO_DIR.glob("*.yaml"))):
        if same(name):
            return name
    raise ValueError(f"no shipped scenario has this run's workload: {workload}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    print(f"{convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])} runs written")
