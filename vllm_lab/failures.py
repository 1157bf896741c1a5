"""Whether a run's requests failed, and why: the share that failed, the most common failure
and a hint at its usual cause (an API key, a route, a connection), in words a user can act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

_HINTS = {
    401: "the server wants an API key the load generator did not send (or sent another): give it "
         "where the lab reads it and passes it to both server and load (serve.api-key in the scenario, vllm_api_key in the "
         "inventory or ansible-vault, or VLLM_API_KEY in the lab's environment); a server the lab "
         "did not start needs VLLM_API_KEY",
    403: "the server refused the API key the load generator sent: check it matches the server's "
         "(serve.api-key, vllm_api_key, VLLM_API_KEY)",
    404: "the server does not know the model or the route: check served-model-name and workload.api",
    400: "the server refused the requests: prompt plus output longer than max-model-len, or a "
         "parameter it does not take (see error_detail in the samples)",
    0: "no connection to the server: is it reachable from the load generator (vllm_listen_host, "
       "vllm_advertise_host, a firewall)?",
    "broken_stream": "streams ended early: the server dropped connections (see its log)",
    "empty_output": "replies carried no tokens: check max_tokens and the model",
    "overlong_stream": "streams went on past max_tokens and were cut: the server ignores max_tokens",
}


@dataclass(frozen=True)
class RequestFailures:
    """How many of a run's requests failed, the most common failure, and a hint about its cause."""

    requests: int
    failed: int
    dominant: str  # e.g. "HTTP 401" or "broken_stream"
    dominant_count: int
    hint: str

    @property
    def rate(self) -> float:
        """The failed share (1.0 for a run that sent nothing)."""
        return self.failed / self.requests if self.requests else 1.0

    def message(self) -> str:
        """One line for the store's error column: the share, the dominant failure, the hint."""
        if not self.requests:
            return "no request was sent: the run measured nothing"
        text = (f"{self.failed} of {self.requests} requests failed ({self.rate:.0%}); most: "
                f"{self.dominant} ({self.dominant_count})")
        return f"{text} — {self.hint}" if self.hint else text

    def as_summary(self) -> dict[str, Any]:
        """The figures a run's summary keeps."""
        return {"failed_requests": float(self.failed), "failed_requests_rate": self.rate,
                "dominant_error": self.dominant}


def request_failures(samples: pd.DataFrame) -> RequestFailures:
    """The run's failed requests, timeouts aside: a timeout is the server being slow (overload, the
    stress test's evidence), any other failure means the request was not served as asked."""
    if samples is None or samples.empty:
        return RequestFailures(0, 0, "", 0, "")
    failed = samples[(samples["status"] != "ok") & (samples["error"] != "timeout")]
    if failed.empty:
        return RequestFailures(len(samples), 0, "", 0, "")
    status = failed.get("http_status", pd.Series(0, index=failed.index)).fillna(0).astype(int)
    key = [f"HTTP {c}" if e == "http_error" and c else ("no connection" if e == "http_error" else e)
           for e, c in zip(failed["error"], status)]
    counts = pd.Series(key).value_counts()
    dominant = str(counts.index[0])
    code = dominant.removeprefix("HTTP ")
    lookup: Any = int(code) if code.isdigit() else (0 if dominant == "no connection" else dominant)
    hint = _HINTS.get(lookup, "the server answered with an error: see its log"
                      if isinstance(lookup, int) and lookup >= 500 else "")
    return RequestFailures(len(samples), len(failed), dominant, int(counts.iloc[0]), hint)
