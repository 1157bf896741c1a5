"""A small OpenAI-compatible streaming server with scripted, known timing, for tests and benchmarks
(a fixture, not part of the lab: scripts/bench_traffic.py imports it from here too).

Modes (the request's `model` name picks one, else `--mode`, or `--cycle` deals them in turn):
ok (first token after --ttft-ms, then one token every --itl-ms), broken (closes the connection
mid-stream), http500, stall (stops sending after a few tokens), empty (a stream with no content),
malformed (an event that is not JSON after a few tokens, then the stream goes on), endless (tokens
on the script's timing, never an end). With --close-idle-s a request that comes on a connection
idle that long finds it closing: the keep-alive race, every time.
The final usage chunk carries `script`, and --truth-log gets a line per request keyed by its
X-Request-Id: the server's perf_counter at receipt and at each content send, the ground truth a
client's measurement is compared with (same host, same monotonic clock).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web

MODES = ("ok", "broken", "http500", "stall", "empty", "malformed", "endless")


class Script:
    """The timing and failure script the server follows."""

    def __init__(self, args: argparse.Namespace):
        self.ttft = args.ttft_ms / 1000
        self.itl = args.itl_ms / 1000
        self.tokens = args.tokens
        self.mode = args.mode
        self.cycle = itertools.cycle(args.cycle.split(",")) if args.cycle else None
        self.fail_after = args.fail_after
        self.stall_s = args.stall_s
        self.precise = args.precise
        self.running = 0
        self.waiting = 0
        self.served = 0
        # A server of fixed capacity: beyond max_running, requests wait (and TTFT grows).
        self.slots = asyncio.Semaphore(args.max_running) if args.max_running else None
        self.truth = open(args.truth_log, "a", buffering=1) if args.truth_log else None  # noqa: SIM115

    def log_truth(self, request_id: str, recv: float, sent: list[float], done: float) -> None:
        """Append what really happened to one request (perf_counter times) to the truth log."""
        if self.truth is not None:
            row = {"request_id": request_id, "recv": recv, "sent": sent, "done": done}
            self.truth.write(json.dumps(row) + "\n")

    def pick(self, model: str) -> str:
        """Return the mode for one request."""
        if model in MODES:
            return model
        return next(self.cycle) if self.cycle else self.mode


async def _sleep_until(deadline: float, precise: bool) -> None:
    # asyncio wakes up to ~1 ms late (epoll's ms timeout); spin the last ms when precision matters.
    rest = deadline - time.perf_counter()
    if rest > 0.002 or not precise:
        await asyncio.sleep(max(0.0, rest - (0.0015 if precise else 0.0)))
    while precise and time.perf_counter() < deadline:
        pass


def _chunk(kind: str, rid: str, model: str, text: str | None, finish=None, usage=None) -> bytes:
    if kind == "chat":
        delta = {} if text is None else {"content": text}
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish}]
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [] if usage else choices}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _stream(request: web.Request, kind: str) -> web.StreamResponse:
    recv = time.perf_counter()
    script: Script = request.app["script"]
    req = await request.json()
    model = req.get("model", "scripted")
    mode = script.pick(model)
    script.served += 1
    if mode == "http500":
        return web.json_response({"error": {"message": "scripted failure", "code": 500}}, status=500)
    n = script.tokens or int(req.get("max_tokens") or 16)
    prompt = req.get("prompt") or " ".join(m.get("content") or "" for m in req.get("messages", []))
    prompt_tokens = len(str(prompt).split())
    rid = f"scripted-{script.served}"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if script.slots is None:
        return await _emit(request, resp, script, kind, rid, model, mode, n, prompt_tokens, recv)
    script.waiting += 1
    async with script.slots:
        script.waiting -= 1
        return await _emit(request, resp, script, kind, rid, model, mode, n, prompt_tokens, recv)


async def _emit(request, resp, script, kind, rid, model, mode, n, prompt_tokens, recv):
    """Stream one reply on the script's timing, counted from when the request got its slot."""
    begin = time.perf_counter() if script.slots is not None else recv
    script.running += 1
    sent: list[float] = []
    try:
        if kind == "chat":
            # vLLM's first chat chunk holds only the role: it must not count as the first token.
            await resp.write(_chunk(kind, rid, model, "").replace(
                b'"delta": {"content": ""}', b'"delta": {"role": "assistant", "content": ""}'))
        emitted = 0
        if mode != "empty":
            for k in (itertools.count() if mode == "endless" else range(n)):
                await _sleep_until(begin + script.ttft + k * script.itl, script.precise)
                if mode in ("broken", "stall") and k == script.fail_after:
                    if mode == "broken":
                        request.transport.abort()
                        return resp
                    await asyncio.sleep(script.stall_s)
                if mode == "malformed" and k == script.fail_after:
                    await resp.write(b'data: {"choices": [{"text": " tok"\n\n')
                sent.append(time.perf_counter())
                await resp.write(_chunk(kind, rid, model, " tok"))
                emitted += 1
        else:
            await _sleep_until(begin + script.ttft, script.precise)
        await resp.write(_chunk(kind, rid, model, None if kind == "chat" else "", "length"))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": emitted,
                 "total_tokens": prompt_tokens + emitted}
        final = _chunk(kind, rid, model, None, usage=usage)
        final = final[:-3] + b', "script": ' + json.dumps({"recv": recv, "sent": sent}).encode()
        await resp.write(final + b"}\n\n")
        done = time.perf_counter()  # the end of the stream leaves now, after the usage chunk
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        script.log_truth(request.headers.get("X-Request-Id", rid), recv, sent, done)
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        script.running -= 1
    return resp


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _stream(request, "completions")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _stream(request, "chat")


async def _metrics(request: web.Request) -> web.Response:
    s: Script = request.app["script"]
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="scripted"}} {s.running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="scripted"}} {s.waiting}\n'
        "# TYPE vllm:request_success counter\n"
        f'vllm:request_success_total{{model_name="scripted"}} {s.served}\n'
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0"}} {min(100, 10 * s.running)}\n'
    )
    return web.Response(text=text, content_type="text/plain")


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@web.middleware
async def _keep_alive_race(request: web.Request, handler):
    """A request on a connection idle for --close-idle-s meets it closing, unread, as one sent in
    the instant a server's keep-alive timeout closes the connection; the client gets no byte."""
    ends = request.app["idle_since"]
    last = ends.get(request.transport)
    if last is not None and time.perf_counter() - last >= request.app["close_idle_s"]:
        request.transport.abort()
        raise web.HTTPServiceUnavailable()  # never written: the connection is gone
    try:
        return await handler(request)
    finally:
        if request.transport is not None:
            ends[request.transport] = time.perf_counter()


def make_app(args: argparse.Namespace) -> web.Application:
    """Build the aiohttp application for a script."""
    app = web.Application(middlewares=[_keep_alive_race] if args.close_idle_s else [])
    app["idle_since"] = weakref.WeakKeyDictionary()
    app["close_idle_s"] = args.close_idle_s
    app["script"] = Script(args)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the server's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port, printed on stdout")
    p.add_argument("--ttft-ms", type=float, default=200.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=0, help="tokens per reply; 0: the max_tokens asked")
    p.add_argument("--mode", choices=MODES, default="ok")
    p.add_argument("--cycle", default="", help="comma-separated modes dealt to requests in turn")
    p.add_argument("--fail-after", type=int, default=3, help="broken/stall: tokens sent first")
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--processes", type=int, default=1, help="server processes on one socket")
    p.add_argument("--truth-log", default="", help="JSONL file of each request's real send times")
    p.add_argument("--max-running", type=int, default=0, help="capacity; 0: unlimited")
    p.add_argument("--close-idle-s", type=float, default=0.0,
                   help="a connection idle this long closes on the next request; 0: never")
    p.add_argument("--precise", action=argparse.BooleanOptionalAction, default=True,
                   help="spin the last ms before each send (exact timing, more CPU)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM; prints `port <n>` once listening."""
    args = parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(f"port {sock.getsockname()[1]}", flush=True)
    # Extra processes share the listening socket (the kernel spreads connections), so a
    # benchmark's server is not the bottleneck; all stay in the one process group.
    for _ in range(args.processes - 1):
        if os.fork() == 0:
            break
    web.run_app(make_app(args), sock=sock, print=None, handle_signals=True)


@contextlib.contextmanager
def running(*flags: str, wrap: tuple[str, ...] = ()) -> Iterator[str]:
    """Start the scripted server in its own process group; yield its base URL; stop it by pgid.

    `wrap` prefixes the command (e.g. ("taskset", "-c", "2-7") to keep it off the client's cores).
    """
    proc = subprocess.Popen(
        # Run by path: the child needs only aiohttp, not the tests package on its sys.path.
        [*wrap, sys.executable, str(Path(__file__).resolve()), *flags],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"scripted server did not start: {line!r}")
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    main()
