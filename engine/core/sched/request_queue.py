"""The WAITING queue: first come, first served, with preempted requests put back in front."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from engine.request import Request


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
