"""Reading one streamed OpenAI completion as its server-sent events come, and naming how a
request failed: the client side of a request, apart from the Locust user that sends it."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field

import gevent


class OverlongStream(Exception):
    """The server sent more tokens than the request allows: a stream that would never end."""


@dataclass
class Stream:
    """What a streamed completion has given so far: read line by line as it comes, so a failure
    half-way keeps what came before it."""

    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    last: float = 0.0
    reply: list[str] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    done: bool = False
    chunks: int = 0
    max_tokens: int | None = None  # what the request asked for, if it bounded the reply

    @property
    def limit(self) -> int | None:
        """Token chunks past which the stream is cut: a server never sends more than max_tokens
        (fewer when a chunk carries several); twice that, and more, means it is not going to stop."""
        return 2 * self.max_tokens + 16 if self.max_tokens else None

    def read(self, raw) -> None:
        # readline returns as soon as one SSE line is in; read(n) would wait for n bytes.
        while True:
            line = raw.readline(b"\n")
            if not line:
                return
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            now = time.perf_counter()
            self._chunk(json.loads(data), now)

    def _chunk(self, obj: dict, now: float) -> None:
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if not choices:
            return
        c = choices[0]
        # A chunk carries a token when it has text, even "": a token can decode to nothing yet
        # (dummy weights, a partial UTF-8 sequence). Chat's first chunk only names the role, and
        # an empty chunk that only says why the stream ends, carry none.
        delta = c.get("delta") or {}
        text = c.get("text") if "text" in c else delta.get("content")
        if text is not None and "role" not in delta and (text or not c.get("finish_reason")):
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
            self.reply.append(text)
            if self.limit is not None and self.chunks > self.limit:
                raise OverlongStream(f"the server sent over {self.limit} tokens and had not ended "
                                     "(max_tokens bounds a reply): the stream was cut")

    def verdict(self, error: str, detail: str) -> tuple[str, str]:
        """The request's error class and detail: the transport's, or what the stream lacked."""
        if not error and not self.done:
            return "broken_stream", "stream ended without [DONE]"
        n_out = self.usage.get("completion_tokens") if self.usage else None
        if not error and (self.chunks == 0 or n_out == 0):
            return "empty_output", detail
        return error, detail


def failure(e: BaseException, ttft: float | None, http_status: int) -> tuple[str, int]:
    """A failed request's error class and HTTP status."""
    code = getattr(e, "code", None) or getattr(getattr(e, "response", None), "status_code", 0)
    if isinstance(code, int) and code >= 400:
        return "http_error", code
    if ttft is None and not http_status and not isinstance(e, TimeoutError) \
            and "timeout" not in type(e).__name__.lower():
        return "http_error", http_status  # never connected or no status line: a transport failure
    return error_class(e), http_status


def error_class(exc: BaseException) -> str:
    name = type(exc).__name__.lower()
    if isinstance(exc, OverlongStream):
        return "overlong_stream"
    if isinstance(exc, (TimeoutError, socket.timeout, gevent.Timeout)) or "timeout" in name:
        return "timeout"
    return "broken_stream"
