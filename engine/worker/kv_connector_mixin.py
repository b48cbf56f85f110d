"""The ModelRunner's KV connector lifecycle around one step (seed: KVConnectorModelRunnerMixin, lines 3360-3420).

handle_preemptions -> bind metadata -> start_load_kv -> forward (per-layer wait_for_layer_load /
save_kv_layer inside the Attention layers) -> wait_for_save -> get_finished, load errors, stats,
events into a KVConnectorOutput -> clear metadata. Steps without a forward run the same
lifecycle (kv_connector_no_forward) so async loads still make progress and report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.distributed.kv_transfer.output import KVConnectorOutput
from engine.forward_context import ForwardContext

if TYPE_CHECKING:
    from engine.distributed.kv_transfer.base import KVConnectorBase
    from engine.scheduler_output import SchedulerOutput


class KVConnectorModelRunnerMixin:
    """Begin/finish halves of the connector lifecycle; the ModelRunner calls them around its forward."""

    kv_connector: KVConnectorBase | None

    def _kv_connector_begin(self, scheduler_output: SchedulerOutput) -> None:
        connector = self.kv_connector
        assert connector is not None
        if scheduler_output.preempted_req_ids:
            connector.handle_preemptions(scheduler_output.preempted_req_ids)
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        forward_context = None if scheduler_output.is_empty else ForwardContext(None, connector)
        connector.start_load_kv(forward_context)

    def _kv_connector_finish(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        connector = self.kv_connector
        assert connector is not None
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
