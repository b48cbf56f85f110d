"""Structures that cross the frontend/engine-core boundary (after vLLM's vllm/v1/engine/__init__.py).

msgspec Structs (array_like, gc=False) so the multiprocess client can send them as msgpack;
the in-process client passes the same objects directly. With array_like every field is on the
wire (omit_defaults has no effect), so defaults cost one byte each. Tensors in multimodal
requests travel as raw buffers in extra ZMQ frames (lm_console/engine/ipc.py); nothing is pickled.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from lm_console.engine.config.cache import CacheConfig
from lm_console.engine.config.device import DeviceConfig
from lm_console.engine.config.model import ModelConfig
from lm_console.engine.config.scheduler import SchedulerConfig
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.metrics.kv_events import KVEventBatch
from lm_console.engine.metrics.stats import SchedulerStats
from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec
from lm_console.engine.sampling_params import SamplingParams


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
    mm_features: list[MultiModalFeatureSpec] | None = None
    priority: int = 0  # scheduling_policy="priority": a lower value is scheduled first
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class EngineCoreRequestType(enum.IntEnum):
    """First frame of every message on the input socket (one byte)."""

    ADD = 0  # payload: list[EngineCoreRequest], admitted together before the next step
    ABORT = 1  # payload: list[str] of request ids
    UTILITY = 2  # payload: UtilityCall
    SHUTDOWN = 3  # payload: empty
    # Engine core -> frontend, once, at start-up (the handshake).
    READY = 16  # payload: EngineCoreReadyInfo
    STARTUP_FAILED = 17  # payload: EngineCoreStartupFailure

    def frame(self) -> bytes:
        return bytes((self.value,))


class EngineCoreEventType(enum.IntEnum):
    """A request's lifecycle event in the engine core (for queue time and preemptions)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """One lifecycle event with the core's time.time() timestamp."""

    type: EngineCoreEventType
    timestamp: float


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the tokens sampled for one request in one step (row 0: the sampled token)."""

    logprob_token_ids: list[list[int]]  # [num_tokens, k + 1]
    logprobs: list[list[float]]  # [num_tokens, k + 1]
    sampled_token_ranks: list[int]  # [num_tokens]


class RequestError(msgspec.Struct, array_like=True, gc=False):
    """Why the engine core refused a request: an engine.errors class name and its message."""

    exc_type: str
    message: str


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one step (error: the core refused it; it is finished)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, on the final output
    error: RequestError | None = None  # the core refused the request (finish_reason ABORT)
    # Prompt logprobs rows computed this step (row i: prompt token num_sent + i + 1); a partial
    # prefill sends them with no new token.
    new_prompt_logprobs: LogprobsLists | None = None
    # A pooling request's embedding (SamplingParams.pooling), with the step that completes its prompt.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """A frontend -> core method call (reset_prefix_cache, get_stats, ...)."""

    call_id: int
    client_index: int
    method: str
    args: list[Any] = []


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """The answer to one UtilityCall: msgpack of the result, or why it failed."""

    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the result (nil by default)
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch of EngineCoreOutput for one client after one step, with stats and events."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    finished_requests: set[str] | None = None
    utility_output: UtilityOutput | None = None
    kv_events: KVEventBatch | None = None  # this step's KV cache events (client 0 only)
    engine_dead_reason: str | None = None  # the core's last message before it exits on an error


class EngineCoreReadyInfo(msgspec.Struct, array_like=True, gc=False):
    """What the core tells the frontend at start-up: its resolved configs (the KV cache's
    num_blocks decided), so the frontend builds its EngineConfig without torch."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    kv_events_endpoint: str | None = None
    pid: int = 0
    kv_events_server_key: str | None = None  # z85 CURVE public key of a tcp KV-events PUB
    # The root of the core's prefix-cache hash chain (kv_cache_hashing.NONE_HASH), so that a
    # data-parallel frontend can compute a request's block hashes as this core does.
    none_hash: bytes | None = None


class EngineCoreStartupFailure(msgspec.Struct, array_like=True, gc=False):
    """Why the core could not start; the frontend re-raises it as the same exception type."""

    exc_type: str
    exc_module: str
    message: str
    traceback: str = ""
