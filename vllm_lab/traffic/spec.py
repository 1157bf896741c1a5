"""The traffic layer's configuration: what requests look like (`Workload`) and when they go (`Load`).

Scenario files embed these under `workload:` and `load:`; every model forbids unknown keys so a
misspelled key fails instead of running silently with a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

# Bounds past any real load: a typo (1e15 users, a run of 1e300 s) is refused, not attempted.
MAX_LEVEL = 1_000_000
MAX_SECONDS = 30 * 24 * 3600
MAX_REQUESTS = 1_000_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# A request's prompt or output, in tokens, at most: past any model's context, and a prompt of
# this many tokens is already a few tens of megabytes to build (more was a typo, or an attack).
MAX_TOKENS = 10_000_000


class Lengths(_Strict):
    """A token-length distribution: fixed, uniform, normal or lognormal, clipped to [min, max]."""

    dist: Literal["fixed", "uniform", "normal", "lognormal"] = "fixed"
    mean: float = Field(128, gt=0, le=MAX_TOKENS, description="mean tokens (fixed: the value)")
    std: float = Field(0, ge=0, le=MAX_TOKENS, description="standard deviation in tokens (normal, lognormal)")
    min: int = Field(1, ge=1, le=MAX_TOKENS, description="lower clip, and the low end of uniform")
    max: int = Field(32768, ge=1, le=MAX_TOKENS, description="upper clip, and the high end of uniform")

    @model_validator(mode="after")
    def _check(self) -> Lengths:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        if self.dist in ("normal", "lognormal") and self.std == 0:
            raise ValueError(f"dist {self.dist!r} needs std > 0 (use dist: fixed for a constant)")
        return self


PRESETS: dict[str, tuple[Lengths, Lengths]] = {
    # Means from the PagedAttention paper's dataset statistics (ShareGPT 161.31 in / 337.99 out,
    # Alpaca 19.31 / 58.45); the spreads are long-tailed like the real sets. The lognormal means
    # are set a little above the target because clipping at `max` trims the tail.
    "sharegpt-like": (
        Lengths(dist="lognormal", mean=163, std=190, min=4, max=1024),
        Lengths(dist="lognormal", mean=345, std=300, min=4, max=2048),
    ),
    "alpaca-like": (
        Lengths(dist="lognormal", mean=19.5, std=11, min=4, max=256),
        Lengths(dist="lognormal", mean=58.5, std=50, min=4, max=1024),
    ),
}


class Workload(_Strict):
    """What the requests look like: the prompt source, lengths, API, turns and prefix sharing."""

    source: Literal["sharegpt-like", "alpaca-like", "synthetic", "sharegpt-file", "jsonl-file",
                    "trace"] = "sharegpt-like"
    input: Lengths | None = Field(None, description="prompt tokens (synthetic; overrides a preset)")
    output: Lengths | None = Field(None, description="output tokens (synthetic; overrides a preset)")
    path: Path | None = Field(None, description="ShareGPT JSON, JSONL prompt file or trace (file sources)")
    trace_format: Literal["mooncake", "azure", "burstgpt", "jsonl"] | None = Field(
        None, description="source trace: the trace file's format (vllm_lab/traffic/traces.py)")
    api: Literal["completions", "chat"] = "completions"
    tokenizer: Path | None = Field(
        None, description="model folder with tokenizer.json; else ~1 token per common English word"
    )
    ignore_eos: bool | None = Field(
        None, description="send ignore_eos; default: true when the workload fixes output lengths"
    )
    turns: int = Field(1, ge=1, description="turns per conversation (chat); history is resent")
    shared_prefix_ratio: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="share of the mean prompt that is a system prompt common to all requests",
    )
    prefix_groups: int = Field(1, ge=1, description="how many distinct shared system prompts")
    # Not sent by default, as vllm bench serve does: the server's default sampling. Greedy
    # (0.0) on a model with dummy weights repeats one token that the tokenizer cannot render, and
    # vLLM's API server then re-decodes a growing tail for every token: on an H200 at 256 users
    # the frontend fell 0.9 s behind the engine, TPOT read +30% and throughput -15% (any client).
    temperature: float | None = Field(
        None, ge=0.0, description="sampling temperature to send; null: none (the server's default)")
    shuffle: bool = Field(
        True, description="file sources: send the records in an order the seed draws; false: "
                          "in the file's order (as vllm bench serve --disable-shuffle)")
    priorities: dict[int, float] | None = Field(
        None, description=(
            "the share of requests sent with each priority, e.g. {-1: 0.2, 0: 0.8}: vLLM's "
            "request field, a smaller value served sooner under --scheduling-policy priority "
            "(fcfs ignores it); each request's drawn from the seed; shares sum to 1"))

    @model_serializer(mode="wrap")
    def _without_new_defaults(self, handler):
        data = handler(self)
        # Left out at their defaults, so a scenario written before them keeps its run identity.
        if self.shuffle:
            data.pop("shuffle", None)
        if self.trace_format is None:
            data.pop("trace_format", None)
        if self.priorities is None:
            data.pop("priorities", None)
        return data

    @field_validator("path", "tokenizer", mode="before")
    @classmethod
    def _no_nul(cls, value):
        # The operating system refuses such a path outright (a ValueError, not a missing file).
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("a file path cannot hold a NUL byte")
        return value

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if self.source in ("sharegpt-file", "jsonl-file", "trace") and self.path is None:
            raise ValueError(f"source {self.source!r} needs path: <file>")
        if (self.source == "trace") != (self.trace_format is not None):
            raise ValueError("source 'trace' needs trace_format: mooncake, azure, burstgpt or jsonl"
                             if self.source == "trace" else
                             f"trace_format is for source 'trace', not {self.source!r}")
        if self.source == "synthetic" and (self.input is None or self.output is None):
            raise ValueError("source 'synthetic' needs both input: and output: lengths")
        if self.turns > 1 and self.api != "chat":
            raise ValueError("turns > 1 needs api: chat (a conversation resends its history)")
        if self.priorities is not None and (
                not self.priorities or any(v < 0 for v in self.priorities.values())
                or abs(sum(self.priorities.values()) - 1) > 1e-6):
            raise ValueError("priorities needs a share (0 to 1) for each priority, summing to 1, "
                             "e.g. {-1: 0.2, 0: 0.8}")
        return self

    def lengths(self) -> tuple[Lengths | None, Lengths | None]:
        """Return the (input, output) length distributions after applying the preset."""
        preset = PRESETS.get(self.source, (None, None))
        return (self.input or preset[0], self.output or preset[1])

    def fixes_output(self) -> bool:
        """Whether output lengths come from the workload (then ignore_eos makes them exact)."""
        if self.ignore_eos is not None:
            return self.ignore_eos
        return self.source != "jsonl-file" or self.output is not None


class Shape(_Strict):
    """How the load level (users for a closed loop, requests/s for an open loop) moves over time."""

    kind: Literal["constant", "ramp", "step", "spike", "soak"] = "constant"
    level: float = Field(8, gt=0, le=MAX_LEVEL,
                         description="users (closed) or requests/s (open); the peak")
    start_level: float = Field(1, ge=0, description="ramp and step: the level at t=0")
    steps: int = Field(5, ge=1, description="step: how many equal steps up to `level`")
    step_s: float = Field(30, gt=0, description="step: seconds per step")
    ramp_s: float = Field(30, gt=0, description="ramp: seconds from start_level to level")
    spike_at_s: float = Field(30, ge=0, description="spike: when the spike starts")
    spike_s: float = Field(10, gt=0, description="spike: how long it lasts")
    spike_factor: float = Field(4, ge=1, description="spike: level multiplier during the spike")


class Stop(_Strict):
    """When a run ends: the first of duration, request count, error rate and saturation."""

    duration_s: float = Field(60, gt=0, le=MAX_SECONDS)
    max_requests: int | None = Field(None, ge=1, le=MAX_REQUESTS)
    max_error_rate: float | None = Field(None, gt=0, le=1, description="fraction of failures")
    min_requests_for_error_rate: int = Field(20, ge=1)
    saturation: bool = Field(False, description="stop when TTFT and the server queue grow unbounded")
    saturation_window_s: float = Field(20, gt=0)


# Share of a run's requests that may fail (timeouts aside) before the run counts as failed-requests.
FAILED_REQUESTS_THRESHOLD = 0.05
# vLLM's API server (uvicorn) closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a
# client that reuses one only while it has idled less never sends into a closing connection.
IDLE_CONNECTION_S = 4.0


class Replay(_Strict):
    """How a trace's requests are sent (load.mode replay): each at its own time, from a window."""

    speed: float = Field(1.0, gt=0, description="time scale: 2 sends the trace twice as fast")
    start_s: float = Field(0.0, ge=0, description="the window's start, seconds into the trace")
    duration_s: float | None = Field(None, gt=0, description="the window's length in trace seconds "
                                                              "(null: to the trace's end)")
    rate: float | None = Field(None, gt=0, description="rescale time so the window's mean rate is "
                                                        "this many req/s (overrides speed)")


class Load(_Strict):
    """When requests go: closed loop (users with think time), open loop (Poisson/gamma arrivals)
    or a trace's own times (replay)."""

    mode: Literal["closed", "open", "replay"] = "closed"
    arrival: Literal["poisson", "gamma"] = "poisson"
    burstiness: float = Field(
        1.0, gt=0, description="gamma shape as in `vllm bench serve` (1 = Poisson, <1 burstier)"
    )
    think_time_s: float = Field(0.0, ge=0, description="closed loop: pause between requests")
    max_in_flight: int = Field(256, ge=1, le=MAX_LEVEL,
                               description="open loop: cap on concurrent requests")
    shape: Shape = Field(default_factory=Shape)
    stop: Stop = Field(default_factory=Stop)
    request_timeout_s: float = Field(120, gt=0, le=MAX_SECONDS,
                                     description="no byte for this long: a timeout")
    idle_connection_s: float = Field(
        IDLE_CONNECTION_S, gt=0, le=MAX_SECONDS,
        description="a user idle longer than this opens a fresh connection: keep it below the "
                    "server's keep-alive timeout (vLLM's is 5 s), or a request sent as the server "
                    "closes the connection dies unread",
    )
    max_schedule_lag_s: float = Field(
        0.010, gt=0, description="client lag p99 above this marks the run client_overloaded"
    )
    failed_requests_threshold: float = Field(
        FAILED_REQUESTS_THRESHOLD, ge=0, lt=1,
        description="share of requests failed (timeouts aside) above which the run measured "
                    "nothing: status failed-requests",
    )

    replay: Replay | None = Field(None, description="load.mode replay: speed, window, rate")

    @model_validator(mode="after")
    def _replay_set(self) -> Load:
        if self.mode == "replay" and self.replay is None:
            self.replay = Replay()
        return self

    @property
    def open_loop(self) -> bool:
        """Whether sends follow a schedule (open or replay), not replies (closed)."""
        return self.mode != "closed"

    @model_serializer(mode="wrap")
    def _without_default_threshold(self, handler):
        data = handler(self)
        # Left out at their defaults, so a scenario written before them keeps its run identity.
        if self.failed_requests_threshold == FAILED_REQUESTS_THRESHOLD:
            data.pop("failed_requests_threshold", None)
        if self.idle_connection_s == IDLE_CONNECTION_S:
            data.pop("idle_connection_s", None)
        if self.replay is None:
            data.pop("replay", None)
        return data
