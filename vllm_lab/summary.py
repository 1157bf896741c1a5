"""One run's figures from its raw samples and server time series: the numbers a report compares.

Percentiles come from the pooled raw samples of every worker, never from averaged percentiles.
Throughput and goodput count what happened in the run's steady window: from the first reply's end
to the end of the load asked for (an open loop's last scheduled arrival; a closed loop's last
send, or the moment fewer requests than its users were left in flight). Before it the server is
filling (no request has been through a whole cycle yet: in a closed loop of 256 users the first
wave's prefills alone take seconds with no output); after it the requests still in flight finish
at ever lower concurrency. Both transients are recorded (``warmup_s``, ``drain_s``), not averaged
in, and a window too small to stand for its run says so (``window_note``). The predictor's runs
are read the same way.
Goodput counts the requests per second that meet every per-request SLO threshold (the way
``vllm bench serve --goodput`` counts them); ``meets_slo`` says whether the run's percentiles are
under every SLO at the percentile the scenario names. ``request_failures`` says whether the run
measured anything at all: a run whose requests were refused (401, 404, no connection) is not a
measurement of the server, however its figures read.

``METRICS`` is the one catalog of a run's summary figures: name, unit, label, which way is better
and whether the store keeps it as a column; ``FACTS`` the rest a summary says (verdicts, reasons,
the twin's recorded prediction). The store's columns, the reports' tables, the claims' arms and the
findings read their names, units and labels from it, and ``run_summary.RunSummary``, the typed
record of one run's summary, is generated from both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd

from vllm_lab import stats
from vllm_lab.audit import HISTOGRAMS
from vllm_lab.energy import energy_view

if TYPE_CHECKING:  # the store reads the catalog: no scenario (and traffic) import at run time
    from vllm_lab.scenarios import Slo
    from vllm_lab.traffic.spec import Load

PERCENTILES = (50, 90, 99)
# vLLM's request histograms the audit reads: each gives a run a server mean, p50 and p99.
SERVER_HISTOGRAMS = tuple(HISTOGRAMS)
LATENCIES = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}
HIGHER, LOWER, NEITHER = 1, -1, 0


@dataclass(frozen=True)
class Metric:
    """One figure of a run's summary: how it is named, measured, shown and compared."""

    name: str
    unit: str           # as stored: s, tok/s, req/s, share, count, %, GiB, tokens
    label: str          # for a reader: "TTFT p50"
    better: int         # HIGHER, LOWER or NEITHER
    column: bool = False  # a REAL column of the store's runs table (else in summary_json)
    short: str = ""     # a compact table heading with the shown unit: "TTFT p50 ms"

    @property
    def scale(self) -> float:
        """Factor from the stored unit to the shown one (seconds are shown in ms)."""
        return 1000.0 if self.unit == "s" else 1.0

    @property
    def heading(self) -> str:
        """The compact table heading (``short``, else the label)."""
        return self.short or self.label


LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def _latencies() -> list[Metric]:
    return [Metric(f"{m}_p{p}", "s", f"{label} p{p}", LOWER, True, f"{label} p{p} ms")
            for m, label in LATENCY_LABELS.items() for p in PERCENTILES]


# The store's column order is fixed (a store exported from an older one copies rows with SELECT *):
# new column metrics go at the end of the column group, never between.
METRICS: tuple[Metric, ...] = (
    Metric("duration_s", "s", "measured span", NEITHER, True),
    Metric("requests", "count", "requests", NEITHER, True),
    Metric("errors", "count", "errors", LOWER, True, "errors"),
    Metric("request_throughput", "req/s", "served requests/s", HIGHER, True, "served req/s"),
    Metric("output_throughput", "tok/s", "output tokens/s", HIGHER, True, "output tok/s"),
    Metric("total_throughput", "tok/s", "input+output tokens/s", HIGHER, True),
    Metric("goodput", "req/s", "goodput (req/s meeting every SLO)", HIGHER, True),
    Metric("slo_attainment", "share", "share of requests meeting every SLO", HIGHER, True),
    *_latencies(),
    Metric("queue_len_mean", "count", "requests waiting (mean)", LOWER, True),
    Metric("queue_len_max", "count", "requests waiting (max)", LOWER, True),
    Metric("kv_usage_mean", "share", "KV cache usage (mean)", NEITHER, True),
    Metric("kv_usage_max", "share", "KV cache usage (max)", NEITHER, True),
    Metric("preemptions", "count", "preemptions", LOWER, True, "preemptions"),
    Metric("gpu_util_mean", "%", "GPU utilization", NEITHER, True, "GPU util %"),
    Metric("gpu_mem_used_max_gib", "GiB", "GPU memory used (max)", NEITHER, True),
    # In summary_json: the rest of what summarize, the audit and the load generator add.
    *[Metric(f"{m}_mean", "s", f"{label} mean", LOWER) for m, label in LATENCY_LABELS.items()],
    Metric("kv_cache_tokens", "tokens", "KV cache size", HIGHER, short="KV tokens"),
    Metric("running_max", "count", "requests running (max)", NEITHER),
    # The twin's alone: its TTFT p50 were vLLM's API server at its own limit (twin.profile.at_api_limit),
    # predicted where the twin has that server near it (twin.frontend.LIMIT_CPU).
    Metric("ttft_p50_api_limit", "s", "TTFT p50 at the API server's limit (the twin)", LOWER),
    Metric("failed_requests", "count", "failed requests", LOWER),
    Metric("failed_requests_rate", "share", "failed share of requests", LOWER),
    Metric("loadgen_processes", "count", "Locust processes", NEITHER),
    Metric("server_ttft_mean", "s", "TTFT mean by vLLM's /metrics", LOWER),
    Metric("server_tpot_mean", "s", "TPOT mean by vLLM's /metrics", LOWER),
    Metric("server_frontend_lag_mean", "s", "client minus server E2E (mean)", LOWER),
    Metric("server_api_cpu", "cores", "vLLM's API-server process CPU", NEITHER),
    # vLLM's engine steps over the run's span (audit.STEPS): where the engine never idled, its
    # mean step; a TPOT well past it is the API server's.
    Metric("server_step_s", "s", "engine step by vLLM's /metrics (span / steps)", NEITHER),
    Metric("server_step_tokens", "tokens", "tokens a step by vLLM's /metrics", NEITHER),
    Metric("audit_span_diff", "share", "client against server span", NEITHER),
    # The steady window and how sure its throughput is.
    Metric("warmup_s", "s", "start of the steady window after the first send", NEITHER),
    Metric("drain_s", "s", "drain after the last send", NEITHER),
    Metric("window_share", "share", "steady window's share of the run", NEITHER),
    Metric("send_span_s", "s", "first send to last send", NEITHER),
    Metric("window_requests", "count", "requests finished inside the steady window", NEITHER),
    # What a run's host spent before it on a server started for it (analysis.host_time).
    Metric("server_start_s", "s", "server start before the run (the last one's stop included)", NEITHER),
    Metric("warmup_runs_s", "s", "discarded warm-up runs after the server's start", NEITHER),
    Metric("output_throughput_rel_ci", "share", "output tokens/s 95% half-width (batch means)", LOWER),
    # A workload of several priorities (workload.priorities): TTFT of the requests of the smallest
    # one ("urgent"), which --scheduling-policy priority serves first, and of the others.
    *[Metric(f"ttft_p{p}_{part}", "s", f"TTFT p{p} {part}", LOWER, False, f"TTFT p{p} {part} ms")
      for part in ("urgent", "others") for p in (50, 99)],
    # A closed loop's client turnaround: each user's wait between a reply's end and its next send.
    *[Metric(f"turnaround_{s}", "s", f"client turnaround {s}", LOWER) for s in ("mean", "p50", "p90")],
    # The load generator: its own lag and CPU, its hosts, and a re-run with more processes.
    Metric("schedule_lag_p99_s", "s", "load generator schedule lag p99", LOWER),
    Metric("loop_lag_p99_s", "s", "load generator event-loop lag p99", LOWER),
    Metric("client_cpu_max", "share", "busiest Locust process's CPU", LOWER),
    Metric("loadgen_hosts", "count", "load-generator hosts", NEITHER),
    # The load generator's host: the cores it gives, and the time its CPU quota stalled it
    # (traffic.host_cpu; in a container that also runs vLLM, vLLM's processes too).
    Metric("client_host_cpus", "cores", "cores the load generator's host gives it", NEITHER),
    Metric("client_host_physical_cores", "cores",
           "physical cores among them (a core's SMT threads count once)", NEITHER),
    Metric("client_host_throttled_s", "s", "time the host's CPU quota stalled the run", LOWER),
    Metric("loadgen_rerun_of", "count", "Locust processes of the client-limited first try", NEITHER),
    # vLLM's own account of the run (audit.ServerView) and the client against it (audit.Audit).
    Metric("server_requests", "count", "requests by vLLM's /metrics", NEITHER),
    Metric("server_generation_tokens", "tokens", "generated tokens by vLLM's /metrics", NEITHER),
    Metric("server_prompt_tokens", "tokens", "prompt tokens by vLLM's /metrics", NEITHER),
    *[Metric(f"server_{k}_{s}", "s", f"{k} {s} by vLLM's /metrics", LOWER)
      for k in SERVER_HISTOGRAMS for s in ("mean", "p50", "p99")
      if f"server_{k}_{s}" not in ("server_ttft_mean", "server_tpot_mean")],
    Metric("audit_ttft_diff", "share", "client against server TTFT", NEITHER),
    Metric("audit_tokens_diff", "share", "client against server output tokens", NEITHER),
    # The GPUs' energy over the steady window: their energy counter (NVML, DCGM) where the host
    # has one, else their power samples; the twin's power model on the twin (energy_source says).
    Metric("energy_j", "J", "GPU energy over the window", NEITHER),
    Metric("power_mean_w", "W", "GPU power (mean)", NEITHER, short="GPU W"),
    Metric("joules_per_output_token", "J/token", "energy per output token", LOWER, short="J/token"),
    Metric("output_tokens_per_joule", "tok/J", "output tokens per joule", HIGHER, short="tok/J"),
)
CATALOG: dict[str, Metric] = {m.name: m for m in METRICS}
# The summary figures the store keeps as REAL columns of the runs table, in their column order.
COLUMNS: tuple[str, ...] = tuple(m.name for m in METRICS if m.column)


@dataclass(frozen=True)
class Fact:
    """An entry of a run's summary that is not a figure: a verdict, a reason, a record."""

    name: str
    kind: Any  # the type it holds: bool, str, dict or list
    label: str


# The rest of the one catalog: what a summary says besides its figures.
FACTS: tuple[Fact, ...] = (
    Fact("meets_slo", bool, "every SLO holds at its percentile and no request failed"),
    Fact("slo_verdicts", dict, "each SLO's verdict (ttft, tpot, itl, e2e -> holds)"),
    Fact("window_reason", str, "why the steady window starts where it does"),
    Fact("window_end_reason", str, "why the steady window ends where it does"),
    Fact("window_note", str, "what to know about the steady window"),
    Fact("energy_source", str, "where the energy figures come from: the GPUs' energy counter, "
                               "their power samples, or the twin's power model"),
    Fact("dominant_error", str, "the most common failure of the run's requests"),
    Fact("audit_client_limited", bool, "the client read its streams later than vLLM handed them out"),
    Fact("audit_reason", str, "why the audit calls the run client-limited"),
    Fact("prefix_cache_reset", bool, "the prefix cache was reset before the run"),
    Fact("twin_prediction", dict, "the twin's prediction of a real-vLLM run, made when it was measured"),
    Fact("regression", bool, "a watch probe left its baseline's prediction interval"),
    Fact("regressed_metrics", list, "the figures a watch probe regressed on"),
)


def metric(name: str) -> Metric:
    """The catalog's entry for ``name``, or KeyError naming the known ones (a misspelled key)."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a summary metric; known: {', '.join(CATALOG)}") from None


def select(*names: str) -> tuple[str, ...]:
    """``names``, each checked against the catalog: a module's choice of figures, not a new spelling."""
    return tuple(metric(n).name for n in names)


def as_float(value: Any) -> float | None:
    """A summary value as a float, None when absent or not a number."""
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def value(row: Mapping[str, Any], name: str) -> float:
    """Figure ``name`` of a run row or summary (a catalog metric), NaN when missing or empty."""
    v = as_float(row.get(metric(name).name))
    return math.nan if v is None else v


def _itl_values(samples: pd.DataFrame) -> np.ndarray:
    if "itl_s" not in samples or samples.empty:
        return np.array([])
    lists = [np.asarray(x, dtype=float) for x in samples["itl_s"] if x is not None and len(x)]
    return np.concatenate(lists) if lists else np.array([])


def _metric_values(samples: pd.DataFrame, metric: str) -> np.ndarray:
    if metric == "itl":
        return _itl_values(samples)
    column = LATENCIES[metric]
    return samples[column].dropna().to_numpy(dtype=float) if column in samples else np.array([])


def request_meets_slo(ok: pd.DataFrame, slo: Slo) -> pd.Series:
    """Per request: under every SLO threshold (ITL: the request's worst gap)."""
    meets = pd.Series(True, index=ok.index)
    for metric, target in slo.targets().items():
        limit = target.threshold_ms / 1000
        if metric == "itl":
            worst = ok["itl_s"].map(lambda g: max(g) if g is not None and len(g) else 0.0)
            meets &= worst <= limit
        else:
            values = ok[LATENCIES[metric]]
            meets &= values.fillna(0.0 if metric == "tpot" else np.inf) <= limit
    return meets


def _server_view(metrics: pd.DataFrame | None) -> dict[str, float]:
    """Queue, KV usage, preemptions and GPU figures from the scraped /metrics series."""
    if metrics is None or metrics.empty:
        return {}

    def series(name: str, how: str = "sum") -> pd.Series:
        return metrics.loc[metrics["name"] == name].groupby("ts")["value"].agg(how)

    out: dict[str, float] = {}
    waiting, kv = series("vllm:num_requests_waiting"), series("vllm:kv_cache_usage_perc")
    running = series("vllm:num_requests_running")
    preempt = series("vllm:num_preemptions_total")
    # Utilization is a share per GPU: averaged over a server's GPUs; memory adds up.
    util, used = series("DCGM_FI_DEV_GPU_UTIL", "mean"), series("DCGM_FI_DEV_FB_USED")
    if len(waiting):
        out.update(queue_len_mean=float(waiting.mean()), queue_len_max=float(waiting.max()))
    if len(running):  # a batch at max-num-seqs: requests wait for a slot, not for the budget
        out["running_max"] = float(running.max())
    if len(kv):
        out.update(kv_usage_mean=float(kv.mean()), kv_usage_max=float(kv.max()))
    if len(preempt):
        out["preemptions"] = float(preempt.iloc[-1] - preempt.iloc[0])
    if len(util):
        out["gpu_util_mean"] = float(util.mean())
    if len(used):
        out["gpu_mem_used_max_gib"] = float(used.max()) / 1024  # DCGM reports MiB
    tokens = _kv_cache_tokens(metrics)
    if tokens:
        out["kv_cache_tokens"] = tokens
    return out


def _kv_cache_tokens(metrics: pd.DataFrame) -> float | None:
    """The KV cache's size in tokens, from vllm:cache_config_info's labels (blocks x block size)."""
    info = metrics.loc[metrics["name"] == "vllm:cache_config_info", "labels"]
    for text in info:
        labels = json.loads(text) if isinstance(text, str) else dict(text)
        try:
            return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        except (KeyError, TypeError, ValueError):
            continue  # vLLM leaves num_gpu_blocks "None" until the cache is sized
    return None


class Window(NamedTuple):
    """A run's steady window, whether a warm-up was cut from its start past the first reply, and
    why it ends where it does."""

    start: float
    end: float
    warmup_cut: bool = False
    end_reason: str = "the last send"


def steady_window(samples: pd.DataFrame, min_sends: int = 10,
                  load: Load | None = None) -> Window | None:
    """First reply's end to the end of the load, less a warm-up the output rate shows: the span
    the load was on and the server past its fill.

    The first reply's end is when the load is fully on; a server that was just started (CUDA graphs
    captured lazily, caches cold) can still run slow for a while after it, so the output rate over
    the span is cut where MSER-5 says the warm-up ends (``stats.mser_truncation``). The load ends
    (`_load_end`) at an open loop's last scheduled arrival, and at a closed loop's last send or
    the moment fewer requests than its users were left in flight, whichever comes first.
    None for a tiny run, or one whose sends all went out before any reply ended (a closed loop
    with as many users as requests): it has no steady part, and the whole span is used.
    """
    found = _load_window(samples, min_sends, load)
    if found is None:
        return None
    t0, t1, why = found
    ok = samples[samples["status"] == "ok"] if "status" in samples else samples
    edges, rates = output_rate_series(ok, t0, t1)
    cut = stats.warmup_cut(rates) if len(rates) >= WARMUP_MIN_BINS else 0
    return Window(float(edges[cut]), t1, True, why) if cut else Window(t0, t1, False, why)


def _window_reason(warmup_s: float, window: Window) -> str:
    """Why the window starts and ends where it does, for the run's record."""
    if window.warmup_cut:
        return (f"from {warmup_s:.1f} s, where the output rate settled (MSER-5 warm-up cut past the "
                f"first reply), to {window.end_reason}")
    return f"from the first reply ({warmup_s:.1f} s after the first send) to {window.end_reason}"


# Bins of the output-rate series a window is judged on: enough for MSER-5 to see a trend.
RATE_BINS = 40
WARMUP_MIN_BINS = 20
# A window shorter than this share of the time its load was sent (first send to last send: the
# fill before it, and sends after it, are what it leaves out), or with fewer finished requests,
# measured too little of the run to stand for it: the summary says so (``window_note``). The
# drain after the last send is the requests in flight finishing, as long as the longest reply:
# it is judged on its own (``DRAIN_MAX_E2E``), not against the window, or every short run of
# long-tailed replies would read as one that did not hold its load.
WINDOW_MIN_SHARE = 0.5
WINDOW_MIN_REQUESTS = 20


def _load_window(samples: pd.DataFrame, min_sends: int,
                 load: Load | None = None) -> tuple[float, float, str] | None:
    starts = samples["start_ts"].dropna()
    if len(starts) < min_sends:
        return None
    ok = samples[samples["status"] == "ok"] if "status" in samples else samples
    ends = (ok["start_ts"] + ok["e2e_s"]).dropna()
    if ends.empty:
        return None
    t0 = float(ends.min())
    t1, why = _load_end(samples, load)
    return (t0, t1, why) if t1 > t0 else None


def _load_end(samples: pd.DataFrame, load: Load | None) -> tuple[float, str]:
    """When the run's load stopped being the load asked for, and why.

    Open loop: its last scheduled arrival (a client running late does not stretch the run).
    Closed loop of constant users: its last send, or earlier, the first moment a user left the
    loop for good (its last reply), from which fewer requests than users were in flight: a run
    whose users ran out of work at different times drains while it still sends (seen as another
    user sending twice after it).
    """
    last_send = float(samples["start_ts"].max())
    if load is not None and load.open_loop and "scheduled_ts" in samples:
        planned = samples["scheduled_ts"].dropna()
        if len(planned):
            return min(last_send, float(planned.max())), "the last scheduled arrival"
    closed = load is not None and load.mode == "closed" and load.shape.kind == "constant"
    if closed and {"worker", "user"} <= set(samples.columns):
        end = samples["start_ts"] + samples["e2e_s"].fillna(0)
        users = [samples["worker"], samples["user"]]
        by_user = end.groupby(users).max()
        left = float(by_user.min())
        # A send after that reply may have been taken from the pool before it and only stamped
        # after it (a busy client); a user sending twice after it took work that was still there
        # when the first user left: the loop drained while it still sent.
        later = samples["start_ts"] > left
        drained = bool(later.any()) and int(later.groupby(users).sum().max()) >= 2
        if len(by_user) >= load.shape.level and drained:
            return left, "the first user's last reply (fewer in flight than users)"
    return last_send, "the last send"


def output_rate_series(ok: pd.DataFrame, t0: float, t1: float,
                       bins: int = RATE_BINS) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in ``bins`` equal slices of [t0, t1]: the slices' left edges (and
    t1 last) and their rates."""
    edges = np.linspace(t0, t1, bins + 1)
    emitted = _emitted(*_token_times(ok), edges[:, None]).sum(axis=1)
    return edges, np.diff(emitted) / np.diff(edges)


def emitted_by(ok: pd.DataFrame, t: float) -> np.ndarray:
    """Each request's output tokens emitted by time ``t``: its first at its TTFT, the rest evenly
    spread up to its end (the predictor's samples carry no per-token times; ITLs average out)."""
    return _emitted(*_token_times(ok), t)


def _token_times(ok: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each request's output tokens, first token's time and end, as arrays."""
    n = ok["output_tokens"].fillna(0).to_numpy(dtype=float)
    first = (ok["start_ts"] + ok["ttft_s"]).to_numpy(dtype=float)
    end = (ok["start_ts"] + ok["e2e_s"]).to_numpy(dtype=float)
    return n, first, end


def _emitted(n: np.ndarray, first: np.ndarray, end: np.ndarray, t) -> np.ndarray:
    """``emitted_by`` on arrays; ``t`` a time, or a column of times (one row each)."""
    share = np.clip((t - first) / np.maximum(end - first, 1e-9), 0.0, 1.0)
    emitted = np.where(first <= t, 1 + (n - 1) * share, 0.0)
    return np.nan_to_num(np.clip(emitted, 0.0, n))


def tokens_by(ok: pd.DataFrame, t: float) -> float:
    """Output tokens emitted by time ``t``, over every request (``emitted_by``)."""
    return float(emitted_by(ok, t).sum())


def served_share(ok: pd.DataFrame, t0: float, t1: float) -> np.ndarray:
    """How much of each request was served inside [t0, t1]: the share of its output tokens
    emitted there (a request with no output counts whole where it ended).

    Requests served per second are the sum over the window's length, as a queueing system's
    throughput is measured: counting the completions inside a window instead misses the
    requests still in flight at its end (about their E2E's worth of arrivals, nothing at its
    start makes up for it), and reads a server that keeps up as falling behind.
    """
    n = ok["output_tokens"].fillna(0).to_numpy(dtype=float)
    end = (ok["start_ts"] + ok["e2e_s"]).to_numpy(dtype=float)
    whole = ((end > t0) & (end <= t1)).astype(float)
    part = (emitted_by(ok, t1) - emitted_by(ok, t0)) / np.maximum(n, 1.0)
    return np.where(n > 0, part, whole)


def held_share(summary: Mapping[str, Any]) -> float | None:
    """The steady window's share of the time the load was sent (first send to last send; at
    least its warm-up plus the window). An older summary without them: its share of the run."""
    warm, window = as_float(summary.get("warmup_s")), as_float(summary.get("duration_s"))
    if warm is None or not window:
        return as_float(summary.get("window_share"))
    return window / max(as_float(summary.get("send_span_s")) or 0.0, warm + window)


def _window_note(share: float, finished: float) -> str:
    """What a reader must know about a window too small to stand for its run ("" when none)."""
    why = []
    if share < WINDOW_MIN_SHARE:
        why.append(f"the load held for only {share:.0%} of the time it was sent (the fill took the "
                   "rest)")
    if finished < WINDOW_MIN_REQUESTS:
        why.append(f"only {finished:.0f} requests finished inside it")
    return "; ".join(why)


# A drain this many times the run's E2E p99 (and longer than DRAIN_FLOOR_S) is not requests in
# flight finishing: the load went on after its window (a client sending late, users leaving the
# loop one by one), so the window does not stand for the load asked for.
DRAIN_MAX_E2E = 3.0
DRAIN_FLOOR_S = 2.0


def unsteady_reason(summary: Mapping[str, Any], load: Load) -> str:
    """Why a run did not hold its load ("" when it did), from its steady window's figures.

    A closed loop holds its load while its users are all in the loop: a window under
    ``WINDOW_MIN_SHARE`` of the time the load was sent means the fill was most of it. An open
    loop's arrivals keep their schedule whatever the server does (a client that fell behind is
    client-limited), so its share is not judged: an overloaded server drains long, and that is the stress test's
    evidence. Any run whose drain is far longer than its requests take did not hold its load.
    A run without a steady window (a tiny run) says nothing here.
    """
    share, drain = held_share(summary), as_float(summary.get("drain_s"))
    e2e = as_float(summary.get("e2e_p99"))
    why = []
    if share is not None and not load.open_loop and share < WINDOW_MIN_SHARE:
        why.append(f"its steady window covered {share:.0%} of the time its load was sent (at least "
                   f"{WINDOW_MIN_SHARE:.0%} is needed: make the run longer than its fill)")
    if drain is not None and e2e and drain > max(DRAIN_MAX_E2E * e2e, DRAIN_FLOOR_S):
        why.append(f"it drained {drain:.1f} s after its window, {drain / e2e:.0f}x its E2E p99 of "
                   f"{e2e:.1f} s: the load went on after the window")
    return "; ".join(why)


def client_turnaround(samples: pd.DataFrame) -> dict[str, float]:
    """How long a closed-loop user waited between a reply's end and its own next send.

    Part of the load, not of the server: a user that comes back late spreads the next wave of
    a closed loop, and a spread wave batches fewer prefills together (lower TTFT, a little less
    throughput). vllm bench serve's users wait about a millisecond. Empty without user ids.
    """
    if not {"worker", "user", "start_ts", "e2e_s"} <= set(samples.columns) or len(samples) < 2:
        return {}
    s = samples.sort_values("start_ts")
    end = s["start_ts"] + s["e2e_s"]
    gap = (s["start_ts"] - end.groupby([s["worker"], s["user"]]).shift()).dropna()
    if gap.empty:
        return {}
    return {"turnaround_mean": float(gap.mean()), "turnaround_p50": float(gap.median()),
            "turnaround_p90": float(gap.quantile(0.9))}


def closed_loop_gaps(starts, ends, users: int) -> np.ndarray:
    """A closed loop's turnarounds (seconds) from send and end times alone, for a client that
    records no user ids: the k-th send after the first wave follows the k-th end."""
    starts = np.sort(np.asarray(starts, dtype=float))[users:]
    return starts - np.sort(np.asarray(ends, dtype=float))[:len(starts)]


def summarize(samples: pd.DataFrame, slo: Slo, duration_s: float | None = None,
              server_metrics: pd.DataFrame | None = None,
              load: Load | None = None) -> dict[str, Any]:
    """The run's summary: throughput, goodput, latency percentiles, SLO verdict, server view.

    ``load`` (the run's) tells where the load ended (`_load_end`); without it, at the last send.
    """
    out: dict[str, Any] = {"requests": float(len(samples))}
    if samples.empty:
        return {**out, "errors": 0.0, **_server_view(server_metrics)}
    ok = samples[samples["status"] == "ok"] if "status" in samples else samples
    out["errors"] = float(len(samples) - len(ok))
    meets = request_meets_slo(ok, slo)
    window = None if duration_s is not None else steady_window(samples, load=load)
    if window is None:
        # Given (the predictor's virtual time), or no steady part: everything over the whole span,
        # as vllm bench serve counts it (first send to last reply).
        if duration_s is None:
            start = samples["start_ts"].min()
            duration_s = float((samples["start_ts"] + samples["e2e_s"].fillna(0)).max() - start)
        duration_s = max(float(duration_s), 1e-9)
        out_tokens = float(ok["output_tokens"].fillna(0).sum())
        in_tokens = float(ok["prompt_tokens"].fillna(0).sum())
        done, good = float(len(ok)), float(meets.sum())
    else:
        t0, t1 = window.start, window.end
        duration_s = t1 - t0
        out_tokens = tokens_by(ok, t1) - tokens_by(ok, t0)
        first = ok["start_ts"] + ok["ttft_s"]
        in_tokens = float(ok.loc[(first > t0) & (first <= t1), "prompt_tokens"].fillna(0).sum())
        end = ok["start_ts"] + ok["e2e_s"]
        finished = (end > t0) & (end <= t1)
        served = served_share(ok, t0, t1)
        done, good = float(served.sum()), float(served[meets.to_numpy()].sum())
        out["warmup_s"] = t0 - float(samples["start_ts"].min())
        out["window_reason"] = _window_reason(out["warmup_s"], window)
        out["window_end_reason"] = window.end_reason
        last_end = float((samples["start_ts"] + samples["e2e_s"].fillna(0)).max())
        out["drain_s"] = last_end - t1
        out["window_share"] = duration_s / max(last_end - float(samples["start_ts"].min()), 1e-9)
        out["window_requests"] = float(finished.sum())
        # Within-run precision: batch means of the window's output rate (10 batches).
        _, rates = output_rate_series(ok, t0, t1)
        out["output_throughput_rel_ci"] = stats.batch_means_ci(rates).relative
        out["send_span_s"] = float(samples["start_ts"].max() - samples["start_ts"].min())
        note = _window_note(held_share({**out, "duration_s": duration_s}), out["window_requests"])
        if note:
            out["window_note"] = note
        out.update(energy_view(server_metrics, t0, t1, out_tokens))
    out["duration_s"] = duration_s
    out["request_throughput"] = done / duration_s
    out["output_throughput"] = out_tokens / duration_s
    out["total_throughput"] = (out_tokens + in_tokens) / duration_s
    out["goodput"] = good / duration_s
    out["slo_attainment"] = float(meets.sum()) / len(samples)
    verdicts = {}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        values = _metric_values(ok, metric)
        for p in PERCENTILES:
            out[f"{metric}_p{p}"] = float(np.percentile(values, p)) if len(values) else None
        out[f"{metric}_mean"] = float(values.mean()) if len(values) else None
        target = slo.targets().get(metric)
        if target is not None:
            at = float(np.percentile(values, target.percentile)) if len(values) else np.inf
            verdicts[metric] = at <= target.threshold_ms / 1000
    out["meets_slo"] = bool(verdicts) and all(verdicts.values()) and out["errors"] == 0
    out["slo_verdicts"] = verdicts
    out.update(_by_priority(ok))
    out.update(client_turnaround(samples))
    out.update(_server_view(server_metrics))
    return out


def _by_priority(ok: pd.DataFrame) -> dict[str, float]:
    """TTFT p50 and p99 of the requests sent with the smallest priority ("urgent") and of the
    rest ("others"), where the run sent more than one priority; else nothing."""
    if "priority" not in ok:
        return {}
    priority = pd.to_numeric(ok["priority"], errors="coerce").fillna(0)
    if priority.nunique() < 2:
        return {}
    urgent, out = priority == priority.min(), {}
    for part, rows in (("urgent", ok[urgent]), ("others", ok[~urgent])):
        values = _metric_values(rows, "ttft")
        for p in (50, 99):
            out[f"ttft_p{p}_{part}"] = float(np.percentile(values, p)) if len(values) else None
    return out


# Why most requests of a run failed, by HTTP status (0: no connection) or error class, and what to do.
