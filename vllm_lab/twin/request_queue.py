"""The engine's WAITING queue under each --scheduling-policy, as vLLM's
``vllm/v1/core/sched/request_queue.py`` keeps it.

``fcfs``: arrival order; a preempted request goes back to the front. ``priority``: the smallest
``(priority, arrival)`` first (a smaller value is served sooner), a preempted request taking its
place by that order again, not the front. Requests that carry no priority all have 0, so the two
policies then order alike.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Any

POLICIES = ("fcfs", "priority")


class FcfsQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._q: deque = deque()

    def push(self, r: Any) -> None:
        self._q.append(r)

    def push_front(self, r: Any) -> None:
        """A preempted request: it goes first again."""
        self._q.appendleft(r)

    def peek(self) -> Any:
        return self._q[0]

    def pop(self) -> Any:
        return self._q.popleft()

    def remove(self, r: Any) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator:
        return iter(self._q)


class PriorityQueue:
    """The smallest (priority, arrival, order taken in) first."""

    def __init__(self) -> None:
        self._heap: list = []
        self._n = 0

    def push(self, r: Any) -> None:
        self._n += 1
        heapq.heappush(self._heap, (r.priority, r.arrival, self._n, r))

    push_front = push  # no front in a priority queue: a preempted request takes its rank again

    def peek(self) -> Any:
        return self._heap[0][3]

    def pop(self) -> Any:
        return heapq.heappop(self._heap)[3]

    def remove(self, r: Any) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def request_queue(policy: str) -> FcfsQueue | PriorityQueue:
    """The WAITING queue of ``policy`` (one of ``POLICIES``)."""
    return PriorityQueue() if policy == "priority" else FcfsQueue()
