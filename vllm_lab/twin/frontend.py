"""vLLM's API server as the twin models it: processes that admit requests and stream their tokens.

Each API-server process is a single-server FIFO queue: a request waits behind the tokens its
process has still to stream. A request costs ``request_cost_s`` of its
process's time when it arrives (HTTP, the hand-off to the engine core), ``prompt_token_cost_s``
more per prompt token (tokenizing, validating and shipping it), a chat request
``chat_cost_s`` more (its chat template, its larger chunks), and each streamed token ``token_cost_s`` (detokenize, build the SSE chunk, write it). The engine
core does not wait for them, but it sees a request only once its process has admitted it, and
clients see a step's tokens only once the processes have streamed them: at high request or token
rates one process falls behind, and TTFT's tail grows while the engine's queue stays empty (what
the H200 showed on chat traffic at 36 req/s). ``--api-server-count N`` runs N processes: requests
go to them in turn and a step's tokens are shared among them. The predictor and the twin's server
both use this one model, so they cannot drift apart.
"""

from __future__ import annotations

# Cores an API-server process is busy, as the twin predicts it (``Prediction.api_server_cpu``),
# from which the twin's TTFT is least sure. Near that limit vLLM's run settles at the API server's
# limit or at the engine's by chance (reference/README.md, "Where the API server holds a
# request"), and the twin, which has no cost a request, keeps to the engine's. Held out on the
# H200 (``reference.by_api_load``): TTFT p50 off by a median of 46% at or past it, 11% below.
LIMIT_CPU = 0.6


class Frontend:
    """``servers`` FIFO queues with a cost per admitted request and per streamed token."""

    # Outputs vLLM's output loop processes before it yields to other tasks.
    OUTPUT_CHUNK = 128

    def __init__(self, token_cost_s: float, request_cost_s: float = 0.0, servers: int = 1,
                 chat_cost_s: float = 0.0, prompt_token_cost_s: float = 0.0,
                 delivery_share: float = 0.0, admission_hops: int = 1):
        self.token_cost_s, self.request_cost_s = token_cost_s, request_cost_s
        self.chat_cost_s, self.prompt_token_cost_s = chat_cost_s, prompt_token_cost_s
        self.delivery_share, self.admission_hops = delivery_share, max(1, int(admission_hops))
        self._last_ready = float("-inf")
        self.free = [0.0] * max(1, int(servers))
        self._turn = 0
        # Seconds of work the processes have been given, all together: what vLLM's API server
        # exports as process_cpu_seconds_total (one process; its threads' CPU included).
        self.busy_s = 0.0

    @property
    def processes(self) -> int:
        """API-server processes (``--api-server-count``)."""
        return len(self.free)

    @property
    def costs(self) -> bool:
        """Whether the processes cost anything (else every step's tokens go out as they are made)."""
        return bool(self.token_cost_s or self.request_cost_s or self.chat_cost_s
                    or self.prompt_token_cost_s)

    @property
    def free_at(self) -> float:
        """When every process has caught up."""
        return max(self.free)

    def admit(self, arrival: float, chat: bool = False, prompt_tokens: int = 0) -> float:
        """When a request that reached the server at ``arrival`` is handed to the engine core; a
        chat request also renders its chat template and streams larger chunks (``chat_cost_s``),
        and every request's prompt is tokenized and shipped (``prompt_token_cost_s`` a token).

        It waits behind the streaming its process is in the middle of, even when it costs nothing
        itself: one event loop serves both, and vLLM's output loop yields to other work only
        between chunks of ``OUTPUT_CHUNK`` outputs (VLLM_V1_OUTPUT_PROC_CHUNK_SIZE). A request
        crosses the loop ``admission_hops`` times before the engine core has it (its handler's
        tasks, the tokenizer's thread, the response stream that calls the engine: about 14 in
        vLLM 0.26 after its arrival time is stamped), each after at most one chunk's streaming.
        """
        cost = (self.request_cost_s + (self.chat_cost_s if chat else 0.0)
                + self.prompt_token_cost_s * prompt_tokens)
        if not (cost or self.token_cost_s):
            return arrival
        k, self._turn = self._turn, (self._turn + 1) % self.processes
        hop = self.OUTPUT_CHUNK * self.token_cost_s
        start = min(max(self.free[k], arrival), arrival + self.admission_hops * hop)
        if not cost:
            return start
        self.free[k] = max(self.free[k], start) + cost
        self.busy_s += cost
        return start + cost

    def release(self, ready_at: float, tokens: int) -> float:
        """When a step's ``tokens``, ready on the GPU at ``ready_at``, reach the clients."""
        if not self.costs:
            return ready_at
        gap, self._last_ready = ready_at - self._last_ready, ready_at
        per_token = self.token_cost_s * (1.0 - self.delivery_share)
        per_delivery = self.token_cost_s * self.delivery_share
        n = tokens / self.processes
        free = []
        for f in self.free:
            # Steps still waiting for this process when this one is ready: their tokens and this
            # step's go out together, one SSE chunk a request (vLLM's RequestOutputCollector
            # merges a stream's outputs its consumer has not taken yet).
            waiting = 1.0 + max(0.0, f - ready_at) / gap if gap > 0 else 1.0
            work = n * (per_token + per_delivery / waiting)
            self.busy_s += work
            free.append(max(f, ready_at) + work)
        self.free = free
        return max(self.free)

    @classmethod
    def of(cls, coefficients, flags: dict) -> Frontend:
        """The API server a profile's coefficients and the serve flags describe."""
        return cls(float(getattr(coefficients, "frontend_token_s", 0.0) or 0.0),
                   float(getattr(coefficients, "frontend_request_s", 0.0) or 0.0),
                   int(flags.get("api-server-count") or 1),
                   float(getattr(coefficients, "frontend_chat_s", 0.0) or 0.0),
                   float(getattr(coefficients, "frontend_prompt_token_s", 0.0) or 0.0),
                   float(getattr(coefficients, "frontend_delivery_share", 0.0) or 0.0),
                   int(getattr(coefficients, "frontend_admission_hops", 1) or 1))

    @staticmethod
    def delay(coefficients) -> float:
        """The rest of a request's way to the engine core, which occupies no API-server process."""
        return max(0.0, float(coefficients.frontend_latency_s)
                   - float(getattr(coefficients, "frontend_request_s", 0.0) or 0.0))
