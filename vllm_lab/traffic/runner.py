"""Run Locust headless against a server and return the merged raw samples and scraped metrics.

One host: `locust --processes N` (or one process). Several hosts: a master here and `locust
--worker` on each load-generator host (local ones as subprocesses, remote ones over ssh, their
sample files copied back with scp). Every Locust process runs in its own process group and is
stopped by that group's id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_lab.traffic import samples as samples_mod
from vllm_lab.traffic.arrivals import client_overloaded
from vllm_lab.traffic.scrape import Scraper, frame
from vllm_lab.traffic.spec import Load, Workload
from vllm_lab.traffic.workloads import PromptBuilder

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
_LOCAL = {"127.0.0.1", "localhost", "::1"}


@dataclass
class LoadResult:
    """What one load run produced: raw samples, server metrics and the client's own health."""

    samples: pd.DataFrame
    server_metrics: pd.DataFrame
    client_overloaded: bool
    schedule_lag_p99_s: float
    loop_lag_p99_s: float = 0.0
    cpu_fraction_max: float = 0.0
    stop_reason: str = ""
    locust_rc: int = 0
    out_dir: Path | None = None
    workers: list[dict] = field(default_factory=list)
    token_count_approximation: str | None = None


class TrafficError(RuntimeError):
    """Locust could not run (it crashed, or its workers never connected)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a process group we started: SIGTERM, then SIGKILL after a grace period."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _worker_cmd(host: str, master: str, port: int, cfg: Path, processes: int) -> list[str]:
    args = ["-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", master,
            "--master-port", str(port)]
    if processes > 1:
        args += ["--processes", str(processes)]
    if host in _LOCAL:
        return [sys.executable, *args]
    # Remote hosts need the lab installed at the same path and the config copied first.
    remote = f"VLLM_LAB_TRAFFIC_CONFIG={shlex.quote(str(cfg))} python3 " + shlex.join(args)
    return ["ssh", "-o", "BatchMode=yes", host, remote]


def _copy_to_remote(hosts: list[str], cfg: Path, out_dir: Path) -> None:
    for h in sorted(set(hosts) - _LOCAL):
        subprocess.run(["ssh", "-o", "BatchMode=yes", h, f"mkdir -p {shlex.quote(str(out_dir))}"],
                       check=True, timeout=60)
        subprocess.run(["scp", "-q", str(cfg), f"{h}:{cfg}"], check=True, timeout=60)


def _fetch_remote_samples(hosts: list[str], out_dir: Path) -> None:
    for h in sorted(set(hosts) - _LOCAL):
        subprocess.run(["scp", "-q", f"{h}:{out_dir}/samples/*", str(out_dir / "samples")],
                       check=False, timeout=300)


def _summaries(samples_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(samples_dir.glob("*.summary.json"))]


def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    load: Load,
    out_dir: Path,
    seed: int = 0,
    api_key: str | None = None,
    processes: int = 1,
    scrape_metrics: bool = True,
    workers_hosts: list[str] | None = None,
    scrape_interval_s: float = 2.0,
) -> LoadResult:
    """Run Locust headless against base_url until the load's stop condition; return the samples."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_dir = out_dir / "samples"
    shutil.rmtree(samples_dir, ignore_errors=True)
    samples_dir.mkdir()
    (out_dir / "stop_reason.json").unlink(missing_ok=True)
    hosts = list(workers_hosts or [])
    num_workers = len(hosts) * processes if hosts else processes
    cfg = out_dir / "traffic_config.json"
    cfg.write_text(json.dumps({
        "base_url": base_url, "model": model, "seed": seed, "api_key": api_key,
        "out_dir": str(out_dir), "num_workers": num_workers,
        "workload": workload.model_dump(mode="json"), "load": load.model_dump(mode="json"),
    }))
    env = {**os.environ, "VLLM_LAB_TRAFFIC_CONFIG": str(cfg), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", base_url,
           "--csv", str(out_dir / "locust"), "--logfile", str(out_dir / "locust.log"),
           "--only-summary", "--stop-timeout", str(int(load.request_timeout_s))]
    worker_procs: list[subprocess.Popen] = []
    if hosts:
        port = _free_port()
        bind = "127.0.0.1" if set(hosts) <= _LOCAL else "0.0.0.0"
        master = "127.0.0.1" if bind == "127.0.0.1" else socket.getfqdn()
        cmd += ["--master", "--expect-workers", str(num_workers), "--master-bind-host", bind,
                "--master-bind-port", str(port), "--expect-workers-max-wait", "60"]
        _copy_to_remote(hosts, cfg, out_dir)
    elif processes > 1:
        cmd += ["--processes", str(processes)]
    scraper = Scraper(base_url, scrape_interval_s).start() if scrape_metrics else None
    log = open(out_dir / "locust.stdout", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        for h in hosts:
            worker_procs.append(subprocess.Popen(
                _worker_cmd(h, master, port, cfg, processes), env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        # The shape stops the run; this limit only catches a hung Locust.
        limit = load.stop.duration_s + 90
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            rc = -1
    finally:
        _stop_group(proc)
        for w in worker_procs:
            _stop_group(w)
        log.close()
    metrics = scraper.stop() if scraper else frame([])
    _fetch_remote_samples(hosts, out_dir)
    return _result(out_dir, rc, metrics, load, workload)


def _result(out_dir: Path, rc: int, metrics: pd.DataFrame, load: Load, workload) -> LoadResult:
    samples_dir = out_dir / "samples"
    df = samples_mod.merge_dir(samples_dir)
    workers = _summaries(samples_dir)
    if rc not in (0, 1) or (df.empty and not workers):
        tail = (out_dir / "locust.stdout").read_text()[-2000:]
        raise TrafficError(f"locust exited with {rc} and wrote no samples; output tail:\n{tail}")
    sched = df["sched_lag_s"].dropna().to_numpy(dtype=float) if len(df) else np.array([])
    sched_p99 = float(np.percentile(sched, 99)) if sched.size else 0.0
    # Per-worker loop-lag p99s are not averaged: the worst worker decides.
    loop_p99 = max((w["loop_lag"]["p99"] for w in workers), default=0.0)
    cpu = max((w["cpu_fraction"] for w in workers), default=0.0)
    stop = out_dir / "stop_reason.json"
    approx = PromptBuilder(workload.tokenizer).approximation
    return LoadResult(
        samples=df,
        server_metrics=metrics,
        client_overloaded=client_overloaded(sched_p99, loop_p99, cpu, load.max_schedule_lag_s),
        schedule_lag_p99_s=sched_p99,
        loop_lag_p99_s=loop_p99,
        cpu_fraction_max=cpu,
        stop_reason=json.loads(stop.read_text())["reason"] if stop.exists() else "killed",
        locust_rc=rc,
        out_dir=out_dir,
        workers=workers,
        token_count_approximation=approx,
    )


def wait_for(url: str, timeout_s: float = 30.0) -> None:
    """Block until url answers, or raise TrafficError after timeout_s."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.1)
    raise TrafficError(f"{url} did not answer within {timeout_s} s")
