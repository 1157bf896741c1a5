"""vLLM's API server as the twin models it: one process that streams every token it is handed.

The engine core does not wait for it, but clients see a step's tokens only once the API server has
spent ``frontend_token_s`` on each of them (detokenize, build the SSE chunk, write it). At high
token rates it falls behind and tokens, finishes and so the next closed-loop requests come late:
the fit to the H200's c128/c512 measurements needs this. The predictor and the twin's server both
use this one model, so they cannot drift apart.
"""

from __future__ import annotations


class Frontend:
    """A single-server FIFO queue with a fixed cost per streamed token."""

    def __init__(self, token_cost_s: float):
        self.token_cost_s = token_cost_s
        self.free_at = 0.0

    def release(self, ready_at: float, tokens: int) -> float:
        """When a step's ``tokens``, ready on the GPU at ``ready_at``, reach the clients."""
        if not self.token_cost_s:
            return ready_at
        self.free_at = max(self.free_at, ready_at) + tokens * self.token_cost_s
        return self.free_at
