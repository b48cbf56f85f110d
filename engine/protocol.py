"""Structures that cross the frontend/engine-core boundary (seed: data flow, lines 18-140).

msgspec Structs (array_like, gc=False) so the multiprocess client can send them as msgpack;
the in-process client passes the same objects directly.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; an IntEnum so it travels as one small int."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A validated, tokenized request from the InputProcessor to the EngineCore."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None
    client_index: int = 0
    mm_features: list[Any] | None = None


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the tokens sampled for one request in one step (row 0: the sampled token)."""

    logprob_token_ids: list[list[int]]  # [num_tokens, k + 1]
    logprobs: list[list[float]]  # [num_tokens, k + 1]
    sampled_token_ranks: list[int]  # [num_tokens]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch of EngineCoreOutput for one client after one step, with stats."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Any = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    finished_requests: set[str] | None = None
