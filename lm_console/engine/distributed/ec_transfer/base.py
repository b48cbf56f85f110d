"""ECConnectorBase: one class, two roles (after vLLM's ECConnectorBase).

The scheduler-role instance lives in the engine core's Scheduler and decides what to load;
the worker-role instance lives in the ModelRunner and moves the tensors. What the scheduler
decided reaches the worker as ECConnectorMetadata on the SchedulerOutput.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_console.engine.config.ec_transfer import ECTransferConfig
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput


class ECConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


class ECConnectorMetadata:  # noqa: B903 - a base for connector-specific payloads
    """What the scheduler role tells the worker role for one step."""


class ECConnectorBase(ABC):
    """Save encoder outputs (producer) and load them instead of computing (consumer)."""

    def __init__(self, config: ECTransferConfig, role: ECConnectorRole) -> None:
        self.config = config
        self.role = role
        self._connector_metadata: ECConnectorMetadata | None = None

    @property
    def is_producer(self) -> bool:
        return self.config.is_ec_producer

    @property
    def is_consumer(self) -> bool:
        return self.config.is_ec_consumer

    # -- worker role ---------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        """Set this step's metadata before start_load_caches (the model runner's connector lifecycle)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> ECConnectorMetadata:
        assert self._connector_metadata is not None, "bind_connector_metadata() was not called"
        return self._connector_metadata

    @abstractmethod
    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        """Put the outputs the metadata names into encoder_cache (consumer)."""

    def take_failed_loads(self) -> set[str]:
        """Identifiers start_load_caches could not load this step (the worker computes them)."""
        return set()

    @abstractmethod
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        """Store encoder_cache[mm_hash] where consumers can find it (producer)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) request ids of asynchronous transfers."""
        return None, None

    # -- scheduler role ------------------------------------------------------------------
    @abstractmethod
    def has_cache_item(self, identifier: str) -> bool:
        """Whether the connector can supply this item's encoder output (hot path: keep it fast)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """The scheduler reserved encoder-cache space for request.mm_features[index] to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's metadata for the worker; resets the per-step state."""

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Called when a request finishes; (delay freeing, transfer params)."""
        return False, None
