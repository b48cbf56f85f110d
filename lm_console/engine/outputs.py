"""RequestOutput and CompletionOutput: what the user gets back (vLLM-compatible fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Per-request timing: seconds since the epoch for *_time fields, seconds for latencies.

    arrival_time is stamped by the InputProcessor, queued/first_scheduled by the engine core
    (EngineCoreEvents), the token and finish times by the OutputProcessor when outputs arrive.
    inter_token_latencies holds one gap per output after the first (one token each, normally).
    """

    arrival_time: float
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    preempted_times: list[float] = field(default_factory=list)  # one per preemption (engine core time)
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def scheduled_time(self) -> float | None:
        """When the engine core first scheduled the request."""
        return self.first_scheduled_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        """Time in the WAITING queue before the first scheduling."""
        if self.queued_time is None or self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.queued_time

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
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector (P/D), on the final output
    pooled: list[float] | None = None  # the prompt's embedding, for a pooling request (SamplingParams.pooling)

    def add(self, next_output: RequestOutput) -> None:
        """Merge a later DELTA output into this one (a slow consumer gets one combined delta)."""
        for completion in next_output.outputs:
            mine = next((c for c in self.outputs if c.index == completion.index), None)
            if mine is None:
                self.outputs.append(completion)
                continue
            mine.text += completion.text
            mine.token_ids = mine.token_ids + completion.token_ids
            if completion.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + completion.logprobs
            mine.cumulative_logprob = completion.cumulative_logprob
            mine.finish_reason = completion.finish_reason
            mine.stop_reason = completion.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        if next_output.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or []) + next_output.prompt_logprobs
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics
        self.kv_transfer_params = next_output.kv_transfer_params
        if next_output.pooled is not None:
            self.pooled = next_output.pooled


@dataclass
class EmbeddingOutput:
    """A prompt's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape: output.outputs.embedding)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        if output.pooled is None:
            raise ValueError(f"request {output.request_id} carries no embedding (it was not a pooling request).")
        return cls(output.request_id, list(output.prompt_token_ids), EmbeddingOutput(list(output.pooled)),
                   output.finished)
