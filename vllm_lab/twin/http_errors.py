"""How the twin's HTTP API refuses and logs as vLLM does: the OpenAI error body of vLLM's serving
layer, its pydantic validation errors, FastAPI's answer to an unknown path, and uvicorn's access
lines."""

from __future__ import annotations

import json
import sys
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    """An OpenAI error body as vLLM sends it."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status, dumps=compact)


class BadRequest(Exception):
    """A request vLLM's serving layer refuses: 400, type "BadRequestError", the parameter named."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def response(self) -> web.Response:
        return error_response(400, str(self), "BadRequestError", self.param)


class Invalid(BadRequest):
    """A request vLLM's pydantic models refuse: FastAPI's validation error, re-shaped by vLLM's
    handler into the OpenAI error body with type "Bad Request"."""

    def __init__(self, message: str, param: str, body: Any):
        detail = {"type": "value_error", "loc": ("body",), "msg": f"Value error, {message}",
                  "input": body}
        super().__init__(f"1 validation error:\n  {detail!r}", param)

    def response(self) -> web.Response:
        return error_response(400, str(self), "Bad Request", self.param)


@web.middleware
async def fastapi_errors(request: web.Request, handler):
    """Unknown paths and methods answer as FastAPI does under vLLM: JSON ``{"detail": ...}``."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404, dumps=compact)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405, dumps=compact)


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


def vllm_value_error(message: str, parameter: str, value: Any) -> str:
    # vLLM's VLLMValidationError names the parameter and value after the sentence.
    return f"{message} (parameter={parameter}, value={value})"


def compact(obj: Any) -> str:
    # pydantic's model_dump_json, which vLLM uses, writes no spaces.
    return json.dumps(obj, separators=(",", ":"))


class AccessSink:
    """aiohttp wants a logger object; the access logger class does the writing."""

    def info(self, *a, **k):
        pass
