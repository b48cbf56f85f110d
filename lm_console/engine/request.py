"""Request and RequestStatus: the engine-core view of one request (after vLLM's vllm/v1/request.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec
from lm_console.engine.protocol import EngineCoreEvent

if TYPE_CHECKING:
    from lm_console.engine.kv_cache_hashing import BlockHash
    from lm_console.engine.lora.request import LoRARequest
    from lm_console.engine.protocol import EngineCoreEventType
    from lm_console.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status above PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its structured-output grammar is being compiled
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASONS.get(status)


class StructuredOutputState(Protocol):
    """What the scheduler asks of a structured request's grammar state.

    The structured-output subsystem's StructuredOutputRequest implements it; this boundary type
    names only the protocol, so importing it loads nothing of that subsystem.
    """

    grammar: Any  # the compiled grammar, once ready (backend-specific)
    error: tuple[str, str] | None  # why it did not compile: (error class name, message)

    def is_grammar_ready(self) -> bool:
        """Whether compilation has ended (a grammar or an error)."""
        ...

    def accept_token(self, token_id: int) -> tuple[RequestStatus, tuple[str, str] | None] | None:
        """Advance the grammar over one sampled token; a (status, error) pair ends the request."""
        ...


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


@dataclass(eq=False)
class Request:
    """A request inside the engine core.

    Invariants: all_token_ids == prompt_token_ids + output_token_ids;
    num_computed_tokens <= num_tokens; block_hashes cover the full blocks of all_token_ids
    (kept up to date by the request block hasher on every appended token).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.time)
    client_index: int = 0
    cache_salt: str | None = None
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    block_hasher: Callable[[Request], list[BlockHash]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0  # scheduling_policy="priority": a lower value is scheduled first
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    def __post_init__(self) -> None:
        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens scheduled to be sampled by steps still in flight (their ids are
        # not known yet); num_computed_tokens counts them, num_tokens does not.
        self.num_output_placeholders = 0
        # Tokens found in the prefix cache at first scheduling (reported to the user).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0  # prompt-logprob rows already in an output (scheduler)
        self.stop_reason: int | str | None = None
        self.max_tokens = self.sampling_params.max_tokens
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()
        # Lifecycle events (QUEUED, SCHEDULED, PREEMPTED) not yet sent to the frontend.
        self.events: list[EngineCoreEvent] = []
        # Constrained decoding: its grammar and matcher (set by the StructuredOutputManager).
        self.structured_output_request: StructuredOutputState | None = None
        # Why the engine core failed the request (a grammar that does not compile): the
        # engine.errors class name and its message, sent on the request's final output.
        self.error: tuple[str, str] | None = None

    # -- token bookkeeping -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend block_hashes with the blocks that became full (incremental hasher)."""
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    # -- events ------------------------------------------------------------------------
    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Remember a lifecycle event; it rides on the request's next EngineCoreOutput."""
        self.events.append(EngineCoreEvent(event_type, time.time() if timestamp is None else timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """Drain the recorded events (None when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    # -- status ------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)
