"""The server's own account of a run, and how far the client's figures stand from it.

vLLM counts every request it serves in /metrics: histograms of TTFT, time per output token, e2e
latency, queue, prefill and decode time, and counters of requests and generated tokens. The
difference of a scrape taken before the run's first request and one taken after its last reply is
the server's view of exactly that run. Its sums and counts are exact, so the *means* compare
exactly with the client's; its percentiles come from coarse buckets (e.g. TTFT 1 / 2.5 / 5 s) and
are only indicative.

The client and the server time different spans: vLLM's TTFT and e2e start when the API server
has parsed and tokenized the request and end when its output loop hands the token over; its
time per output token runs on the engine's own clock. The client adds its send, the SSE framing
and the network. A client that reads its streams late (a full core, a starved event loop) adds
more: its TPOT grows, and in a closed loop it sends its next request late, so fewer requests
keep the server busy. ``audit`` names such a run client-limited.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

# The histograms compared, by the summary key they audit.
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}
COUNTERS = {
    "requests": "vllm:request_success_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}
# The engine's steps: one observation a step, of the tokens it carried (its count the steps run,
# its sum their tokens). Over the run's span they give the engine's pace beside the client's TPOT:
# what a token waits past the engine's step is the API server's.
STEPS = "vllm:iteration_tokens_total"
# The CPU seconds of the process that serves /metrics, all its threads: with one API-server
# process (vLLM's default) that is the API server, whose single event loop admits every request
# and streams every token. Near one core it is the limit, and --api-server-count the flag for it.
# Several API-server processes share their metrics through files and export no process series.
PROCESS_CPU = "process_cpu_seconds_total"

# How far the client's decode span (e2e - TTFT, from its first to its last token) may exceed the
# server's before the run is client-limited. Both are taken where the token leaves vLLM's API
# server and where the client reads it, so they differ only by how late the client reads: on the
# H200, vllm bench serve and the lab's client both stood within 0.4% of the server at 256 users,
# while a client on a full core read 10-40% late. The floor covers the final chunk's framing on
# very short outputs.
SPAN_TOLERANCE = 0.03
SPAN_FLOOR_S = 0.005


@dataclass(frozen=True)
class ServerView:
    """What vLLM's /metrics say about one run (differences of two scrapes)."""

    requests: float
    generation_tokens: float
    prompt_tokens: float
    means: dict[str, float]        # seconds, by HISTOGRAMS key
    percentiles: dict[str, float]  # "ttft_p50": seconds, bucket-interpolated (indicative)
    span_s: float                  # seconds between the two scrapes
    api_cpu: float | None = None   # cores the API-server process used between them (PROCESS_CPU)
    steps: float = 0.0             # engine steps between them (STEPS), and the tokens they carried
    step_tokens: float = 0.0

    @property
    def frontend_lag_s(self) -> float | None:
        """How much later the API server handed out a request's last token than its first,
        beyond the engine's own decode time (mean): the frontend falling behind the engine."""
        m = self.means
        if not all(k in m for k in ("e2e", "ttft", "decode")):
            return None
        return m["e2e"] - m["ttft"] - m["decode"]

    def as_summary(self) -> dict[str, float]:
        """Flat ``server_*`` keys for a run's summary."""
        out = {"server_requests": self.requests, "server_generation_tokens": self.generation_tokens,
               "server_prompt_tokens": self.prompt_tokens}
        if self.frontend_lag_s is not None:
            out["server_frontend_lag_mean"] = self.frontend_lag_s
        if self.api_cpu is not None:
            out["server_api_cpu"] = self.api_cpu
        out.update(step_figures(self.span_s, self.steps, self.step_tokens))
        out.update({f"server_{k}_mean": v for k, v in self.means.items()})
        out.update({f"server_{k}": v for k, v in self.percentiles.items()})
        return out


def step_figures(span_s: float, steps: float, tokens: float) -> dict[str, float]:
    """The engine's pace over a run's span: its seconds a step (the mean step where the engine
    never idled) and the tokens a step carried; none without steps."""
    if steps <= 0:
        return {}
    return {"server_step_s": span_s / steps, "server_step_tokens": tokens / steps}


def _scrape_times(metrics: pd.DataFrame) -> np.ndarray:
    return np.sort(metrics.loc[metrics["name"] == COUNTERS["requests"], "ts"].unique())


def _total(metrics: pd.DataFrame, name: str, ts: float) -> float:
    rows = metrics[(metrics["name"] == name) & (metrics["ts"] == ts)]
    return float(rows["value"].sum())


def _buckets(metrics: pd.DataFrame, name: str, ts: float) -> pd.Series:
    """Cumulative bucket counts by upper bound, summed over every other label (engines, models)."""
    rows = metrics[(metrics["name"] == name + "_bucket") & (metrics["ts"] == ts)]
    if rows.empty:
        return pd.Series(dtype=float)
    le = rows["labels"].map(lambda s: float(json.loads(s)["le"]))
    return rows.groupby(le.to_numpy())["value"].sum().sort_index()


def histogram_quantile(q: float, upper: np.ndarray, cumulative: np.ndarray) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the q-th observation."""
    if not len(cumulative) or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    i = int(np.searchsorted(cumulative, rank, side="left"))
    if i >= len(upper) or not np.isfinite(upper[i]):
        return float(upper[i - 1]) if i > 0 else None
    lo_bound = upper[i - 1] if i > 0 else 0.0
    lo_count = cumulative[i - 1] if i > 0 else 0.0
    inside = cumulative[i] - lo_count
    return float(lo_bound + (upper[i] - lo_bound) * ((rank - lo_count) / inside if inside else 1.0))


def server_view(metrics: pd.DataFrame | None) -> ServerView | None:
    """The server's view of a run from its scraped /metrics: last scrape minus first.

    None when the series hold no vLLM request counter (a server without vLLM's metrics, or fewer
    than two scrapes).
    """
    if metrics is None or metrics.empty:
        return None
    times = _scrape_times(metrics)
    if len(times) < 2:
        return None
    t0, t1 = float(times[0]), float(times[-1])

    def delta(name: str) -> float:
        return _total(metrics, name, t1) - _total(metrics, name, t0)

    means, pct = {}, {}
    for key, name in HISTOGRAMS.items():
        count = delta(name + "_count")
        if count > 0:
            means[key] = delta(name + "_sum") / count
        b0, b1 = _buckets(metrics, name, t0), _buckets(metrics, name, t1)
        if b1.empty:
            continue
        diff = (b1 - b0.reindex(b1.index, fill_value=0.0)).to_numpy()
        for q in (50, 99):
            v = histogram_quantile(q / 100, b1.index.to_numpy(dtype=float), diff)
            if v is not None:
                pct[f"{key}_p{q}"] = v
    cpu = metrics[metrics["name"] == PROCESS_CPU]
    api_cpu = (delta(PROCESS_CPU) / (t1 - t0)
               if {t0, t1} <= set(cpu["ts"].astype(float)) and t1 > t0 else None)
    return ServerView(requests=delta(COUNTERS["requests"]),
                      generation_tokens=delta(COUNTERS["generation_tokens"]),
                      prompt_tokens=delta(COUNTERS["prompt_tokens"]),
                      means=means, percentiles=pct, span_s=t1 - t0, api_cpu=api_cpu,
                      steps=delta(STEPS + "_count"), step_tokens=delta(STEPS + "_sum"))


@dataclass(frozen=True)
class Audit:
    """The client's means against the server's, and the verdict."""

    client: dict[str, float]       # means, seconds: ttft, tpot, e2e, span (e2e - ttft)
    server: dict[str, float]
    span_diff: float | None        # client span / server span - 1
    ttft_diff: float | None        # client TTFT mean / server's - 1 (adds the time before vLLM's
                                   # arrival stamp: the send, HTTP parsing, tokenization)
    tokens_diff: float | None      # client output tokens / server generation tokens - 1
    client_limited: bool
    reason: str

    def as_summary(self) -> dict:
        """Flat keys for a run's summary."""
        out = {"audit_span_diff": self.span_diff, "audit_ttft_diff": self.ttft_diff,
               "audit_tokens_diff": self.tokens_diff, "audit_client_limited": self.client_limited,
               "audit_reason": self.reason}
        return {k: v for k, v in out.items() if v is not None}


def client_means(samples: pd.DataFrame) -> dict[str, float]:
    """Mean TTFT, TPOT, e2e and decode span of the run's successful requests (seconds)."""
    ok = samples[samples["status"] == "ok"] if "status" in samples else samples
    out = {}
    for key, col in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s")):
        if col in ok:
            v = ok[col].dropna().to_numpy(dtype=float)
            if v.size:
                out[key] = float(v.mean())
    if "e2e" in out and "ttft" in out:
        out["span"] = out["e2e"] - out["ttft"]
    return out


def audit(samples: pd.DataFrame, view: ServerView | None) -> Audit | None:
    """Compare a run's client means with the server's; None without a server view.

    Client-limited when the client's mean decode span (first to last token) exceeds the API
    server's by more than SPAN_TOLERANCE (and SPAN_FLOOR_S): the client read its streams later
    than vLLM handed them out. A span below the server's is no fault of the client.
    """
    if view is None or samples.empty or view.requests <= 0:
        return None
    client = client_means(samples)
    m = view.means
    server_span = m["e2e"] - m["ttft"] if "e2e" in m and "ttft" in m else None
    span_diff = ttft_diff = None
    reason = ""
    if server_span and "span" in client:
        span_diff = client["span"] / server_span - 1
        excess = client["span"] - server_span
        if excess > max(SPAN_TOLERANCE * server_span, SPAN_FLOOR_S):
            reason = (f"the client read its streams {span_diff:+.1%} later than vLLM's API server "
                      f"handed them out (first to last token: {client['span'] * 1e3:.0f} ms against "
                      f"{server_span * 1e3:.0f} ms; tolerance {SPAN_TOLERANCE:.0%})")
    if m.get("ttft") and "ttft" in client:
        ttft_diff = client["ttft"] / m["ttft"] - 1
    ok = samples[samples["status"] == "ok"] if "status" in samples else samples
    tokens = float(ok["output_tokens"].fillna(0).sum()) if "output_tokens" in ok else 0.0
    tokens_diff = tokens / view.generation_tokens - 1 if view.generation_tokens else None
    return Audit(client=client, server=dict(m), span_diff=span_diff, ttft_diff=ttft_diff,
                 tokens_diff=tokens_diff, client_limited=bool(reason), reason=reason)


def to_json(a: Audit | ServerView | None) -> dict:
    """A plain dict for JSON files (None: empty)."""
    return asdict(a) if a is not None else {}
