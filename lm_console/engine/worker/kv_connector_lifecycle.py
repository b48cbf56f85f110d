"""The ModelRunner's KV connector lifecycle around one step (after vLLM's KVConnectorModelRunnerMixin).

handle_preemptions -> bind metadata -> start_load_kv -> forward (per-layer wait_for_layer_load /
save_kv_layer inside the Attention layers) -> wait_for_save -> get_finished, load errors, stats,
events into a KVConnectorOutput -> clear metadata. Steps without a forward run the same
lifecycle (kv_connector_no_forward) so async loads still make progress and report.

A composed object of the ModelRunner; `NoKVConnectorLifecycle` (no connector configured) does
nothing at every hook, so the runner has one code path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput
from lm_console.engine.forward_context import ForwardContext

if TYPE_CHECKING:
    from lm_console.engine.scheduler_output import SchedulerOutput
    from lm_console.engine.distributed.kv_transfer.base import KVConnectorBase


class NoKVConnectorLifecycle:
    """The hooks when no KV connector is configured."""

    connector: KVConnectorBase | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any], num_kv_cache_groups: int) -> None:
        pass

    def begin(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def has_pending_layer_loads(self) -> bool:
        return False

    def finish(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        return None

    def shutdown(self) -> None:
        pass


class KVConnectorLifecycle:
    """Begin/finish halves of the connector lifecycle; the ModelRunner calls them around its forward."""

    def __init__(self, connector: KVConnectorBase) -> None:
        self.connector = connector

    def register_kv_caches(self, kv_caches: dict[str, Any], num_kv_cache_groups: int) -> None:
        """Hand the connector each attention layer's KV cache tensor, by layer name."""
        if num_kv_cache_groups > 1:
            raise NotImplementedError("KV connectors support models with one KV cache group "
                                      "(full attention or one sliding window), not hybrid ones")
        self.connector.register_kv_caches(kv_caches)

    def begin(self, scheduler_output: SchedulerOutput) -> None:
        connector = self.connector
        if scheduler_output.preempted_req_ids:
            connector.handle_preemptions(scheduler_output.preempted_req_ids)
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        forward_context = None if scheduler_output.is_empty else ForwardContext(None, kv_connector=connector)
        connector.start_load_kv(forward_context)

    def has_pending_layer_loads(self) -> bool:
        """Layers still to be loaded this step (a CUDA graph replay would skip their waits)."""
        return self.connector.has_pending_layer_loads()

    def finish(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        connector = self.connector
        try:
            connector.wait_for_save()
            finished_sending, finished_recving = connector.get_finished(scheduler_output.finished_req_ids)
            return KVConnectorOutput(
                finished_sending=finished_sending,
                finished_recving=finished_recving,
                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                kv_connector_stats=connector.get_kv_connector_stats(),
                kv_cache_events=connector.get_kv_connector_kv_cache_events(),
            )
        finally:
            connector.clear_connector_metadata()

    def shutdown(self) -> None:
        self.connector.shutdown()
