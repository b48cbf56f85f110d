"""The WAITING queue: first come, first served, or by priority (after vLLM's vllm/v1/core/sched/request_queue.py).

Both policies put preempted requests back so they resume first among their equals: FCFS in
front of the deque; priority by their (priority, arrival_time) key, which they keep.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from lm_console.engine.errors import InvalidEngineArgsError
from lm_console.engine.request import Request


class FCFSRequestQueue:
    """A deque of waiting requests; preempted requests are prepended so they resume first."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: set[Request]) -> None:
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A heap ordered by (priority, arrival_time): a lower value first, ties by arrival.

    prepend_request is add_request: a preempted request goes back under its own key (it keeps
    its arrival time, so it is ahead of every later arrival of its priority). Iteration is in
    scheduling order.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # a last tie-break, so Requests are never compared

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: set[Request]) -> None:
        self._heap = [entry for entry in self._heap if entry[3] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """The WAITING queue of a scheduling policy ("fcfs" | "priority")."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise InvalidEngineArgsError(f"scheduling_policy={policy!r} is unknown; allowed: 'fcfs', 'priority'.")
