"""ServerRequests: the request table of an attached lm-console server, from its `requests` frames.

The console stream sends the server's unfinished requests a few times a second (every client's,
not only this console's). A request that leaves a complete frame has finished; it lingers a few
seconds as FINISHED, like the console's own requests in RequestBook.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from lm_console.request_book import FINISHED, RUNNING, WAITING, TrackedRequest


class ServerRequests:
    """Same reading interface as RequestBook for the table: `active` and `rows(now)`."""

    def __init__(self, linger_s: float = 5.0) -> None:
        self.linger_s = linger_s
        self.active: OrderedDict[str, TrackedRequest] = OrderedDict()
        self.done: deque[TrackedRequest] = deque(maxlen=64)
        self.num_requests = 0  # unfinished on the server (the frame's rows may be fewer)
        self.num_frames = 0

    def update(self, frame: Any, now: float) -> None:
        """Fold one RequestsFrame (ts, num_requests, rows) into the table."""
        self.num_frames += 1
        self.num_requests = int(frame.num_requests)
        seen = set()
        for row in frame.rows:
            seen.add(row.request_id)
            request = self.active.get(row.request_id)
            if request is None:
                request = TrackedRequest(row.request_id, "server", float(row.arrival_time))
                self.active[row.request_id] = request
            request.num_prompt_tokens = int(row.num_prompt_tokens)
            request.num_generated = int(row.num_generated_tokens)
            request.num_cached = int(row.num_cached_tokens)
            request.priority = int(getattr(row, "priority", 0))
            request.lora_name = getattr(row, "lora_name", None)
            request.state = RUNNING if row.state == RUNNING else WAITING
            if row.first_token_time is not None:
                request.first_token_ts = float(row.first_token_time)
                request.ttft_s = request.first_token_ts - request.arrival
        complete = len(frame.rows) >= self.num_requests  # else missing rows were only cut off
        for request_id in [r for r in self.active if r not in seen]:
            request = self.active.pop(request_id)
            if complete:
                request.state = FINISHED
                request.finished_ts = now
                self.done.append(request)

    def rows(self, now: float, limit: int = 50) -> list[TrackedRequest]:
        """Unfinished requests (oldest first), then recently finished ones (newest first)."""
        recent = [r for r in reversed(self.done) if now - (r.finished_ts or now) <= self.linger_s]
        return (list(self.active.values()) + recent)[:limit]
