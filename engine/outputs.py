"""RequestOutput and CompletionOutput: what the user gets back (vLLM-compatible fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Per-request timing (seconds since the epoch for *_time fields)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (index < n)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as seen by the user."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
