"""RequestBook: the console's own record of the requests it submitted (load generator and chat).

The engine streams only per-request outputs, so the request table's states come from here:
WAITING until the first token, RUNNING until the last, then FINISHED / ABORTED / FAILED for a
few seconds. Invariant: `active` holds exactly the requests whose stream has not ended.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from lm_console.client.types import RequestTimeline, StreamChunk

WAITING, RUNNING, FINISHED, ABORTED, FAILED = "WAITING", "RUNNING", "FINISHED", "ABORTED", "FAILED"
OUTPUT_TEXT_LIMIT = 8000  # characters of a request's output kept for the inspector


@dataclass(slots=True)
class TrackedRequest:
    """One submitted request as the console sees it."""

    request_id: str
    source: str  # "load" | "chat"
    arrival: float
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_cached: int = 0
    state: str = WAITING
    first_token_ts: float | None = None
    finished_ts: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None
    # The request inspector's data: what was asked and answered, and the engine core's view.
    prompt: str | list[int] | None = None
    output_text: str = ""
    timeline: RequestTimeline | None = None  # the engine's timestamps (else the console's, below)
    core_status: str | None = None  # the scheduler's state at the last poll (RUNNING, WAITING, PREEMPTED)
    num_preemptions: int = 0
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, at the last poll
    seen_preempted: list[float] = field(default_factory=list)  # console time a poll saw a new preemption

    @property
    def table_state(self) -> str:
        """The engine's state while it runs (PREEMPTED included), the console's once it ended."""
        return self.core_status if self.core_status and self.finished_ts is None else self.state
    priority: int = 0  # the request's scheduling priority (lower first; 0 unless the engine's policy is priority)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)

    def elapsed(self, now: float) -> float:
        return (self.finished_ts or now) - self.arrival


class RequestBook:
    """Tracks submitted requests; finished ones linger `linger_s` seconds in the table."""

    def __init__(self, linger_s: float = 5.0, max_samples: int = 500) -> None:
        self.linger_s = linger_s
        self.active: OrderedDict[str, TrackedRequest] = OrderedDict()
        self.done: deque[TrackedRequest] = deque(maxlen=64)
        self.ttft_samples: deque[float] = deque(maxlen=max_samples)
        self.tpot_samples: deque[float] = deque(maxlen=max_samples)
        self.num_finished = 0
        self.num_failed = 0

    def submit(self, request_id: str, source: str, now: float, num_prompt_tokens: int = 0,
               prompt: str | list[int] | None = None) -> TrackedRequest:
        request = TrackedRequest(request_id, source, now, num_prompt_tokens, prompt=prompt)
        self.active[request_id] = request
        return request

    def get(self, request_id: str) -> TrackedRequest | None:
        """An active or recently finished request."""
        return self.active.get(request_id) or next((r for r in self.done if r.request_id == request_id), None)

    def on_core_requests(self, state: Any, now: float) -> None:
        """Fold the engine core's RequestBlocksState (a poll) into the active requests."""
        seen = {row.request_id: row for row in state.requests}
        for request in self.active.values():
            row = seen.get(request.request_id)
            if row is None:
                continue
            if row.num_preemptions > request.num_preemptions:
                request.seen_preempted.extend([now] * (row.num_preemptions - request.num_preemptions))
            request.core_status = row.status
            request.lora_name = getattr(row, "lora_name", None) or request.lora_name
            request.num_preemptions = row.num_preemptions
            request.block_ids = [list(group) for group in row.block_ids]
            if row.num_cached_tokens > 0:
                request.num_cached = max(request.num_cached, row.num_cached_tokens)

    def on_chunk(self, chunk: StreamChunk, now: float) -> None:
        """Fold one stream chunk into its request."""
        request = self.active.get(chunk.request_id)
        if request is None:
            return
        if chunk.num_prompt_tokens:
            request.num_prompt_tokens = chunk.num_prompt_tokens
        request.num_cached = max(request.num_cached, chunk.num_cached_tokens)
        if chunk.timeline is not None:
            request.timeline = chunk.timeline
            request.num_preemptions = max(request.num_preemptions, len(chunk.timeline.preempted))
        if chunk.text and len(request.output_text) < OUTPUT_TEXT_LIMIT:
            request.output_text = (request.output_text + chunk.text)[:OUTPUT_TEXT_LIMIT]
        if chunk.num_new_tokens:
            request.num_generated += chunk.num_new_tokens
            if request.first_token_ts is None:
                request.first_token_ts = now
                request.ttft_s = chunk.ttft_s if chunk.ttft_s is not None else now - request.arrival
            request.state = RUNNING
        if chunk.finished:
            request.tpot_s = chunk.tpot_s
            if request.tpot_s is None and request.first_token_ts is not None and request.num_generated > 1:
                request.tpot_s = (now - request.first_token_ts) / (request.num_generated - 1)
            self._close(request, ABORTED if chunk.finish_reason == "abort" else FINISHED, now)

    def on_error(self, request_id: str, message: str, now: float) -> None:
        request = self.active.get(request_id)
        if request is not None:
            request.error = message
            self.num_failed += 1
            self._close(request, FAILED, now)

    def num_active(self, source: str | None = None) -> int:
        return sum(1 for r in self.active.values() if source is None or r.source == source)

    def rows(self, now: float, limit: int = 50) -> list[TrackedRequest]:
        """Active requests (oldest first), then recently finished ones (newest first)."""
        recent = [r for r in reversed(self.done) if now - (r.finished_ts or now) <= self.linger_s]
        return (list(self.active.values()) + recent)[:limit]

    def _close(self, request: TrackedRequest, state: str, now: float) -> None:
        request.state = state
        request.finished_ts = now
        self.active.pop(request.request_id, None)
        self.done.append(request)
        if state == FINISHED:
            self.num_finished += 1
            if request.ttft_s is not None:
                self.ttft_samples.append(request.ttft_s)
            if request.tpot_s is not None:
                self.tpot_samples.append(request.tpot_s)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
