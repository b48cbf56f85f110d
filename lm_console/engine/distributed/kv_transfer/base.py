"""KVConnectorBase: the two-role plugin interface for moving decoder KV (after vLLM's KVConnectorBase_V1).

One class, two instances: the SCHEDULER-role instance lives beside the Scheduler and decides
what to load and save; the WORKER-role instance lives beside the ModelRunner and moves the
bytes. They talk only through KVConnectorMetadata (scheduler -> worker, inside SchedulerOutput)
and KVConnectorOutput (worker -> scheduler, inside ModelRunnerOutput). No torch import here:
the scheduler side stays torch-free.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.kv_cache_interface import AllocatedBlocks
    from lm_console.engine.config.kv_transfer import KVTransferConfig
    from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput
    from lm_console.engine.forward_context import ForwardContext
    from lm_console.engine.metrics.kv_events import KVCacheEvent
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput


class KVConnectorRole(enum.IntEnum):
    """Which side of the engine an instance serves (after vLLM's KVConnectorRole)."""

    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorMetadata:
    """What the scheduler-role connector tells the worker-role one for one step; subclassed per connector."""


def extend_tracked_block_ids(block_ids: dict[str, list[int]], scheduler_output: SchedulerOutput) -> None:
    """Append this step's new blocks (group 0) to the requests a scheduler-side connector tracks."""
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
        if new_block_ids is not None and req_id in block_ids:
            block_ids[req_id].extend(new_block_ids[0])


class KVConnectorBase(ABC):
    """Base of every KV connector (after vLLM's KVConnectorBase_V1).

    Scheduler side: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
    request_finished, take_events, update_connector_output.
    Worker side: register_kv_caches, start_load_kv, wait_for_layer_load, save_kv_layer,
    wait_for_save, get_finished, get_block_ids_with_load_errors, handle_preemptions.
    Layer-by-layer pipelining: start_load_kv() may start every layer's load at once; each
    attention layer calls wait_for_layer_load() before it reads its cache and save_kv_layer()
    after it wrote it, so loading layer i+1 overlaps computing layer i.
    """

    def __init__(self, config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig) -> None:
        self.config = config
        self.role = role
        self.kv_transfer_config = kv_transfer_config
        self._connector_metadata: KVConnectorMetadata | None = None
        self._events: list[KVCacheEvent] = []  # scheduler side: collected from the worker side
        self.latest_stats: Any = None  # scheduler side: the worker side's last stats

    # -- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Receive the per-layer paged KV tensors, keyed by layer name."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata | None) -> None:
        """Set this step's metadata before the forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop this step's metadata after the forward pass."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata | None:
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext | None) -> None:
        """Start loading the KV that this step's metadata asks for (before the forward)."""

    def has_pending_layer_loads(self) -> bool:
        """Whether this step's metadata loads during the forward (the runner must then run the
        layers eagerly, where the per-layer hooks are called, e.g. not replay a CUDA graph)."""
        return False

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer_name's KV is loaded (called inside that layer's forward)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Start saving layer_name's KV (called after that layer wrote its cache)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the paged KV blocks."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving): request ids whose async save/load ended."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call; their tokens must be recomputed."""
        return set()

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """The scheduler preempted these requests: stop touching their blocks."""

    def get_kv_connector_stats(self) -> Any:
        """Counters since the last call (None when there are none)."""
        return None

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent] | None:
        """KV cache events (BlockStored/BlockRemoved with the tier's medium) since the last call."""
        return None

    # -- scheduler side ---------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(N, is_async) external tokens beyond num_computed_tokens; (None, _) = ask again later."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: AllocatedBlocks, num_external_tokens: int) -> None:
        """The scheduler allocated the request's blocks; remember where external KV must land."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the worker side; resets the per-step state."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free, kv_transfer_params): delay_free keeps the blocks until get_finished reports the request."""
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the worker side's report (stats and events) for this step."""
        if connector_output.kv_cache_events:
            self._events.extend(connector_output.kv_cache_events)
        if connector_output.kv_connector_stats is not None:
            self.latest_stats = connector_output.kv_connector_stats

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV cache events collected from the worker side."""
        events, self._events = self._events, []
        return events

    # -- both -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop background threads and release resources (idempotent)."""
