"""The twin's HTTP API: vLLM's OpenAI-compatible routes and their SSE streams around one engine
loop, refusing as vLLM does (``http_errors``) and with vLLM's logprob shapes (``logprobs``)."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_lab import flags as flag_catalog
from vllm_lab.twin import logprobs
from vllm_lab.twin.cli_args import ServeArgs
from vllm_lab.twin.engine_loop import EngineLoop, _Req
from vllm_lab.twin.frontend import Frontend
from vllm_lab.twin.http_errors import (
    BadRequest,
    Invalid,
    compact,
    error_response,
    fastapi_errors,
    vllm_value_error,
)
from vllm_lab.twin.metrics import CONTENT_TYPE, TwinMetrics
from vllm_lab.twin.tokenizer import TwinTokenizer, draw_eos_after, pseudo_word
from vllm_lab.twin.vllm_log import log

VLLM_VERSION = flag_catalog.DEFAULT_VLLM_VERSION


class TwinServer:
    """The OpenAI-compatible app around one engine loop."""

    def __init__(self, args: ServeArgs, engine: Any, tokenizer: TwinTokenizer,
                 max_model_len: int, metrics: TwinMetrics):
        self.args = args
        self.engine = engine
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.loop = EngineLoop(engine, metrics, args.flags)
        names = args.flags.get("served-model-name") or [args.model]
        self.served_names = list(names)
        self.model_name = self.served_names[0]
        self.api_key = args.flags.get("api-key") or os.environ.get("VLLM_API_KEY")
        self.stream_interval = int(args.flags.get("stream-interval") or 1)
        self.seed = int(args.flags.get("seed") or 0)
        max_logprobs = args.flags.get("max-logprobs")
        self.max_logprobs = int(flag_catalog.FLAGS["max-logprobs"].default
                                if max_logprobs is None else max_logprobs)
        self.debug = args.flags.get("uvicorn-log-level") in ("debug", "trace")
        self.created = int(time.time())
        coeffs = getattr(getattr(engine, "profile", None), "coefficients", None)
        self.frontend_delay_s = Frontend.delay(coeffs) if coeffs is not None else 0.0
        self.faults = itertools.cycle(args.faults) if args.faults else None
        if args.faults:
            log("WARNING", "http_api.py:0", f"twin: --twin-fault {','.join(args.faults)}: "
                "completion and chat requests get these faults in turn")

    def _fault(self) -> str:
        """The fault --twin-fault deals the next generation request ("ok": none)."""
        return next(self.faults) if self.faults is not None else "ok"

    @staticmethod
    def _failed() -> web.Response:
        # vLLM's answer when its engine fails a request: an OpenAI error body with status 500.
        return error_response(500, "twin: injected fault (--twin-fault http500)",
                              "InternalServerError")

    def app(self) -> web.Application:
        """The aiohttp application with vLLM's routes."""
        app = web.Application(middlewares=[fastapi_errors, self._auth], client_max_size=64 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
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
        return web.json_response({"object": "list", "data": data}, dumps=compact)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.reset_prefix_cache()
        if ok is False:
            return error_response(500, "Failed to reset prefix cache.", "InternalServerError")
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

    # ------------------------------------------------------------ tokenizer routes

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt (completions form) or messages (chat form) to token ids."""
        try:
            body = await self._body(request)
            if (resp := self._check_model(body)) is not None:
                return resp
            if "messages" in body:
                ids = self.tok.encode_chat(_flatten(body.get("messages")),
                                           body.get("add_generation_prompt", True))
            elif isinstance(body.get("prompt"), str):
                ids = self.tok.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise Invalid("Either prompt (a string) or messages must be provided.", "prompt",
                               body)
        except BadRequest as e:
            return e.response()
        strs = [self.tok.token_str(t, i) for i, t in enumerate(ids)] \
            if body.get("return_token_strs") else None
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len,
                                  "tokens": ids, "token_strs": strs}, dumps=compact)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids back to text."""
        try:
            body = await self._body(request)
            if (resp := self._check_model(body)) is not None:
                return resp
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise Invalid("tokens must be a list of integers.", "tokens", body)
            if any(t < 0 or t >= self.tok.vocab_size for t in tokens):
                raise BadRequest(f"Token id out of vocabulary (size {self.tok.vocab_size}).",
                                  "tokens")
        except BadRequest as e:
            return e.response()
        return web.json_response({"prompt": self.tok.decode(tokens)}, dumps=compact)

    # ------------------------------------------------------------ generation

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"JSON decode error: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("Input should be a valid dictionary or object to extract fields from")
        return body

    def _check_model(self, body: dict) -> web.Response | None:
        model = body.get("model")
        if model and model not in self.served_names:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return None

    def _validate(self, body: dict, chat: bool) -> int:
        """vLLM's request checks before sampling; returns the logprobs asked for (-1: none).

        Its pydantic validators answer as a validation error (type "Bad Request"), SamplingParams'
        own checks as "BadRequestError"; both with status 400 and the parameter named.
        """
        if body.get("stream_options") and not body.get("stream"):
            raise Invalid("Stream options can only be defined when `stream=True`.",
                           "stream_options", body)
        if chat:
            top = body.get("top_logprobs")
            if top is not None and (not _is_int(top) or (top < 0 and top != -1)):
                raise Invalid("`top_logprobs` must be a positive value or -1.", "top_logprobs",
                               body)
            if top and not body.get("logprobs"):
                raise Invalid("when using `top_logprobs`, `logprobs` must be set to true.",
                               "top_logprobs", body)
            logprobs = (top or 0) if body.get("logprobs") else -1
            if top == -1 and body.get("logprobs"):
                logprobs = self.tok.vocab_size  # vLLM's -1: the whole vocabulary
        else:
            lp = body.get("logprobs")
            if lp is not None and (not _is_int(lp) or (lp < 0 and lp != -1)):
                raise Invalid("`logprobs` must be a positive value or -1.", "logprobs", body)
            logprobs = -1 if lp is None else (self.tok.vocab_size if lp == -1 else lp)
        n = body.get("n", 1)
        if n is not None and (not _is_int(n) or n < 1):
            raise BadRequest(vllm_value_error(f"n must be at least 1, got {n}.", "n", n), "n")
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and temperature < 0:
            value = float(temperature)
            raise BadRequest(vllm_value_error(
                f"temperature must be non-negative, got {value}.", "temperature", value),
                "temperature")
        top_p = body.get("top_p")
        if isinstance(top_p, (int, float)) and not 0 < top_p <= 1:
            value = float(top_p)
            raise BadRequest(vllm_value_error(
                f"top_p must be in (0, 1], got {value}.", "top_p", value), "top_p")
        if logprobs > self.max_logprobs >= 0:
            param = "top_logprobs" if chat else "logprobs"
            raise BadRequest(vllm_value_error(
                f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                f"{self.max_logprobs}", param, logprobs), param)
        return logprobs

    def _sampling(self, body: dict, prompt_ids: list[int], default_max: int | None,
                  choice: int = 0) -> dict:
        """max_tokens, min_tokens, ignore_eos with vLLM's checks and its context-length message;
        the request's priority (vLLM's extension: smaller is served sooner under
        --scheduling-policy priority, ignored under fcfs)."""
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens", default_max)
        min_tokens = int(body.get("min_tokens") or 0)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise BadRequest(
                f"max_tokens={max_tokens} cannot be greater than "
                f"max_model_len={self.max_model_len}. Please request fewer output tokens.",
                "max_tokens")
        out = max_tokens or 0
        if len(prompt_ids) + out > self.max_model_len:
            total = len(prompt_ids) + out
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {out} output tokens and your prompt contains "
                f"{len(prompt_ids)} input tokens, for a total of {total} tokens. Please reduce "
                f"the length of the input prompt or the number of requested output tokens. "
                f"(parameter=input_tokens, value={len(prompt_ids)})", "input_tokens")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        if min_tokens > max_tokens:
            raise BadRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                              f"got {min_tokens}.", "min_tokens")
        ignore_eos = bool(body.get("ignore_eos", False))
        # Each of n choices samples its own length; choice 0 keeps the single-choice draw.
        eos_after = None if ignore_eos else draw_eos_after(prompt_ids, self.seed + choice,
                                                           min_tokens, max_tokens)
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise BadRequest(f"priority must be an integer, got {priority!r}.", "priority")
        return {"max_tokens": max_tokens, "min_tokens": min_tokens, "ignore_eos": ignore_eos,
                "eos_after": eos_after, "priority": priority}

    def _new_req(self, rid: str, prompt_ids: list[int], params: dict, arrival: float,
                 chat: bool = False) -> _Req:
        if rid in self.loop.reqs:  # a client reused its X-Request-Id: keep ids unique
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        req = _Req(rid=rid, arrival=arrival, prompt_ids=prompt_ids, **params,
                   engine_arrival=self.loop.frontend.admit(arrival, chat, len(prompt_ids))
                   + self.frontend_delay_s)
        self.metrics.observe_request_start(params["max_tokens"])
        self.loop.submit(req)
        return req

    def _request_id(self, request: web.Request, prefix: str) -> str:
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return f"{prefix}-{base}"

    def _completion_prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """vLLM's prompt forms: a string, a list of strings, token ids, or a list of token-id lists."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                _is_int(t) for t in prompt)):
            prompt = [prompt]
        out: list[tuple[list[int], str | None]] = []
        if isinstance(prompt, list) and prompt:
            for p in prompt:
                if isinstance(p, str) and p:
                    out.append((self.tok.encode(p, add_special_tokens=True), p))
                elif isinstance(p, list) and p and all(_is_int(t) for t in p):
                    out.append((list(p), None))
                else:
                    out = []
                    break
        if not out:
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.",
                              "prompt")
        return out

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        try:
            body = await self._body(request)
            if (resp := self._check_model(body)) is not None:
                return resp
            logprobs = self._validate(body, chat=False)
            prompts = self._completion_prompts(body.get("prompt"))
            n = body.get("n") or 1
            plan = [(ids, text, self._sampling(body, ids, 16, i))
                    for ids, text in prompts for i in range(n)]
        except BadRequest as e:
            return e.response()
        if (fault := self._fault()) == "http500":
            return self._failed()
        rid = self._request_id(request, "cmpl")
        reqs = self._submit(rid, plan, arrival)
        echo = bool(body.get("echo"))
        choices = [_Choice(i, r, (self._prompt_text(ids, text) if echo else None),
                           ids if echo else None) for i, (r, (ids, text, _p)) in
                   enumerate(zip(reqs, plan))]
        prompt_tokens = sum(len(ids) for ids, _t in prompts)
        if body.get("stream"):
            return await self._stream(request, rid, choices, body, False, logprobs, prompt_tokens,
                                      fault)
        return await self._full(rid, choices, False, logprobs, prompt_tokens)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        try:
            body = await self._body(request)
            if (resp := self._check_model(body)) is not None:
                return resp
            logprobs = self._validate(body, chat=True)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list.", "messages")
            prompt_ids = self.tok.encode_chat(_flatten(messages))
            n = body.get("n") or 1
            plan = [(prompt_ids, None, self._sampling(body, prompt_ids, None, i))
                    for i in range(n)]
        except BadRequest as e:
            return e.response()
        if (fault := self._fault()) == "http500":
            return self._failed()
        rid = self._request_id(request, "chatcmpl")
        reqs = self._submit(rid, plan, arrival, chat=True)
        choices = [_Choice(i, r) for i, r in enumerate(reqs)]
        if body.get("stream"):
            return await self._stream(request, rid, choices, body, True, logprobs,
                                      len(prompt_ids), fault)
        return await self._full(rid, choices, True, logprobs, len(prompt_ids))

    def _submit(self, rid: str, plan: list, arrival: float, chat: bool = False) -> list[_Req]:
        # One engine request per choice, as vLLM fans n and prompt lists out; ids stay unique.
        if len(plan) == 1:
            return [self._new_req(rid, plan[0][0], plan[0][2], arrival, chat)]
        return [self._new_req(f"{rid}-{i}", ids, params, arrival, chat)
                for i, (ids, _text, params) in enumerate(plan)]

    def _prompt_text(self, ids: list[int], text: str | None) -> str:
        return text if text is not None else self.tok.decode(ids)

    def _text(self, token_ids: list[int], start: int) -> str:
        return "".join(pseudo_word(t, start + i) for i, t in enumerate(token_ids))

    async def _wait_finished(self, req: _Req) -> list[int]:
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

    def _logprobs(self, choice: _Choice, tokens: list[int], start: int, k: int, chat: bool,
                  offset: int) -> dict | None:
        """Synthetic logprobs in vLLM's shape: the sampled token is the likeliest of its top k."""
        if k < 0:
            return None
        entries = []
        if choice.echo_ids is not None and start == 0:  # echoed prompt tokens lead, the first unscored
            for i, t in enumerate(choice.echo_ids):
                entries.append((self.tok.token_str(t, i), t, i, i > 0))
        entries += [(pseudo_word(t, start + i), t, start + i, True) for i, t in enumerate(tokens)]
        return logprobs.shaped(entries, k, chat, offset)

    async def _full(self, rid: str, choices: list[_Choice], chat: bool, logprobs: int,
                    prompt_tokens: int) -> web.Response:
        if len(choices) == 1:
            outs = [await self._wait_finished(choices[0].req)]
        else:
            outs = await asyncio.gather(*(self._wait_finished(c.req) for c in choices))
        now = time.perf_counter()
        bodies = []
        completion_tokens = 0
        for c, tokens in zip(choices, outs):
            req = c.req
            req.last_sent = now  # one body: there is no separate first token
            req.events = 1
            self.loop.record_truth(req)
            completion_tokens += len(tokens)
            text = (c.echo or "") + self._text(tokens, 0)
            lp = self._logprobs(c, tokens, 0, logprobs, chat, 0)
            if chat:
                bodies.append({
                    "index": c.index,
                    "message": {"role": "assistant", "content": text, "refusal": None,
                                "annotations": None, "audio": None, "function_call": None,
                                "tool_calls": [], "reasoning": None},
                    "logprobs": lp, "finish_reason": req.finish_reason, "stop_reason": None,
                    "token_ids": None})
            else:
                bodies.append({"index": c.index, "text": text, "logprobs": lp,
                               "finish_reason": req.finish_reason, "stop_reason": None,
                               "token_ids": None, "prompt_logprobs": None,
                               "prompt_token_ids": None})
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                 "completion_tokens": completion_tokens, "prompt_tokens_details": None}
        if chat:
            body = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": bodies, "service_tier": None,
                    "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                    "prompt_token_ids": None, "kv_transfer_params": None}
        else:
            body = {"id": rid, "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": bodies, "service_tier": None,
                    "system_fingerprint": None, "usage": usage, "kv_transfer_params": None}
        return web.json_response(body, dumps=compact)

    async def _stream(self, request: web.Request, rid: str, choices: list[_Choice], body: dict,
                      chat: bool, logprobs: int, prompt_tokens: int,
                      fault: str = "ok") -> web.StreamResponse:
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        model_json = json.dumps(self.model_name)
        obj = "chat.completion.chunk" if chat else "text_completion"
        prefix = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                  f'"model":{model_json},"choices":[{{"index":')
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            # vLLM writes the chat role chunks in the first pass of its output loop, when the
            # engine's first output arrives (with the first token), not on receipt: a client that
            # stamps TTFT at the first chunk (vllm bench serve) reads the prefill as vLLM has it.
            role: list[bytes] = []
            if chat:
                role.append("".join(
                    f'{prefix}{c.index},"delta":{{"role":"assistant","content":""}},'
                    f'"logprobs":null,"finish_reason":null}}]'
                    + (f',"usage":{_usage(len(c.req.prompt_ids), 0)}' if continuous else "")
                    + "}\n\n" for c in choices).encode())
            args = (resp, prefix, chat, continuous, logprobs, role, fault)
            if len(choices) == 1:
                sent = [await self._stream_choice(choices[0], *args)]
            else:
                tasks = [asyncio.ensure_future(self._stream_choice(c, *args)) for c in choices]
                try:
                    sent = await asyncio.gather(*tasks)
                finally:
                    # One choice's failed write ends the response: stop the others and collect
                    # their outcomes, so none waits on its request forever or warns unretrieved.
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
            tail = ""
            if include_usage:
                tail = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                        f'"model":{model_json},"choices":[],'
                        f'"usage":{_usage(prompt_tokens, sum(sent))}}}\n\n')
            # The last event and the end of the chunked body in one write.
            await resp.write_eof((tail + "data: [DONE]\n\n").encode())
        except ConnectionResetError:
            # The client went away (it cancelled the stream): vLLM aborts the request and logs
            # nothing above debug; a traceback here would only be noise in the server's log.
            for c in choices:
                self.loop.abort(c.req)
            if self.debug:
                log("DEBUG", "http_api.py:0", f"client disconnected, request {rid} aborted")
        except _Broken:
            for c in choices:
                self.loop.abort(c.req)
            if request.transport is not None:
                request.transport.abort()
        except asyncio.CancelledError:
            for c in choices:
                self.loop.abort(c.req)
            raise
        return resp

    async def _stream_choice(self, c: _Choice, resp: web.StreamResponse, prefix: str, chat: bool,
                             continuous: bool, logprobs: int, role: list[bytes],
                             fault: str = "ok") -> int:
        """Stream one choice's tokens as they are handed out; returns how many were sent.

        ``role``: the chat role chunks not written yet; the first choice to write goes first.
        ``fault``: after the first token, an event that is not JSON (malformed) or _Broken."""
        req = c.req
        head = f"{prefix}{c.index},"
        n_prompt = len(req.prompt_ids)
        interval = self.stream_interval
        coalesced = self.metrics.coalesced
        events = self.metrics.sse_events
        perf = time.perf_counter
        dumps = json.dumps
        sent = 0
        offset = 0
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
            lp_json = "null"
            if logprobs >= 0 and (toks or (c.echo_ids and sent == 0)):
                lp_json = compact(self._logprobs(c, toks, sent, logprobs, chat, offset))
            if sent == 0 and c.echo is not None:
                text = c.echo + text
            offset += len(text)
            sent += len(toks)
            fin = req.finish_reason if req.finished else None
            fin_json = f'"{fin}"' if fin else "null"
            if chat:
                delta = f'"delta":{{"content":{dumps(text)}}}' if toks else '"delta":{}'
                chunk = f'{head}{delta},"logprobs":{lp_json},"finish_reason":{fin_json}'
                if fin:
                    chunk += ',"stop_reason":null,"token_ids":null'
                chunk += "}]"
            else:
                chunk = (f'{head}"text":{dumps(text)},"logprobs":{lp_json},"finish_reason":'
                         f'{fin_json},"stop_reason":null,"prompt_token_ids":null,'
                         f'"token_ids":null}}]')
            if continuous:
                chunk += f',"usage":{_usage(n_prompt, sent)}'
            data = (chunk + "}\n\n").encode()
            if role:
                data = role.pop() + data
            await resp.write(data)
            if toks and fault == "malformed":
                await resp.write(b'data: {"choices": [{"text": "\n\n')
                fault = "ok"  # once; the stream goes on
            elif toks and fault == "broken":
                raise _Broken
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
                self.loop.record_truth(req)
                return sent


class _Broken(Exception):
    """--twin-fault broken: the stream's connection is to be closed mid-reply."""


@dataclass
class _Choice:
    """One choice of a response: its index, its engine request and, with echo, its prompt."""

    index: int
    req: _Req
    echo: str | None = None
    echo_ids: list[int] | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flatten(messages: Any) -> list[dict]:
    """Chat messages as role and text: OpenAI content parts keep their text ones."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list.", "messages")
    flat = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        flat.append({"role": m.get("role", "user") if isinstance(m, dict) else "user",
                     "content": content or ""})
    return flat


def _usage(prompt: int, completion: int) -> str:
    return (f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
            f'"completion_tokens":{completion}}}')
