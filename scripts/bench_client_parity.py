#!/usr/bin/env python3
"""The lab's client beside `vllm bench serve` and the server's own metrics, on one running server.

One server (started through the lab's playbooks, or given by --url) serves every run. For each
traffic case the runs named by --runs take turns against it with the same traffic (the same
request count, lengths, arrival process and API), the prefix cache reset before each. Around every
run the server's /metrics are scraped, so each run carries vLLM's own account of it
(`vllm_lab.audit`, and every vllm: counter and histogram's difference in server-raw.jsonl), and
the CPU each process used is sampled.

    python scripts/bench_client_parity.py all --inventory INV --model DIR --out DIR \
        [--cases closed:1,closed:64,sharegpt:64,poisson:30,gamma:30:0.5,chat:64] [--runs bench+lab]

A case is `kind:level[:burstiness]`:
- `closed:U` U users, random-like prompts of --input-len, --output-len tokens (ignore_eos);
- `sharegpt:U` U users over a ShareGPT-format file of variable lengths (--sharegpt FILE, or one
  this script writes: `make_sharegpt`), the bench's `--dataset-name sharegpt` on the same file;
- `poisson:R`, `gamma:R:B` an open loop at R req/s (the bench's --request-rate, --burstiness B);
- `chat:U` U users on /v1/chat/completions (the bench's openai-chat backend);
- `filefixed:U` U users over a ShareGPT-format file whose prompts and replies are all of
  --input-len and --output-len tokens: `closed:U`'s lengths, the same text sent by both clients,
  which tells the prompt's text apart from the client.
A run spec is `bench` or `lab`, with `:key=value` options: `processes=N` (lab: Locust processes;
default: the lab's own choice), `temperature=none|X` (both), `scrape=0` (lab: no periodic
/metrics and GPU scrapes during the run), `schedule=bench` (lab, open loops: replay the send times
and lengths of the case's last bench run as a trace, so both clients send the very same arrival
schedule and only the client and the server's own run-to-run spread are left to differ).
Phases: `start` leaves the server running and writes server.json, `measure` appends to runs.jsonl, `stop`, `csv` writes parity.csv from runs.jsonl,
`all` does all four; `export --out STORE [--out STORE ...] [--config FLAGS ...] --to DIR` writes a
reference folder (runs.jsonl, every request in requests.csv.gz, server-raw.jsonl.gz, power.csv.gz)
that `vllm_lab.twin.reference` replays, each store's runs under its --config (server flags).
`--levels 1,16` is short for `--cases closed:1,closed:16`.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import pandas as pd

from vllm_lab import audit, scenarios, serving
from vllm_lab.summary import summarize
from vllm_lab.traffic.arrivals import planned_arrivals
from vllm_lab.traffic.samples import merge_dir
from vllm_lab.traffic.scrape import frame, parse_metrics
from vllm_lab.twin.reference import request_rows

METRICS = ("output_throughput", "ttft_p50", "ttft_p99", "tpot_p50")


# ---- the traffic cases ----------------------------------------------------------------------
# Shorthands: closed:64 is random/closed:64, sharegpt:64 sharegpt/closed:64, poisson:30
# random/poisson:30, gamma:30:0.5 random/gamma:30:0.5, chat:64 chat/closed:64.
_SHORT = {"closed": ("random", "closed"), "sharegpt": ("sharegpt", "closed"),
          "chat": ("chat", "closed"), "poisson": ("random", "poisson"), "gamma": ("random", "gamma"),
          "filefixed": ("filefixed", "closed")}
# The workloads read from a ShareGPT-format file, by both clients.
_FILES = ("sharegpt", "filefixed")


@dataclass(frozen=True)
class Case:
    """One traffic: what the requests are (``workload``), how they arrive, users or a rate.

    workload: random (fixed --input-len / --output-len), sharegpt (a ShareGPT-format file), chat
    (random on /v1/chat/completions), or a scenario's name, whose workload: the lab sends alone
    (the bench has no such dataset). arrival: closed (users), poisson or gamma (req/s).
    """

    workload: str
    arrival: str
    level: float       # users (closed loops) or requests per second (open loops)
    burstiness: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Case:
        head, level, *rest = text.split(":")
        workload, _, arrival = head.partition("/")
        if not arrival:
            if workload not in _SHORT:
                raise SystemExit(f"--cases: {text!r}: give workload/arrival:level, or one of "
                                 f"{', '.join(_SHORT)}")
            workload, arrival = _SHORT[workload]
        if arrival not in ("closed", "poisson", "gamma"):
            raise SystemExit(f"--cases: {text!r}: the arrival is closed, poisson or gamma")
        default_b = 0.5 if arrival == "gamma" else 1.0
        return cls(workload, arrival, float(level), float(rest[0]) if rest else default_b)

    @property
    def open(self) -> bool:
        return self.arrival != "closed"

    @property
    def benchable(self) -> bool:
        """Whether vllm bench serve can send it (a scenario's workload it cannot)."""
        return self.workload in ("random", "chat", *_FILES)

    @property
    def users(self) -> int:
        return int(self.level)

    @property
    def kind(self) -> str:
        """The case's name in parity.csv: its shorthand where it has one."""
        for short, pair in _SHORT.items():
            if pair == (self.workload, self.arrival):
                return f"gamma b={self.burstiness:g}" if short == "gamma" else short
        b = f" b={self.burstiness:g}" if self.arrival == "gamma" else ""
        return f"{self.workload}/{self.arrival}{b}"

    @property
    def tag(self) -> str:
        b = f"-b{self.burstiness:g}" if self.arrival == "gamma" else ""
        return f"{self.workload}-{self.arrival}{self.level:g}{b}"

    def requests(self, args) -> int:
        """How many requests a run of this case sends (the same for both clients)."""
        if self.open:
            return max(args.min_requests, round(self.level * args.open_s))
        fixed = self.workload in ("random", "chat", "filefixed")
        per_user = args.requests_per_user if fixed else args.sharegpt_per_user
        return max(args.min_requests, self.users * per_user)

    def lab_overrides(self, args, n: int) -> list[str]:
        """The scenario overrides that make the lab send this case's traffic."""
        out = [f"load.stop.max_requests={n}"]
        if self.workload in _FILES:
            # In the file's order, as the bench is run: the same sequence of lengths on both sides
            # (a run's span, the bench's throughput figure, depends on which requests come last).
            out += ["workload.source=sharegpt-file", f"workload.path={sharegpt_file(args, self, n)}",
                    "workload.shuffle=false"]
        elif self.workload in ("random", "chat"):
            out += ["workload.source=synthetic",
                    f"workload.input={{dist: fixed, mean: {args.input_len}}}",
                    f"workload.output={{dist: fixed, mean: {args.output_len}}}"]
        else:
            wl = scenarios.resolve(self.workload).workload.model_dump(mode="json", exclude_none=True)
            out += [f"workload.{k}={json.dumps(v)}" for k, v in wl.items()
                    if k not in ("tokenizer", "ignore_eos", "path")]
        if self.workload == "chat":
            out.append("workload.api=chat")
        if self.open:
            out += ["load.mode=open", f"load.shape.level={self.level:g}",
                    f"load.arrival={'gamma' if self.arrival == 'gamma' else 'poisson'}",
                    f"load.burstiness={self.burstiness:g}"]
        else:
            out.append(f"load.shape.level={self.users}")
        return out

    def replay_overrides(self, trace: Path, n: int) -> list[str]:
        """The overrides that make the lab send a bench run's own schedule (``bench_schedule``)."""
        out = [f"load.stop.max_requests={n}", "workload.source=trace", f"workload.path={trace}",
               "workload.trace_format=jsonl", "load.mode=replay", "load.replay.speed=1.0"]
        return out + (["workload.api=chat"] if self.workload == "chat" else [])

    def bench_args(self, args, n: int) -> list[str]:
        """`vllm bench serve`'s arguments for this case's traffic."""
        out = ["--num-prompts", str(n)]
        if self.workload in _FILES:
            out += ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file(args, self, n)),
                    "--disable-shuffle"]
        else:
            out += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len)]
        if self.workload == "chat":
            out += ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
        else:
            out += ["--backend", "vllm"]
        if self.open:
            out += ["--request-rate", f"{self.level:g}", "--burstiness", f"{self.burstiness:g}"]
        else:
            out += ["--max-concurrency", str(self.users)]
        return out


def make_sharegpt(path: Path, model: str, n: int, seed: int = 0,
                  fixed: tuple[int, int] | None = None) -> Path:
    """Write a ShareGPT-format file of n conversations with ShareGPT-like variable lengths, or all
    of ``fixed`` (prompt, reply) tokens: the prompt one token short, the server adds BOS.

    Lognormal prompt and reply lengths (means ~160 / ~340 tokens, the PagedAttention paper's
    ShareGPT statistics), inside what `vllm bench serve` keeps of a ShareGPT file (prompts of
    4-1024 tokens, prompt + reply <= 2048), so both clients send every conversation. The text is
    drawn from words the model's tokenizer holds as one token each: its lengths are exact.
    """
    from vllm_lab.traffic.workloads import PromptBuilder

    builder = PromptBuilder(Path(model))
    rng = np.random.default_rng([seed, 11])
    rows = []
    while len(rows) < n:
        if fixed:
            p, o = fixed[0] - 1, fixed[1]
        else:
            p = int(np.clip(rng.lognormal(np.log(120), 0.8), 8, 1000))
            o = int(np.clip(rng.lognormal(np.log(260), 0.75), 8, 2040 - p))
        rows.append({"id": f"lab-{len(rows)}", "conversations": [
            {"from": "human", "value": builder.build(p, rng)},
            {"from": "gpt", "value": builder.build(o, rng)}]})
    path.write_text(json.dumps(rows))
    return path


def sharegpt_file(args, case: Case, n: int) -> Path:
    """The ShareGPT-format file a case's runs share: --sharegpt, or one of exactly n
    conversations (both clients then send the same set, each in its own seeded order)."""
    if case.workload == "filefixed":
        path = args.out / f"fixed-{args.input_len}-{args.output_len}-{n}.json"
        return path if path.exists() else make_sharegpt(path, args.model, n,
                                                        fixed=(args.input_len, args.output_len))
    if args.sharegpt:
        return Path(args.sharegpt)
    path = args.out / f"sharegpt-{n}.json"
    return path if path.exists() else make_sharegpt(path, args.model, n)


# ---- the server ----------------------------------------------------------------------------
def lab_scenario(model: str, extra: list[str] = ()):
    """The default scenario as the bench is run: the model's tokenizer, fixed output lengths
    (ignore_eos), a fresh seed, then the case's overrides."""
    return scenarios.resolve("default", overrides=[
        f"serve.model={model}", "serve.load-format=dummy", f"workload.tokenizer={model}",
        "workload.ignore_eos=true", "load.stop.duration_s=3600",
        f"run.seed={int(time.time() * 1000) % 1_000_000}", *extra])


def start(args) -> str:
    """Start the server with vLLM's defaults and leave it running; return its URL."""
    s = lab_scenario(args.model, ["load.stop.max_requests=1", *args.set])
    inst = serving.start(s.serve, inventory=args.inventory, backend=args.backend,
                         extra_vars={"vllm_dev_mode": True,  # /reset_prefix_cache
                                     "vllm_health_timeout_s": 900})[0]
    (args.out / "server.json").write_text(json.dumps({"url": inst.url}))
    return inst.url


def _post(url: str, body: dict | None) -> None:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def scrape(url: str) -> list:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode(), time.time())


# ---- CPU per process -------------------------------------------------------------------------
def _role(cmd: str, name: str) -> str:
    if "bench_client_parity" in cmd:
        return "this-script"  # runs vllm bench serve in-process, and the lab's scraper
    if "bench serve" in cmd:
        return "vllm-bench"
    if "EngineCore" in name or "EngineCore" in cmd:
        return "vllm-engine"
    if "locust" in cmd:
        return "locust"
    if "APIServer" in name or "APIServer" in cmd:  # --api-server-count N: N processes
        return "server-api"
    if " serve" in cmd and ("vllm" in cmd or "twin" in cmd):
        return "server-api"
    return "other"


class CpuSampler:
    """CPU seconds per process role over a run (psutil, every 0.5 s), and the API server's
    busiest thread: its event loop, which serves every request and stream of the process, so its
    CPU seconds over the run say how close that one loop came to saturation."""

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.first: dict[int, tuple[str, float]] = {}
        self.last: dict[int, float] = {}
        self.peak: dict[str, float] = {}
        self.threads0: dict[tuple[int, int], float] = {}   # (pid, thread id) -> CPU s at start
        self.threads: dict[tuple[int, int], float] = {}    # the latest reading
        self.series: dict[tuple[int, int], list] = {}      # (seconds from start, CPU s) each sample
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _sample(self, dt: float) -> None:
        for p in self.psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
            try:
                ct = p.info["cpu_times"]
                cpu = ct.user + ct.system
                cmd = " ".join(p.info["cmdline"] or [])
            except (self.psutil.Error, TypeError, AttributeError):
                continue
            pid = p.info["pid"]
            role = _role(cmd, p.info["name"] or "")
            if role == "server-api":
                self._sample_threads(p)
            if pid not in self.first:
                self.first[pid] = (role, cpu)
            if pid in self.last and dt > 0:
                share = (cpu - self.last[pid]) / dt
                key = f"{role}:{pid}"
                self.peak[key] = max(self.peak.get(key, 0.0), share)
            self.last[pid] = cpu

    def _sample_threads(self, proc) -> None:
        try:
            threads = proc.threads()
        except self.psutil.Error:
            return
        for t in threads:
            key = (proc.info["pid"], t.id)
            self.threads0.setdefault(key, t.user_time + t.system_time)
            self.threads[key] = t.user_time + t.system_time
            self.series.setdefault(key, []).append(
                (round(time.time() - self.t0, 2), round(self.threads[key] - self.threads0[key], 3)))

    def _loop(self) -> None:
        prev = time.time()
        while not self._stop.wait(0.5):
            now = time.time()
            self._sample(now - prev)
            prev = now

    def start(self):
        self.t0 = time.time()
        self._sample(0)
        self._t.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self._sample(0.5)
        wall = time.time() - self.t0
        by_role: dict[str, float] = {}
        for pid, (role, c0) in self.first.items():
            by_role[role] = by_role.get(role, 0.0) + self.last.get(pid, c0) - c0
        busiest: dict[str, float] = {}
        for key, v in self.peak.items():
            role = key.split(":")[0]
            busiest[role] = max(busiest.get(role, 0.0), v)
        busiest_thread = max(self.threads, key=lambda k: self.threads[k] - self.threads0[k],
                             default=None)
        return {"wall_s": wall, "cores": {r: v / wall for r, v in by_role.items()},
                "busiest_process_peak": busiest,
                "server_api_busiest_thread_s": busiest_thread and (
                    self.threads[busiest_thread] - self.threads0[busiest_thread]),
                "server_api_busiest_thread_series": self.series.get(busiest_thread)}


# ---- one run of each tool --------------------------------------------------------------------
def _opts(spec: str) -> tuple[str, dict]:
    tool, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return tool, opts


def bench_samples(ref: dict) -> pd.DataFrame:
    """A `vllm bench serve --save-detailed` result's requests in the lab's sample columns."""
    ttfts = np.array([x if x is not None else np.nan for x in ref["ttfts"]], dtype=float)
    itls = ref["itls"]
    outs = np.array(ref["output_lens"], dtype=float)
    e2e = ttfts + np.array([sum(x) for x in itls])
    return pd.DataFrame({"start_ts": np.array(ref["start_times"], dtype=float), "ttft_s": ttfts,
                         "e2e_s": e2e,
                         "tpot_s": np.where(outs > 1, (e2e - ttfts) / np.maximum(outs - 1, 1), np.nan),
                         "output_tokens": outs, "prompt_tokens": ref["input_lens"],
                         "status": ["ok" if not e else "error" for e in ref["errors"]],
                         "itl_s": itls, "scheduled_ts": np.nan})


def run_bench(args, url: str, case: Case, n: int, opts: dict, tag: str) -> dict:
    result = args.out / "bench" / f"{tag}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["vllm", "bench", "serve", "--base-url", url, "--model", args.model,
           "--tokenizer", args.model, *case.bench_args(args, n),
           "--ignore-eos", "--seed", str(int(time.time())),
           "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    if opts.get("temperature", "none") != "none":
        cmd += ["--temperature", opts["temperature"]]
    with open(args.out / "bench" / f"{tag}.log", "w") as log:
        try:  # in this process: vLLM's import costs ~20 s a run as a subprocess
            from vllm.benchmarks.serve import add_cli_args, main
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
        else:
            parser = FlexibleArgumentParser()
            add_cli_args(parser)
            try:
                with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    main(parser.parse_args(cmd[3:]))
            except Exception as e:  # noqa: BLE001 - the command line is the reference anyway
                print(f"in-process bench failed ({e!r}); running the command", file=log, flush=True)
                subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    ref = json.loads(result.read_text())
    samples = bench_samples(ref)
    fig = {"output_throughput": ref["output_throughput"], "ttft_p50": ref["p50_ttft_ms"] / 1e3,
           "ttft_p99": ref["p99_ttft_ms"] / 1e3, "tpot_p50": ref["p50_tpot_ms"] / 1e3,
           "ttft_mean": ref["mean_ttft_ms"] / 1e3, "tpot_mean": ref["mean_tpot_ms"] / 1e3,
           "e2e_mean": ref["mean_e2el_ms"] / 1e3, "duration_s": ref["duration"],
           "completed": ref["completed"]}
    # The lab's own summary of the bench's samples: the same definitions on both sides.
    as_lab = summarize(samples, lab_scenario(args.model).slo)
    fig["lab_def_output_throughput"] = as_lab["output_throughput"]
    fig["lab_def_window_s"] = as_lab["duration_s"]
    return {"figures": fig, "samples": samples}


def bench_schedule(result: Path, to: Path) -> Path:
    """A `vllm bench serve` result's requests as a plain JSONL trace (`vllm_lab.traffic.traces`):
    each one's send time from the first, its prompt and its output length, in the order sent."""
    ref = bench_samples(json.loads(result.read_text())).sort_values("start_ts")
    t0 = ref.start_ts.min()
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_text("".join(json.dumps({"timestamp": round(t - t0, 6), "prompt_tokens": int(p),
                                      "output_tokens": int(o)}) + "\n"
                          for t, p, o in zip(ref.start_ts, ref.prompt_tokens, ref.output_tokens)))
    return to


def run_lab(args, url: str, case: Case, n: int, opts: dict, tag: str) -> dict:
    """The lab's own path: LiveBackend.measure_on sizes the load generator, audits the run against
    the server and runs it again once if the client could not keep up."""
    from vllm_lab.backends import LiveBackend

    extra = [f"workload.temperature={opts['temperature'].replace('none', 'null')}"] \
        if "temperature" in opts else []
    traffic = case.lab_overrides(args, n)
    replayed = opts.get("schedule") == "bench"
    if replayed:
        if not (case.open and opts.get("bench_result")):
            raise ValueError(f"{tag}: schedule=bench replays an open loop's last bench run; "
                             f"run bench first in --runs")
        trace = bench_schedule(Path(opts["bench_result"]),
                               args.out / "lab" / f"{tag}-schedule.jsonl")
        traffic = case.replay_overrides(trace, n)
    s = lab_scenario(args.model, [*traffic, *args.set, *extra])
    backend = LiveBackend(args.backend, args.inventory,
                          processes=int(opts["processes"]) if "processes" in opts else None)
    port = int(url.rsplit(":", 1)[1].strip("/"))
    m = backend.measure_on(s, serving.Instance(host="localhost", url=url, port=port, log_path=""),
                           args.out / "lab" / tag)
    if m.server_metrics is not None:  # the run's /metrics and GPU series, every scrape
        m.server_metrics.to_csv(args.out / "lab" / tag / "metrics.csv.gz", index=False)
    summ = m.summary
    fig = {k: summ.get(k) for k in ("output_throughput", "ttft_p50", "ttft_p99", "tpot_p50",
                                   "ttft_mean", "tpot_mean", "e2e_mean", "duration_s", "warmup_s",
                                   "drain_s", "window_reason", "window_share", "window_note",
                                   "turnaround_p50", "turnaround_p90", "schedule_lag_p99_s",
                                   "loadgen_processes", "loadgen_rerun_of",
                                   "client_cpu_max", "loop_lag_p99_s", "audit_span_diff")}
    ok = m.samples[m.samples.status == "ok"]
    start, end = ok.start_ts.min(), (ok.start_ts + ok.e2e_s).max()
    if case.open and not replayed:
        # The bench's clock starts before its first arrival's gap, at the schedule's zero.
        first_gap = next(planned_arrivals(s.load, s.run.seed))
        start = min(start, m.samples.scheduled_ts.min() - first_gap)
    fig["bench_def_output_throughput"] = float(ok.output_tokens.sum()) / (end - start)
    fig.update(completed=len(ok), status=m.status, error=m.error)
    fig["server_output_throughput"] = _server_rate(m.server_metrics, start + (summ.get("warmup_s") or 0),
                                                   summ["duration_s"])
    return {"figures": fig, "samples": m.samples}


def _server_rate(metrics: pd.DataFrame, t0: float, span: float) -> float | None:
    """vLLM's generation-token counter over [t0, t0 + span], interpolated between its scrapes."""
    gen = metrics[metrics["name"] == "vllm:generation_tokens_total"].groupby("ts")["value"].sum()
    if len(gen) < 2 or span <= 0:
        return None
    ts, v = gen.index.to_numpy(dtype=float), gen.to_numpy(dtype=float)
    return float((np.interp(t0 + span, ts, v) - np.interp(t0, ts, v)) / span)


def server_raw(before: list, after: list) -> dict:
    """Every vllm: counter and histogram series' difference over a run (name -> labels -> value):
    vLLM's whole account of the run (queue, prefill, decode, inference time, tokens per step)."""
    first = {(name, labels): v for _, name, labels, v in before}
    out: dict[str, dict[str, float]] = {}
    for _, name, labels, v in after:
        if not name.startswith("vllm:") or not name.endswith(("_total", "_bucket", "_sum", "_count")):
            continue
        d = v - first.get((name, labels), 0.0)
        if d:
            out.setdefault(name, {})[labels] = d
    return out


def measure(args, url: str) -> None:
    runs_file = args.out / "runs.jsonl"
    for case in args.cases:
        n = case.requests(args)
        bench_result = None   # the case's last bench run, which schedule=bench replays
        for spec in args.runs:
            tool, opts = _opts(spec)
            opts["bench_result"] = bench_result
            if tool == "bench" and not case.benchable:
                continue
            tag = f"{case.tag}-{spec.replace(':', '-').replace('=', '').replace(',', '-')}-{int(time.time())}"
            _post(url + "/reset_prefix_cache", None)
            before = scrape(url)
            cpu = CpuSampler().start()
            t0 = time.time()
            try:
                out = (run_bench if tool == "bench" else run_lab)(args, url, case, n, opts, tag)
            except Exception as e:  # noqa: BLE001 - a failed run is recorded, the next one runs
                print(f"{tag}: failed: {e}", flush=True)
                continue
            wall = time.time() - t0
            cpu_use = cpu.stop()
            if tool == "bench":
                bench_result = args.out / "bench" / f"{tag}.json"
            after = scrape(url)
            view = audit.server_view(frame(before + after))
            check = audit.audit(out["samples"], view)
            row = {"case": case.kind, "workload": case.workload, "arrival": case.arrival,
                   "level": case.level, "burstiness": case.burstiness,
                   "users": case.users if not case.open else None, "requests": n, "run": spec,
                   "tool": tool, "tag": tag, "started": t0, "wall_s": wall,
                   "figures": out["figures"], "server": view.as_summary() if view else {},
                   "server_output_throughput": out["figures"].get("server_output_throughput"),
                   "audit": check.as_summary() if check else {}, "cpu": cpu_use}
            with open(runs_file, "a") as f:
                f.write(json.dumps(row, default=float) + "\n")
            with open(args.out / "server-raw.jsonl", "a") as f:
                f.write(json.dumps({"tag": tag, "raw": server_raw(before, after)}) + "\n")
            f_ = out["figures"]
            print(f"{tag}: {f_['output_throughput']:.0f} tok/s TTFT p50 {f_['ttft_p50'] * 1e3:.0f} ms "
                  f"TPOT p50 {f_['tpot_p50'] * 1e3:.2f} ms | server TPOT mean "
                  f"{row['server'].get('server_tpot_mean', float('nan')) * 1e3:.2f} ms TTFT mean "
                  f"{row['server'].get('server_ttft_mean', float('nan')) * 1e3:.0f} ms | wall "
                  f"{wall:.0f} s | cores {json.dumps({k: round(v, 2) for k, v in cpu_use['cores'].items()})}",
                  flush=True)


def _case_of(row: dict) -> tuple[str, float]:
    """A run's case and level; rows written before cases existed are closed loops at their users."""
    return row.get("case", "closed"), float(row.get("level") or row["users"])


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return float(statistics.median(vals)) if vals else None


# vLLM's own view of each client figure, as server_raw records it.
SERVER_KEY = {"ttft_p50": "server_ttft_p50", "ttft_p99": "server_ttft_p99",
              "tpot_p50": "server_tpot_p50"}


def _figure(run: dict, metric: str) -> tuple[float | None, float | None]:
    """One run's figure for ``metric`` and the server's view of it (None: it has none)."""
    if metric == "output_throughput":  # the lab's on the bench's definition, to compare one thing
        key = "bench_def_output_throughput" if run["tool"] == "lab" else metric
        return run["figures"].get(key), None
    if metric == "output_throughput_window":  # against the server: the bench has no window
        return (run["figures"]["output_throughput"] if run["tool"] == "lab" else None,
                run.get("server_output_throughput"))
    return run["figures"].get(metric), run["server"].get(SERVER_KEY[metric])


def write_csv(args) -> Path:
    """parity.csv: per case and metric, the median over the `lab` runs and over the `bench` runs
    (repeats: --runs bench+lab+bench+lab+...), their counts and spreads, the server's view.

    output_throughput is on the bench's definition for both (output tokens over its clock: first
    send, or an open loop's schedule zero, to last reply), so the two clients are compared on one
    quantity; output_throughput_window is the lab's own figure (its steady window) against
    vLLM's generation counter over the same window, the server column.
    """
    rows = [json.loads(x) for x in (args.out / "runs.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for case in sorted({_case_of(r) for r in rows}, key=lambda c: (c[0] != "closed", c)):
        lab = [r for r in rows if _case_of(r) == case and r["tool"] == "lab"]
        ref = [r for r in rows if _case_of(r) == case and r["tool"] == "bench"]
        if not lab or not ref:
            continue
        name, level = case
        for m in (*METRICS, "output_throughput_window"):
            a_runs = [_figure(r, m)[0] for r in lab]
            b = None if m == "output_throughput_window" else _median([_figure(r, m)[0] for r in ref])
            a, srv = _median(a_runs), _median([_figure(r, m)[1] for r in lab])
            against = b if b is not None else srv
            spread = [v for v in a_runs if v is not None]
            out.append({"case": name, "users_or_rate": level, "metric": m, "lab": a,
                        "vllm_bench": b, "server": srv,
                        "diff": a / against - 1 if a is not None and against else math.nan,
                        "lab_runs": len(lab), "bench_runs": len(ref),
                        "lab_min": min(spread) if spread else None,
                        "lab_max": max(spread) if spread else None})
    cols = ["case", "users_or_rate", "metric", "lab", "vllm_bench", "server", "diff", "lab_runs",
            "bench_runs", "lab_min", "lab_max"]
    df = pd.DataFrame(out, columns=cols)
    path = args.out / "parity.csv"
    df.to_csv(path, index=False, float_format="%.6g")
    print(df.to_string(index=False))
    return path


# ---- a reference folder from one or more stores ---------------------------------------------
def _requests_of(store: Path, run: dict) -> pd.DataFrame:
    """One run's requests, as both tools recorded them: start, TTFT, e2e, lengths, longest gap."""
    tag = run["tag"]
    if run["tool"] == "bench":
        df = bench_samples(json.loads((store / "bench" / f"{tag}.json").read_text()))
    else:
        df = merge_dir(store / "lab" / tag / "samples")
    return request_rows(df, tag)


def host_paths_out(raw_line: str) -> str:
    """One server-raw.jsonl line with each ``model_name`` label cut to the model folder's own
    name: the server labels its series with the path it served, a folder of the measuring host
    that means nothing to a reader of the reference folder."""
    row = json.loads(raw_line)
    for series in row["raw"].values():
        for labels in list(series):
            parsed = json.loads(labels)
            if "model_name" in parsed:
                parsed["model_name"] = Path(parsed["model_name"]).name
                series[json.dumps(parsed)] = series.pop(labels)
    return json.dumps(row)


def export(stores: list[Path], to: Path, configs: list[str] = ()) -> None:
    """One reference folder from stores in order; ``configs[i]`` names store i's server flags
    (`vllm_lab.twin.reference.CONFIGS`), "defaults" where not given."""
    to.mkdir(parents=True, exist_ok=True)
    runs, requests, raw = [], [], []
    for store, config in zip(stores, [*configs, *["defaults"] * (len(stores) - len(configs))]):
        for line in (store / "runs.jsonl").read_text().splitlines():
            run = {**json.loads(line), "config": config}
            requests.append(_requests_of(store, run))
            runs.append(json.dumps(run, default=float))
        if (store / "server-raw.jsonl").exists():
            raw += map(host_paths_out, (store / "server-raw.jsonl").read_text().splitlines())
    (to / "runs.jsonl").write_text("\n".join(runs) + "\n")
    pd.concat(requests).to_csv(to / "requests.csv.gz", index=False, float_format="%.6f")
    with gzip.open(to / "server-raw.jsonl.gz", "wt") as f:
        f.write("\n".join(raw) + "\n")
    power = stores[0].parent / "power.csv"   # the measurement's power log sits beside its stores
    if power.exists():
        pd.read_csv(power).to_csv(to / "power.csv.gz", index=False)
    print(f"{to}: {len(runs)} runs, {sum(map(len, requests))} requests")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["start", "measure", "stop", "csv", "all", "export"])
    ap.add_argument("--inventory", type=Path)
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--model", default="", help="the model folder (every phase but csv and export)")
    ap.add_argument("--url", default="")
    ap.add_argument("--out", type=Path, action="append", required=True,
                    help="the store (export: one or more, in order)")
    ap.add_argument("--to", type=Path, help="export: the reference folder to write")
    ap.add_argument("--config", action="append", default=[],
                    help="export: the server flags of each --out store in turn, e.g. "
                         "max-num-batched-tokens=2048 (default: defaults)")
    ap.add_argument("--cases", default="",
                    help="traffic cases, e.g. closed:64,sharegpt:256,poisson:30,gamma:30:0.5,chat:64")
    ap.add_argument("--levels", default="1,16,64,256,512,1024",
                    help="closed-loop users, when --cases is not given")
    ap.add_argument("--sharegpt", default="", help="a ShareGPT-format file (default: one is written)")
    ap.add_argument("--sharegpt-per-user", type=int, default=5)
    ap.add_argument("--open-s", type=float, default=30.0,
                    help="an open-loop case sends rate x this many seconds' requests")
    ap.add_argument("--runs", default="bench+lab", help="run specs joined by +")
    ap.add_argument("--requests-per-user", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--set", action="append", default=[],
                    help="a scenario override (start: the server's flags, measure: what the lab records), "
                         "e.g. serve.enforce-eager=true")
    args = ap.parse_args()
    if args.phase == "export":
        if not args.to:
            ap.error("export needs --to DIR, the reference folder to write")
        if len(args.config) > len(args.out):
            ap.error(f"export: {len(args.config)} --config for {len(args.out)} --out stores")
        export(args.out, args.to, args.config)
        return 0
    if len(args.out) > 1:
        ap.error(f"{args.phase} takes one --out store; several are for export")
    args.out = args.out[0]
    if args.phase != "csv" and not args.model:
        ap.error(f"{args.phase} needs --model, the model folder on this host")
    args.out.mkdir(parents=True, exist_ok=True)
    args.cases = [Case.parse(c) for c in (args.cases or ",".join(
        f"closed:{x}" for x in args.levels.split(","))).split(",") if c]
    args.runs = [x for x in args.runs.split("+") if x]
    url = args.url
    if args.phase in ("start", "all"):
        url = start(args)
    if not url and (args.out / "server.json").exists():
        url = json.loads((args.out / "server.json").read_text())["url"]
    try:
        if args.phase in ("measure", "all"):
            measure(args, url)
    finally:
        if args.phase in ("stop", "all"):
            serving.stop(args.inventory)
    if args.phase in ("csv", "all"):
        write_csv(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
