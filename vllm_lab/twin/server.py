"""The twin's HTTP server: started like `vllm serve`, answering vLLM's OpenAI API and /metrics.

An asyncio task steps the simulated engine on an ideal timeline: each step starts where the last
one ended (or when a request arrives at an idle engine) and its outputs are released on the real
clock at step start + modelled duration. When the host cannot keep up, the release is late (the
lag is measured and exported), the timeline does not drift, and tokens that piled up for a request
go out in one SSE event, as vLLM's --stream-interval would send them. Each request's ground truth
(its times on the ideal timeline) is served at /twin/ground_truth so clients can check themselves.

    vllm-twin serve MODEL [--flag value ...] [--config cfg.yaml] [--host H] [--port P]
    python -m vllm_lab.twin.server serve MODEL ...
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import sys
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from vllm_lab import flags as flag_catalog
from vllm_lab.twin.engine import Engine, EngineRequest, EngineStartError
from vllm_lab.twin.frontend import Frontend
from vllm_lab.twin.metrics import CONTENT_TYPE, TwinMetrics
from vllm_lab.twin.tokenizer import TwinTokenizer, draw_eos_after, load_tokenizer, pseudo_word

VLLM_VERSION = flag_catalog.DEFAULT_VLLM_VERSION
DEFAULT_PROFILE = "h200-llama-3-8b"
# Flags the API server consumes itself; every other given flag goes to the engine.
FRONTEND_FLAGS = {"host", "port", "api-key", "served-model-name", "uvicorn-log-level",
                  "max-log-len", "chat-template", "disable-uvicorn-access-log",
                  "enable-log-requests", "disable-log-stats", "model", "tokenizer",
                  "stream-interval"}
# vLLM parses these with human_readable_int ("8k", "1K"); max-model-len also takes "auto"/-1.
HUMAN_INT_FLAGS = {"max-num-batched-tokens", "kv-cache-memory-bytes", "max-model-len"}
GROUND_TRUTH_KEEP = 200_000
SPIN_S = 0.001  # the last stretch before a release is waited by yielding, not by a timer


# ---------------------------------------------------------------- logging, vLLM's way

def _log(level: str, where: str, msg: str, proc: str = "APIServer", err: bool = False) -> None:
    """One log line in vLLM's format: ``(APIServer pid=N) INFO 11-30 12:00:00 [file.py:1] msg``."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = f"({proc} pid={os.getpid()}) {level} {stamp} [{where}] {msg}\n"
    stream = sys.stderr if err else sys.stdout
    stream.write(line)
    stream.flush()


# ---------------------------------------------------------------- command line

def _human_int(value: str) -> int:
    """vLLM's human_readable_int: '8k' -> 8000, '8K' -> 8192, plain integers as they are."""
    value = value.strip()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
            "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if value and value[-1] in mult:
        number = value[:-1]
        if value[-1].isupper():
            if not number.isdigit():
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with binary suffixes like {value[-1]}. Did you mean "
                    f"to use {number}{value[-1].lower()} instead?")
            return int(number) * mult[value[-1]]
        return int(float(number) * mult[value[-1]])
    if value in ("auto", "-1"):
        return -1
    return int(value)


_human_int.__name__ = "human_readable_int"  # argparse names it in "invalid ... value"


def build_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s parser, built from the lab's flag catalog (vllm_lab.flags)."""
    parser = argparse.ArgumentParser(
        prog="vllm serve", description="Launch a local OpenAI-compatible API server (the twin).",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("model_tag", nargs="?", help="The model tag to serve.")
    parser.add_argument("--config", help="Read CLI options from a config file (YAML).")
    for name, flag in flag_catalog.FLAGS.items():
        opt = "--" + name
        if name == "served-model-name":
            parser.add_argument(opt, nargs="+", help=flag.help)
        elif flag.kind == "bool":
            parser.add_argument(opt, action=argparse.BooleanOptionalAction, help=flag.help)
        elif flag.kind == "int":
            conv = _human_int if name in HUMAN_INT_FLAGS else int
            if flag.choices:
                parser.add_argument(opt, type=conv, choices=flag.choices, help=flag.help)
            else:
                parser.add_argument(opt, type=conv, help=flag.help)
        elif flag.kind == "float":
            parser.add_argument(opt, type=float, help=flag.help)
        else:
            parser.add_argument(opt, type=str, choices=flag.choices, help=flag.help)
    twin = parser.add_argument_group("twin-only settings (not vLLM flags)")
    twin.add_argument("--twin-profile", help="Step-time profile name or YAML path "
                      "(env VLLM_TWIN_PROFILE, default h200-llama-3-8b).")
    twin.add_argument("--twin-startup-seconds", type=float,
                      help="Simulated start-up time (env VLLM_TWIN_STARTUP_SECONDS, default 1).")
    return parser


def _normalise(args: list[str]) -> list[str]:
    # FlexibleArgumentParser accepts --max_num_seqs as --max-num-seqs and --key=value.
    out = []
    for a in args:
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            a = "--" + key.replace("_", "-") + (eq + val if eq else "")
        out.append(a)
    return out


def _config_args(path: str) -> list[str]:
    """vLLM's --config: YAML keys spelled as flags, turned into command-line words."""
    if path.split(".")[-1] not in ("yaml", "yml"):
        raise ValueError(f"Config file must be of a yaml/yml type. {path.split('.')[-1]} supplied")
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"Unable to read the config file at {path}. Check path correctness") from e
    out: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            if value:  # vLLM drops false booleans from the file: the default stands
                out.append("--" + key)
        elif isinstance(value, list):
            if value:
                out += ["--" + key] + [str(v) for v in value]
        elif isinstance(value, dict):
            out += ["--" + key, json.dumps(value)]
        else:
            out += ["--" + key, str(value)]
    return out


@dataclass
class ServeArgs:
    """What `serve` was asked: the model, the flags given (kebab-case) and the twin's settings."""

    model: str
    flags: dict[str, Any]
    profile: str
    startup_s: float


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """Parse `serve MODEL [flags]` as vLLM does; argparse errors exit 2 with vLLM's wording."""
    parser = build_parser()
    argv = _normalise(list(argv))
    if argv and argv[0] == "serve":
        argv = argv[1:]
    else:
        parser.error("the following arguments are required: subparser (choose from serve)")
    if "--config" in argv:
        i = argv.index("--config")
        if i == len(argv) - 1:
            parser.error("No config file specified! Please check your command-line arguments.")
        try:
            cfg = _normalise(_config_args(argv[i + 1]))
        except ValueError as e:
            parser.error(str(e))
        rest = argv[:i] + argv[i + 2:]
        # Precedence as vLLM: CLI > config file > defaults; the model stays first.
        if rest and not rest[0].startswith("-"):
            argv = rest[:1] + cfg + rest[1:]
        else:
            argv = cfg + rest
    ns = vars(parser.parse_args(argv))
    ns.pop("config", None)
    model = ns.pop("model_tag", None) or ns.pop("model", None)
    ns.pop("model", None)
    if not model:
        parser.error("No model specified! Please specify model either as a positional argument "
                     "or in a config file.")
    profile = ns.pop("twin_profile", None) or os.environ.get("VLLM_TWIN_PROFILE") or DEFAULT_PROFILE
    startup = ns.pop("twin_startup_seconds", None)
    if startup is None:
        startup = float(os.environ.get("VLLM_TWIN_STARTUP_SECONDS", "1.0"))
    given = {k.replace("_", "-"): v for k, v in ns.items()}
    _check_ranges(given)
    return ServeArgs(model=model, flags=given, profile=profile, startup_s=startup)


def _check_ranges(given: dict[str, Any]) -> None:
    """Refuse out-of-range values as vLLM's pydantic config does (exit 1, its wording)."""
    for name, value in given.items():
        flag = flag_catalog.FLAGS.get(name)
        if flag is None or flag.kind not in ("int", "float") or value is None:
            continue
        if name == "max-model-len" and value == -1:
            continue
        bad = None
        if flag.min is not None:
            if flag.min_exclusive and value <= flag.min:
                bad = ("greater_than", f"Input should be greater than {flag.min:g}")
            elif not flag.min_exclusive and value < flag.min:
                bad = ("greater_than_equal", f"Input should be greater than or equal to {flag.min:g}")
        if flag.max is not None and value > flag.max:
            bad = ("less_than_equal", f"Input should be less than or equal to {flag.max:g}")
        if bad:
            field_name = name.replace("-", "_")
            sys.stderr.write(
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for EngineArgs\n"
                f"{field_name}\n  {bad[1]} [type={bad[0]}, input_value={value!r}, "
                f"input_type={type(value).__name__}]\n")
            sys.exit(1)


# ---------------------------------------------------------------- requests in flight

@dataclass
class _Req:
    """One request's state between the engine loop and its HTTP handler."""

    rid: str
    arrival: float
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    eos_after: int | None
    engine_arrival: float = 0.0  # arrival + the profile's frontend latency (HTTP, tokenize)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[int] = field(default_factory=list)
    n_out: int = 0
    num_cached: int = 0
    finished: bool = False
    finish_reason: str | None = None
    sched_plan: float | None = None
    first_plan: float | None = None
    last_plan: float | None = None
    first_sent: float | None = None
    last_sent: float | None = None
    events: int = 0
    coalesced: int = 0


class EngineLoop:
    """Steps the engine on the ideal timeline and hands each step's outputs to the requests."""

    def __init__(self, engine: Any, metrics: TwinMetrics):
        self.engine = engine
        self.metrics = metrics
        self.frontend = Frontend(float(getattr(engine.profile.coefficients, "frontend_token_s", 0.0)))
        # Steps whose tokens the modelled API server has not streamed yet: (due, result, start).
        self.streaming: deque[tuple[float, Any, float]] = deque()
        self.streamed = asyncio.Event()
        self.reqs: dict[str, _Req] = {}
        self.arrivals: deque[_Req] = deque()
        self.clock = 0.0
        self.wake = asyncio.Event()
        self.lags: deque[float] = deque(maxlen=GROUND_TRUTH_KEEP)
        self.truth: deque[dict] = deque(maxlen=GROUND_TRUTH_KEEP)
        self.steps = 0
        self._deferred: tuple[list, float, float] | None = None  # a step's outputs not handed out yet

    def submit(self, req: _Req) -> None:
        """Queue a request; the engine sees it once its clock reaches the arrival time."""
        self.reqs[req.rid] = req
        self.arrivals.append(req)
        self.wake.set()

    def abort(self, req: _Req) -> None:
        """The client went away: drop the request from the engine."""
        if req.finished:
            return
        req.finished = True
        req.finish_reason = "abort"
        if req in self.arrivals:
            self.arrivals.remove(req)
        else:
            self.engine.abort_request(req.rid)
        self.reqs.pop(req.rid, None)
        self.metrics.request_success["abort"].inc()

    def _admit(self) -> None:
        eng = self.engine
        while self.arrivals and self.arrivals[0].engine_arrival <= self.clock:
            r = self.arrivals.popleft()
            try:
                eng.add_request(EngineRequest(
                    request_id=r.rid, prompt_token_ids=r.prompt_ids, max_tokens=r.max_tokens,
                    min_tokens=r.min_tokens, ignore_eos=r.ignore_eos, eos_after=r.eos_after,
                    arrival_time=r.engine_arrival))
            except ValueError:  # the engine refused it (a duplicate id): end it as vLLM would
                r.finished = True
                r.finish_reason = "error"
                self.reqs.pop(r.rid, None)
                r.event.set()

    async def run(self) -> None:
        """The engine loop; runs until cancelled."""
        perf = time.perf_counter
        eng = self.engine
        while True:
            if not eng.has_unfinished_requests():
                if not self.arrivals:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                # An idle engine starts its next step when the request arrives.
                self.clock = max(self.clock, self.arrivals[0].engine_arrival)
            self._admit()
            start = self.clock
            result = eng.step(start)
            duration = result.duration_s
            if duration <= 0 and not result.outputs:
                duration = 0.0005  # nothing schedulable: wait a little for the world to change
            end = start + duration
            delay = end - perf()
            # Timers fire up to ~1 ms late (epoll/libuv resolution): sleep to just short of the
            # release, then yield to I/O until it is due. Always yield at least once, so
            # handlers can write even when the host is behind.
            if delay > SPIN_S:
                await asyncio.sleep(delay - SPIN_S)
            await asyncio.sleep(0)
            while perf() < end:
                await asyncio.sleep(0)
            lag = perf() - end
            self.clock = end
            tokens = sum(len(o.new_token_ids) for o in result.outputs)
            due = self.frontend.release(end, tokens)
            if due <= end and not self.streaming:
                self._release(result, start, end)
            else:
                self.streaming.append((due, result, start))
                self.streamed.set()
            self.steps += 1
            self.lags.append(lag)
            scheduled = getattr(result, "num_scheduled_tokens", None)
            if scheduled is None:
                scheduled = sum(len(o.new_token_ids) for o in result.outputs)
            self.metrics.observe_step(scheduled, max(0.0, lag))
            # Let the woken handlers write before the next step is computed: otherwise every
            # token waits for the engine's own CPU time and reaches clients late.
            await asyncio.sleep(0)

    async def stream(self) -> None:
        """Release steps the modelled API server is still streaming, each when it is due."""
        perf = time.perf_counter
        while True:
            if not self.streaming:
                self.streamed.clear()
                await self.streamed.wait()
                continue
            due, result, start = self.streaming[0]
            if due - perf() > SPIN_S:
                await asyncio.sleep(due - perf() - SPIN_S)
            while perf() < due:
                await asyncio.sleep(0)
            self.streaming.popleft()
            self._release(result, start, due)

    def _release(self, result: Any, start: float, end: float) -> None:
        # An earlier step's deferred part goes first: each request's tokens stay in order.
        self._release_deferred()
        outputs = result.outputs
        # Requests getting their first token are handed out first, and their handlers write
        # before the rest of the step is handed out: TTFT is the figure most sensitive to the
        # order in which the server works after a step. All of a step's tokens are due at once.
        firsts = [o for o in outputs if o.new_token_ids and (r := self.reqs.get(o.request_id))
                  and r.first_plan is None]
        if not firsts or len(firsts) == len(outputs):
            self._hand_out(outputs, start, end)
            return
        first_ids = {o.request_id for o in firsts}
        self._hand_out(firsts, start, end)
        self._deferred = ([o for o in outputs if o.request_id not in first_ids], start, end)
        # Queued after the woken handlers: they run (and write) before it.
        asyncio.get_running_loop().call_soon(self._release_deferred)

    def _release_deferred(self) -> None:
        if self._deferred is not None:
            outputs, start, end = self._deferred
            self._deferred = None
            self._hand_out(outputs, start, end)

    def _hand_out(self, outputs: list, start: float, end: float) -> None:
        """Give a step's outputs to their requests and wake their handlers."""
        m = self.metrics
        for out in outputs:
            r = self.reqs.get(out.request_id)
            if r is None:
                continue
            if r.sched_plan is None:
                queued = getattr(out, "queue_time_s", None)
                r.sched_plan = r.engine_arrival + queued if queued is not None else start
            if out.num_cached_tokens:
                r.num_cached = out.num_cached_tokens
            if out.new_token_ids:
                if r.first_plan is None:
                    r.first_plan = end
                    m.ttft.observe(end - r.arrival)
                else:
                    m.itl.observe(end - r.last_plan)
                r.last_plan = end
                r.pending.extend(out.new_token_ids)
                r.n_out += len(out.new_token_ids)
            if out.finished:
                r.finished = True
                r.finish_reason = out.finish_reason or "length"
                self.reqs.pop(r.rid, None)
                self._finish(r)
            r.event.set()

    def _finish(self, r: _Req) -> None:
        first = r.first_plan if r.first_plan is not None else r.last_plan or r.arrival
        last = r.last_plan if r.last_plan is not None else first
        sched = r.sched_plan if r.sched_plan is not None else r.arrival
        # vLLM's queue time ends when the request is first scheduled; prefill ends at the first token.
        self.metrics.observe_finished(
            r.finish_reason, e2e_s=last - r.arrival, queue_s=sched - r.engine_arrival,
            prefill_s=first - sched, decode_s=last - first, num_prompt=len(r.prompt_ids),
            num_cached=r.num_cached, num_generated=r.n_out)

    def record_truth(self, r: _Req) -> None:
        """Keep one finished request's ideal times next to when its bytes really went out."""
        if r.first_plan is None:
            return
        tpot = (r.last_plan - r.first_plan) / (r.n_out - 1) if r.n_out > 1 else None
        self.truth.append({
            "id": r.rid, "arrival_s": r.arrival, "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": r.n_out, "finish_reason": r.finish_reason,
            "ttft_s": r.first_plan - r.arrival, "tpot_s": tpot, "e2e_s": r.last_plan - r.arrival,
            "queue_s": (r.sched_plan or r.engine_arrival) - r.engine_arrival,
            "first_token_late_s": (r.first_sent - r.first_plan) if r.first_sent else None,
            "last_token_late_s": (r.last_sent - r.last_plan) if r.last_sent else None,
            "sse_events": r.events, "coalesced_tokens": r.coalesced})


# ---------------------------------------------------------------- the HTTP app

def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    """An OpenAI error body as vLLM sends it."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status, dumps=_compact)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UvicornAccessLogger(AbstractAccessLogger):
    """Access lines as uvicorn writes them under vLLM."""

    def log(self, request, response, time):
        peer = request.transport.get_extra_info("peername") if request.transport else None
        addr = f"{peer[0]}:{peer[1]}" if peer else "-"
        sys.stdout.write(f'INFO:     {addr} - "{request.method} {request.path_qs} HTTP/'
                         f'{request.version.major}.{request.version.minor}" {response.status} '
                         f'{response.reason}\n')

    @property
    def enabled(self) -> bool:
        return True


class TwinServer:
    """The OpenAI-compatible app around one engine loop."""

    def __init__(self, args: ServeArgs, engine: Any, tokenizer: TwinTokenizer,
                 max_model_len: int, metrics: TwinMetrics):
        self.args = args
        self.engine = engine
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.loop = EngineLoop(engine, metrics)
        names = args.flags.get("served-model-name") or [args.model]
        self.served_names = list(names)
        self.model_name = self.served_names[0]
        self.api_key = args.flags.get("api-key") or os.environ.get("VLLM_API_KEY")
        self.stream_interval = int(args.flags.get("stream-interval") or 1)
        self.seed = int(args.flags.get("seed") or 0)
        self.created = int(time.time())
        coeffs = getattr(getattr(engine, "profile", None), "coefficients", None)
        self.frontend_latency_s = float(getattr(coeffs, "frontend_latency_s", 0.0) or 0.0)

    def app(self) -> web.Application:
        """The aiohttp application with vLLM's routes."""
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/twin/ground_truth", self.ground_truth)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        # vLLM guards every /v1 route when --api-key is set, and answers with this bare body.
        if self.api_key and request.path.startswith("/v1"):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        data = []
        for name in self.served_names:
            data.append({
                "id": name, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.args.model, "parent": None, "max_model_len": self.max_model_len,
                "permission": [{
                    "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                    "created": self.created, "allow_create_engine": False,
                    "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None,
                    "is_blocking": False}]})
        return web.json_response({"object": "list", "data": data}, dumps=_compact)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.reset_prefix_cache()
        if ok is False:
            return _error(500, "Failed to reset prefix cache.", "InternalServerError")
        return web.Response(status=200)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def ground_truth(self, request: web.Request) -> web.Response:
        """The twin's own per-request times and step-release lag, for honest client checks."""
        lags = sorted(self.loop.lags)

        def q(p):
            return lags[min(len(lags) - 1, int(p * len(lags)))] if lags else 0.0

        since = float(request.query.get("since", "0") or 0)
        reqs = [t for t in self.loop.truth if t["arrival_s"] >= since]
        body = {"clock": "perf_counter of the server process", "now_s": time.perf_counter(),
                "steps": self.loop.steps,
                "lag_s": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
                          "max": lags[-1] if lags else 0.0},
                "coalesced_tokens": int(self.metrics.coalesced._value.get()),
                "requests": reqs}
        return web.Response(text=json.dumps(body), content_type="application/json")

    # ------------------------------------------------------------ generation

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _BadRequest(f"JSON decode error: {e}") from e
        if not isinstance(body, dict):
            raise _BadRequest("Input should be a valid dictionary or object to extract fields from")
        return body

    def _check_model(self, body: dict) -> web.Response | None:
        model = body.get("model")
        if model and model not in self.served_names:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return None

    def _sampling(self, body: dict, prompt_ids: list[int], default_max: int | None) -> dict:
        """max_tokens, min_tokens, ignore_eos with vLLM's checks and its context-length message."""
        n = body.get("n", 1)
        if n not in (None, 1):
            raise _BadRequest("The twin serves n=1 only.", "n")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens", default_max)
        min_tokens = int(body.get("min_tokens") or 0)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise _BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise _BadRequest(
                f"max_tokens={max_tokens} cannot be greater than "
                f"max_model_len={self.max_model_len}. Please request fewer output tokens.",
                "max_tokens")
        out = max_tokens or 0
        if len(prompt_ids) + out > self.max_model_len:
            total = len(prompt_ids) + out
            raise _BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {out} output tokens and your prompt contains "
                f"{len(prompt_ids)} input tokens, for a total of {total} tokens. Please reduce "
                f"the length of the input prompt or the number of requested output tokens. "
                f"(parameter=input_tokens, value={len(prompt_ids)})", "input_tokens")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        if min_tokens > max_tokens:
            raise _BadRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                              f"got {min_tokens}.", "min_tokens")
        ignore_eos = bool(body.get("ignore_eos", False))
        eos_after = None if ignore_eos else draw_eos_after(prompt_ids, self.seed, min_tokens,
                                                           max_tokens)
        return {"max_tokens": max_tokens, "min_tokens": min_tokens, "ignore_eos": ignore_eos,
                "eos_after": eos_after}

    def _new_req(self, rid: str, prompt_ids: list[int], params: dict, arrival: float) -> _Req:
        if rid in self.loop.reqs:  # a client reused its X-Request-Id: keep ids unique
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        req = _Req(rid=rid, arrival=arrival, prompt_ids=prompt_ids, **params,
                   engine_arrival=arrival + self.frontend_latency_s)
        self.metrics.observe_request_start(params["max_tokens"])
        self.loop.submit(req)
        return req

    def _request_id(self, request: web.Request, prefix: str) -> str:
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return f"{prefix}-{base}"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        try:
            body = await self._body(request)
            if (resp := self._check_model(body)) is not None:
                return resp
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                prompt_ids = self.tok.encode(prompt, add_special_tokens=True)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
                prompt_ids = list(prompt)
            else:
                raise _BadRequest("Either prompt or prompt_embeds must be provided and non-empty.",
                                  "prompt")
            params = self._sampling(body, prompt_ids, default_max=16)
        except _BadRequest as e:
            return _error(400, str(e), "BadRequestError", e.param)
        rid = self._request_id(request, "cmpl")
        req = self._new_req(rid, prompt_ids, params, arrival)
        if body.get("stream"):
            return await self._stream(request, req, body, chat=False)
        return await self._full(request, req, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        try:
            body = await self._body(request)
            if (resp := self._check_model(body)) is not None:
                return resp
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("messages must be a non-empty list.", "messages")
            flat = []
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # OpenAI content parts: keep the text ones
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                flat.append({"role": m.get("role", "user") if isinstance(m, dict) else "user",
                             "content": content or ""})
            prompt_ids = self.tok.encode_chat(flat)
            params = self._sampling(body, prompt_ids, default_max=None)
        except _BadRequest as e:
            return _error(400, str(e), "BadRequestError", e.param)
        rid = self._request_id(request, "chatcmpl")
        req = self._new_req(rid, prompt_ids, params, arrival)
        if body.get("stream"):
            return await self._stream(request, req, body, chat=True)
        return await self._full(request, req, chat=True)

    def _text(self, token_ids: list[int], start: int) -> str:
        return "".join(pseudo_word(t, start + i) for i, t in enumerate(token_ids))

    async def _wait_finished(self, request: web.Request, req: _Req) -> list[int]:
        tokens: list[int] = []
        try:
            while True:
                await req.event.wait()
                req.event.clear()
                tokens.extend(req.pending)
                req.pending = []
                if req.finished:
                    return tokens
        except asyncio.CancelledError:
            self.loop.abort(req)
            raise

    async def _full(self, request: web.Request, req: _Req, chat: bool) -> web.Response:
        tokens = await self._wait_finished(request, req)
        req.last_sent = time.perf_counter()  # one body: there is no separate first token
        req.events = 1
        self.loop.record_truth(req)
        text = self._text(tokens, 0)
        usage = {"prompt_tokens": len(req.prompt_ids),
                 "total_tokens": len(req.prompt_ids) + len(tokens),
                 "completion_tokens": len(tokens), "prompt_tokens_details": None}
        if chat:
            choice = {"index": 0,
                      "message": {"role": "assistant", "content": text, "refusal": None,
                                  "annotations": None, "audio": None, "function_call": None,
                                  "tool_calls": [], "reasoning": None},
                      "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": None,
                      "token_ids": None}
            body = {"id": req.rid, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": [choice], "service_tier": None,
                    "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                    "prompt_token_ids": None, "kv_transfer_params": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": req.finish_reason, "stop_reason": None, "token_ids": None,
                      "prompt_logprobs": None, "prompt_token_ids": None}
            body = {"id": req.rid, "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": [choice], "service_tier": None,
                    "system_fingerprint": None, "usage": usage, "kv_transfer_params": None}
        return web.json_response(body, dumps=_compact)

    async def _stream(self, request: web.Request, req: _Req, body: dict,
                      chat: bool) -> web.StreamResponse:
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        model_json = json.dumps(self.model_name)
        if chat:
            head = (f'data: {{"id":"{req.rid}","object":"chat.completion.chunk",'
                    f'"created":{created},"model":{model_json},"choices":[{{"index":0,')
        else:
            head = (f'data: {{"id":"{req.rid}","object":"text_completion",'
                    f'"created":{created},"model":{model_json},"choices":[{{"index":0,')
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        resp.enable_chunked_encoding()
        n_prompt = len(req.prompt_ids)
        interval = self.stream_interval
        coalesced = self.metrics.coalesced
        events = self.metrics.sse_events
        perf = time.perf_counter
        dumps = json.dumps
        sent = 0
        try:
            await resp.prepare(request)
            if chat:
                first = head + ('"delta":{"role":"assistant","content":""},"logprobs":null,'
                                '"finish_reason":null}]')
                if continuous:
                    first += f',"usage":{_usage(n_prompt, 0)}'
                await resp.write((first + "}\n\n").encode())
            while True:
                await req.event.wait()
                req.event.clear()
                if req.pending and (len(req.pending) >= interval or req.finished):
                    toks = req.pending
                    req.pending = []
                elif req.finished:
                    toks = []
                else:
                    continue
                text = self._text(toks, sent)
                sent += len(toks)
                fin = req.finish_reason if req.finished else None
                fin_json = f'"{fin}"' if fin else "null"
                if chat:
                    delta = f'"delta":{{"content":{dumps(text)}}}' if toks else '"delta":{}'
                    chunk = f'{head}{delta},"logprobs":null,"finish_reason":{fin_json}'
                    if fin:
                        chunk += ',"stop_reason":null,"token_ids":null'
                    chunk += "}]"
                else:
                    chunk = (f'{head}"text":{dumps(text)},"logprobs":null,"finish_reason":'
                             f'{fin_json},"stop_reason":null,"prompt_token_ids":null,'
                             f'"token_ids":null}}]')
                if continuous:
                    chunk += f',"usage":{_usage(n_prompt, sent)}'
                await resp.write((chunk + "}\n\n").encode())
                now = perf()
                if toks:
                    if req.first_sent is None:
                        req.first_sent = now
                    req.last_sent = now
                    req.events += 1
                    events.inc()
                    if len(toks) > interval:
                        req.coalesced += len(toks) - interval
                        coalesced.inc(len(toks) - interval)
                if req.finished:
                    break
            tail = ""
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                tail = (f'data: {{"id":"{req.rid}","object":"{obj}","created":{created},'
                        f'"model":{model_json},"choices":[],"usage":{_usage(n_prompt, sent)}}}\n\n')
            self.loop.record_truth(req)
            # The last event and the end of the chunked body in one write.
            await resp.write_eof((tail + "data: [DONE]\n\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            self.loop.abort(req)
            raise
        return resp


def _compact(obj: Any) -> str:
    # pydantic's model_dump_json, which vLLM uses, writes no spaces.
    return json.dumps(obj, separators=(",", ":"))


def _usage(prompt: int, completion: int) -> str:
    return (f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}}}')


# ---------------------------------------------------------------- start-up

def _engine_start_failure(err: Exception) -> None:
    """Print what vLLM prints when its engine core dies at start-up, then exit 1."""
    cause = getattr(err, "cause", "")
    message = getattr(err, "message", None) or str(err)
    if cause == "oom" and "OutOfMemoryError" not in message and "No available memory" not in message:
        final = f"torch.OutOfMemoryError: {message}"
    elif cause == "oom" and message.startswith("No available memory"):
        final = f"ValueError: {message}"
    elif ":" in message.split(" ", 1)[0]:
        final = message  # already "SomeError: ..."
    else:
        final = f"ValueError: {message}"
    where = "core.py:1071"
    _log("ERROR", where, "EngineCore failed to start.", proc="EngineCore", err=True)
    frame = ('  File "/usr/local/lib/python3.12/site-packages/vllm/v1/engine/core.py", line 1062,'
             " in run_engine_core")
    for line in ["Traceback (most recent call last):", frame, final]:
        _log("ERROR", where, line, proc="EngineCore", err=True)
    sys.stderr.write("Traceback (most recent call last):\n"
                     '  File "/usr/local/bin/vllm", line 10, in <module>\n'
                     "RuntimeError: Engine core initialization failed. See root cause above. "
                     "Failed core proc(s): {'EngineCore': 1}\n")
    sys.stderr.flush()
    sys.exit(1)


def _max_model_len(engine: Any, flags: dict[str, Any], model_shape: Any) -> int:
    for attr in ("max_model_len",):
        value = getattr(engine, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    cfg = getattr(engine, "config", None)
    value = getattr(cfg, "max_model_len", None)
    if isinstance(value, int) and value > 0:
        return value
    given = flags.get("max-model-len")
    if given and given > 0:
        return int(given)
    return int(getattr(model_shape, "max_position_embeddings", 8192))


def _load_profile(name: str) -> Any:
    """The profile, moved onto the lab's hardware preset when VLLM_TWIN_HARDWARE (JSON) is set."""
    from vllm_lab.twin.profile import load_profile, on_hardware

    profile = load_profile(name)
    hardware = os.environ.get("VLLM_TWIN_HARDWARE")
    return on_hardware(profile, json.loads(hardware)) if hardware else profile


def _cache_config(flags: dict[str, Any], stats: Any, max_model_len: int) -> dict[str, Any]:
    """The labels of vllm:cache_config_info: vLLM's CacheConfig fields as strings."""
    tokens = stats.num_gpu_blocks * stats.block_size
    return {
        "block_size": stats.block_size, "cache_dtype": flags.get("kv-cache-dtype", "auto"),
        "calculate_kv_scales": False, "cpu_offload_gb": flags.get("cpu-offload-gb", 0),
        "enable_prefix_caching": flags.get("enable-prefix-caching", True),
        "gpu_memory_utilization": flags.get("gpu-memory-utilization", 0.92),
        "is_attention_free": False,
        "kv_cache_max_concurrency": round(tokens / max_model_len, 2),
        "kv_cache_memory_bytes": flags.get("kv-cache-memory-bytes"),
        "kv_cache_size_tokens": tokens,
        "kv_offloading_backend": flags.get("kv-offloading-backend", "native"),
        "kv_offloading_size": flags.get("kv-offloading-size"),
        "num_cpu_blocks": None, "num_gpu_blocks": stats.num_gpu_blocks,
        "num_gpu_blocks_override": flags.get("num-gpu-blocks-override"),
        "prefix_caching_hash_algo": "sha256", "sliding_window": None,
    }


def _gpu_info(profile: Any, flags: dict[str, Any]) -> dict[str, Any]:
    hw = getattr(profile, "hardware", None) or getattr(profile, "gpu", None)
    name = getattr(hw, "name", None) if hw is not None else None
    if isinstance(hw, str):
        name = hw
    return {"name": name or "NVIDIA H200", "count": int(flags.get("tensor-parallel-size", 1)),
            "power_idle_w": float(getattr(hw, "power_idle_w", 75.0) or 75.0),
            "power_max_w": float(getattr(hw, "power_max_w", getattr(hw, "tdp_w", 700.0)) or 700.0)}


async def _serve(args: ServeArgs) -> None:
    from vllm_lab.models import load_model_shape

    flags = args.flags
    _log("INFO", "api_utils.py:273", f"vLLM API server version {VLLM_VERSION}")
    _log("INFO", "api_utils.py:273", f"non-default args: {_non_default(args)}")
    try:
        shape = load_model_shape(args.model)
    except ValueError as e:
        sys.stderr.write(f"OSError: {e}\n")
        sys.exit(1)
    try:
        profile = _load_profile(args.profile)
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"twin: cannot load profile {args.profile!r}: {e}\n")
        sys.exit(1)
    engine_flags = {k: v for k, v in flags.items() if k not in FRONTEND_FLAGS}
    try:
        engine = Engine.from_flags(engine_flags, profile, shape)
    except EngineStartError as e:
        await asyncio.sleep(min(args.startup_s, 1.0))
        _engine_start_failure(e)
    stats = engine.stats
    max_len = _max_model_len(engine, flags, shape)
    tokens = stats.num_gpu_blocks * stats.block_size
    await asyncio.sleep(args.startup_s)
    _log("INFO", "kv_cache_utils.py:2177", f"GPU KV cache size: {tokens:,} tokens",
         proc="EngineCore")
    _log("INFO", "kv_cache_utils.py:2179", f"Maximum concurrency for {max_len:,} tokens per "
         f"request: {tokens / max_len:.2f}x", proc="EngineCore")
    _log("INFO", "core.py:348", f"init engine (profile, create kv cache, warmup model) took "
         f"{args.startup_s:.2f} s", proc="EngineCore")
    tok = load_tokenizer(args.model, shape.vocab_size, flags.get("chat-template"))
    if not tok.exact:
        _log("INFO", "server.py:0", "twin: no tokenizer.json in the model folder; prompt token "
             "counts are approximated")
    names = flags.get("served-model-name") or [args.model]
    metrics = TwinMetrics(engine, names[0], max_len, _cache_config(flags, stats, max_len),
                          _gpu_info(profile, flags))
    server = TwinServer(args, engine, tok, max_len, metrics)
    runner = web.AppRunner(
        server.app(), handle_signals=False,
        access_log_class=UvicornAccessLogger,
        access_log=None if flags.get("disable-uvicorn-access-log") else _AccessSink())
    await runner.setup()
    host = flags.get("host") or "0.0.0.0"
    port = int(flags.get("port", 8000))
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        sys.stderr.write(f"OSError: [Errno {e.errno}] error while attempting to bind on address "
                         f"('{host}', {port}): {e.strerror}\n")
        sys.exit(1)
    engine_task = asyncio.create_task(server.loop.run())
    stream_task = asyncio.create_task(server.loop.stream())
    _log("INFO", "api_server.py:677", "Supported tasks: ['generate']")
    _log("INFO", "api_server.py:677", f"Starting vLLM server on http://{host}:{port}")
    _log("INFO", "launcher.py:37", "Available routes are:")
    for route in ("/health", "/metrics", "/version", "/v1/models", "/v1/completions",
                  "/v1/chat/completions", "/reset_prefix_cache", "/twin/ground_truth"):
        _log("INFO", "launcher.py:45", f"Route: {route}")
    sys.stdout.write(f"INFO:     Started server process [{os.getpid()}]\nINFO:     Waiting for "
                     "application startup.\nINFO:     Application startup complete.\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({waiter, engine_task, stream_task},
                                 return_when=asyncio.FIRST_COMPLETED)
    for task in (engine_task, stream_task):
        if task in done and task.exception() is not None:
            exc = task.exception()
            traceback.print_exception(type(exc), exc, exc.__traceback__)
            sys.exit(1)
    sys.stdout.write("INFO:     Shutting down\n")
    engine_task.cancel()
    stream_task.cancel()
    await runner.cleanup()


class _AccessSink:
    """aiohttp wants a logger object; the access logger class does the writing."""

    def info(self, *a, **k):
        pass


def _non_default(args: ServeArgs) -> dict[str, Any]:
    out = {"model_tag": args.model}
    out.update({k.replace("-", "_"): v for k, v in args.flags.items()
                if k != "api-key"})
    return out


def main(argv: list[str] | None = None) -> int:
    """`vllm-twin serve MODEL ...`: run the twin until SIGTERM/SIGINT."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_serve_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
