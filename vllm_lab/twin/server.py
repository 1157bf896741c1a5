"""The twin's server start-up: started like `vllm serve`, answering vLLM's OpenAI API and /metrics.

This module builds the engine from the parsed flags (``cli_args``), prints vLLM's start-up lines,
runs the engine loop (``engine_loop``) and the HTTP app (``http_api``) until SIGTERM/SIGINT. Tokens
that piled up for a request go out in one SSE event, as vLLM's --stream-interval would send them.
Each request's ground truth (its times on the ideal timeline) is served at /twin/ground_truth so
clients can check themselves.

    vllm-twin serve MODEL [--flag value ...] [--config cfg.yaml] [--host H] [--port P]
    python -m vllm_lab.twin.server serve MODEL ...
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import traceback
from typing import Any

from aiohttp import web

from vllm_lab import flags as flag_catalog
from vllm_lab.twin.cli_args import FRONTEND_FLAGS, ServeArgs, build_parser, parse_serve_args
from vllm_lab.twin.engine import Engine, EngineStartError
from vllm_lab.twin.engine_loop import EngineLoop, _Req
from vllm_lab.twin.http_api import VLLM_VERSION, TwinServer
from vllm_lab.twin.http_errors import AccessSink, UvicornAccessLogger
from vllm_lab.twin.metrics import TwinMetrics
from vllm_lab.twin.tokenizer import load_tokenizer
from vllm_lab.twin.vllm_log import log as _log

# Re-exported: tests and scripts import these from the server module.
__all__ = ["EngineLoop", "ServeArgs", "TwinServer", "_Req", "build_parser", "main",
           "parse_serve_args"]


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
    """The profile, moved onto the lab's hardware preset when VLLM_TWIN_HARDWARE (its JSON) is set."""
    from vllm_lab.hardware import Hardware
    from vllm_lab.twin.profile import load_profile, on_hardware

    profile = load_profile(name)
    hardware = Hardware.from_environment()
    return on_hardware(profile, hardware) if hardware else profile


def _cache_config(flags: dict[str, Any], stats: Any, max_model_len: int) -> dict[str, Any]:
    """The labels of vllm:cache_config_info: vLLM's CacheConfig fields as strings."""
    tokens = stats.num_gpu_blocks * stats.block_size

    def value(name: str) -> Any:
        return flags.get(name, flag_catalog.default(name))

    return {
        "block_size": stats.block_size, "cache_dtype": value("kv-cache-dtype"),
        "calculate_kv_scales": False, "cpu_offload_gb": value("cpu-offload-gb"),
        "enable_prefix_caching": value("enable-prefix-caching"),
        "gpu_memory_utilization": value("gpu-memory-utilization"),
        "is_attention_free": False,
        "kv_cache_max_concurrency": round(tokens / max_model_len, 2),
        "kv_cache_memory_bytes": value("kv-cache-memory-bytes"),
        "kv_cache_size_tokens": tokens,
        "kv_offloading_backend": value("kv-offloading-backend"),
        "kv_offloading_size": value("kv-offloading-size"),
        "num_cpu_blocks": None, "num_gpu_blocks": stats.num_gpu_blocks,
        "num_gpu_blocks_override": value("num-gpu-blocks-override"),
        "prefix_caching_hash_algo": "sha256", "sliding_window": None,
    }


def _gpu_info(profile: Any, flags: dict[str, Any]) -> dict[str, Any]:
    hw = getattr(profile, "hardware", None) or getattr(profile, "gpu", None)
    name = getattr(hw, "name", None) if hw is not None else None
    if isinstance(hw, str):
        name = hw
    return {"name": name or "NVIDIA H200", "count": int(flags.get("tensor-parallel-size", flag_catalog.default("tensor-parallel-size"))),
            "power_idle_w": float(getattr(hw, "power_idle_w", 75.0) or 75.0),
            "power_max_w": float(getattr(hw, "power_max_w", getattr(hw, "tdp_w", 700.0)) or 700.0)}


async def _serve(args: ServeArgs) -> None:
    """Start the engine and the HTTP app as vLLM does (and says), then serve until SIGTERM/SIGINT."""
    flags = args.flags
    _log("INFO", "api_utils.py:273", f"vLLM API server version {VLLM_VERSION}")
    _log("INFO", "api_utils.py:273", f"non-default args: {_non_default(args)}")
    engine, profile, shape = await _start_engine(args)
    engine.origin = time.perf_counter()  # its modelled energy counts from the server's start
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
    # vLLM's --tokenizer names the tokenizer's folder when it is not the model's own.
    tok_source = flags.get("tokenizer") or args.model
    tok = load_tokenizer(tok_source, shape.vocab_size, flags.get("chat-template"))
    if not tok.exact:
        _log("INFO", "server.py:0", f"twin: no tokenizer.json in {tok_source}; prompt token "
             "counts are approximated")
    names = flags.get("served-model-name") or [args.model]
    metrics = TwinMetrics(engine, names[0], max_len, _cache_config(flags, stats, max_len),
                          _gpu_info(profile, flags))
    server = TwinServer(args, engine, tok, max_len, metrics)
    runner = await _listen(server, flags)
    await _serve_until_stopped(server, runner)


async def _start_engine(args: ServeArgs) -> tuple[Engine, Any, Any]:
    """The engine for the flags, on the profile and the model's shape; exit 1 with vLLM's words
    when a model, a profile or the engine cannot start."""
    from vllm_lab.models import load_model_shape

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
    engine_flags = {k: v for k, v in args.flags.items() if k not in FRONTEND_FLAGS}
    try:
        return Engine.from_flags(engine_flags, profile, shape, os.environ), profile, shape
    except EngineStartError as e:
        await asyncio.sleep(min(args.startup_s, 1.0))
        _engine_start_failure(e)
        raise  # not reached: the failure exits


async def _listen(server: TwinServer, flags: dict[str, Any]) -> web.AppRunner:
    """The HTTP app bound to --host and --port (exit 1 as uvicorn says when the port is taken),
    and vLLM's lines that it is up."""
    runner = web.AppRunner(
        server.app(), handle_signals=False,
        # uvicorn under vLLM closes a connection idle this long (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
        keepalive_timeout=float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")),
        access_log_class=UvicornAccessLogger,
        access_log=None if flags.get("disable-uvicorn-access-log") else AccessSink())
    await runner.setup()
    host = flags.get("host") or "0.0.0.0"
    port = int(flags.get("port", flag_catalog.default("port")))
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        sys.stderr.write(f"OSError: [Errno {e.errno}] error while attempting to bind on address "
                         f"('{host}', {port}): {e.strerror}\n")
        sys.exit(1)
    _log("INFO", "api_server.py:677", "Supported tasks: ['generate']")
    _log("INFO", "api_server.py:677", f"Starting vLLM server on http://{host}:{port}")
    _log("INFO", "launcher.py:37", "Available routes are:")
    for route in ("/health", "/metrics", "/version", "/v1/models", "/v1/completions",
                  "/v1/chat/completions", "/tokenize", "/detokenize",
                  "/reset_prefix_cache", "/twin/ground_truth"):
        _log("INFO", "launcher.py:45", f"Route: {route}")
    sys.stdout.write(f"INFO:     Started server process [{os.getpid()}]\nINFO:     Waiting for "
                     "application startup.\nINFO:     Application startup complete.\n")
    sys.stdout.flush()
    return runner


async def _serve_until_stopped(server: TwinServer, runner: web.AppRunner) -> None:
    """Step the engine and stream its tokens until SIGTERM/SIGINT; a loop that fails exits 1."""
    engine_task = asyncio.create_task(server.loop.run())
    stream_task = asyncio.create_task(server.loop.stream())
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
