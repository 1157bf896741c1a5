"""A lab store's live sweep runs as a held-out reference folder of the twin (runs.jsonl and
requests.csv.gz, the format vllm_lab.twin.reference reads), each run's requests in send order.

    .venv/bin/python scripts/reference_from_store.py STORE_FOLDER OUT_FOLDER EXPERIMENT [EXPERIMENT ...]

The sweep's flag names the configuration (``max-num-seqs=64``: add it to reference.CONFIGS); the
throughput is the bench's definition (output tokens over first send to last reply), since the
predictor's replay has the fill and the drain too; the other figures are the lab's summary.
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
        f"SELECT experiment_id, point_json, repeat, started, ended, samples_file, summary_json, status, "
        f"output_throughput, ttft_p50, ttft_p99, tpot_p50, scenario_json FROM runs "
        f"WHERE experiment_id IN ({marks}) AND samples_file != '' ORDER BY started", experiments)
    runs, requests = [], []
    for exp, point, repeat, started, ended, samples, summary, status, otp, t50, t99, p50, scenario in found:
        s, sc = json.loads(summary), json.loads(scenario)
        (flag, value), = json.loads(point).items()
        users = int(sc["load"]["shape"]["level"])
        d = pd.read_parquet(store / "lab.samples" / samples)
        rows = request_rows(d, "")
        d = d[d.status == "ok"]
        tag = f"{sc['name']}-closed{users}-{flag}{value}-lab-{int(started)}"
        figures = {k: s.get(k) for k in SUMMARY}
        figures.update(output_throughput=otp, ttft_p50=t50, ttft_p99=t99, tpot_p50=p50, completed=len(d),
                       bench_def_output_throughput=float(d.output_tokens.sum()
                                                         / (rows.start_s + rows.e2e_s).max()),
                       status=status, repeat=repeat, experiment=exp)
        runs.append({"case": sc["workload"]["source"], "workload": sc["name"], "arrival": "closed",
                     "level": float(users), "burstiness": 1.0, "users": users, "requests": len(d),
                     "run": "lab", "tool": "lab", "tag": tag, "started": started, "wall_s": ended - started,
                     "figures": figures, "server": {k: v for k, v in s.items() if k.startswith("server_")},
                     "config": f"{flag}={value}"})
        requests.append(rows.assign(tag=tag))
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    with gzip.open(out / "requests.csv.gz", "wt") as f:
        pd.concat(requests).to_csv(f, index=False, float_format="%.6f")
    return len(runs)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    print(f"{convert(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])} runs written")
