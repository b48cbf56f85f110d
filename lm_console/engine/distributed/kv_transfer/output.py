"""KVConnectorOutput: the worker-side connector's report for one step (after vLLM's KVConnectorOutput).

A plain dataclass: it rides inside ModelRunnerOutput within the engine-core process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class KVConnectorOutput:
    """finished_sending / finished_recving: request ids whose async save / load ended (failed or
    not); invalid_block_ids: blocks whose load failed (to recompute); kv_connector_stats and
    kv_cache_events: the connector's counters and KV events since the last step."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_stats: Any = None
    kv_cache_events: list[Any] | None = None

    def is_empty(self) -> bool:
        return (not self.finished_sending and not self.finished_recving and not self.invalid_block_ids
                and self.kv_connector_stats is None and not self.kv_cache_events)
