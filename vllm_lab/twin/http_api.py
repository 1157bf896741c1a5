"""The twin's HTTP API: vLLM's OpenAI-compatible routes, its error bodies and its SSE streams,
around one engine loop."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
import uuid
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from vllm_lab import flags as flag_catalog
from vllm_lab.twin.cli_args import ServeArgs
from vllm_lab.twin.engine_loop import EngineLoop, _Req
from vllm_lab.twin.metrics import CONTENT_TYPE, TwinMetrics
from vllm_lab.twin.tokenizer import TwinTokenizer, draw_eos_after, pseudo_word

VLLM_VERSION = flag_catalog.DEFAULT_VLLM_VERSION


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


class _AccessSink:
    """aiohttp wants a logger object; the access logger class does the writing."""

    def info(self, *a, **k):
        pass
