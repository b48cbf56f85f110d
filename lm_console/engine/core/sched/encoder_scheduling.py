"""Encoder scheduling inside the token budget (after vLLM's Scheduler._try_schedule_encoder_inputs).

A composed object of the Scheduler, called at four points: try_schedule() before it allocates a
request's KV slots (which encoder inputs must run for the tokens it is about to schedule, and how
many tokens it may schedule at all), commit() once the allocation succeeded, finish_step() to put
the step's encoder work on the SchedulerOutput, and free()/free_consumed() as requests finish, get
preempted or move past their images. Text-only models get `NoEncoderScheduler`, whose hooks do
nothing, so the Scheduler has one code path. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lm_console.engine.core.encoder_cache_manager import EncoderCacheManager, compute_mm_encoder_budget
from lm_console.engine.errors import TooManyMultiModalItemsError
from lm_console.engine.metrics.stats import EncoderCacheStats

if TYPE_CHECKING:
    from lm_console.engine.distributed.ec_transfer.base import ECConnectorBase
    from lm_console.engine.request import Request
    from lm_console.engine.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class EncoderPlan:
    """try_schedule()'s answer for one request."""

    num_new_tokens: int
    compute: list[int] = field(default_factory=list)  # input ids to encode this step
    external: list[int] = field(default_factory=list)  # input ids the ECConnector loads
    num_compute_embeds: int = 0
    num_reserved_embeds: int = 0  # compute + external: cache space this plan takes
    identifiers: set[str] = field(default_factory=set)


class EncoderScheduler:
    """Encoder compute budget per step + the EncoderCacheManager + an optional ECConnector."""

    def __init__(self, max_num_encoder_input_tokens: int, encoder_cache_size: int, max_tokens_per_mm_item: int,
                 max_num_batched_tokens: int, disable_chunked_mm_input: bool = False,
                 ec_connector: ECConnectorBase | None = None) -> None:
        self.max_encoder_compute_budget, cache_size = compute_mm_encoder_budget(
            max_num_encoder_input_tokens, encoder_cache_size, max_tokens_per_mm_item)
        self.encoder_cache_manager = EncoderCacheManager(cache_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.disable_chunked_mm_input = disable_chunked_mm_input
        self.ec_connector = ec_connector
        self.encoder_compute_budget = self.max_encoder_compute_budget
        self.scheduled_encoder_inputs: dict[str, list[int]] = {}

    # -- admission ------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Reject a request that could never be scheduled (an item too big for the cache)."""
        limit = min(self.max_encoder_compute_budget, self.encoder_cache_manager.cache_size)
        for feature in request.mm_features:
            if feature.num_embeds > limit:
                raise TooManyMultiModalItemsError(
                    f"an image of request {request.request_id} needs {feature.num_embeds} encoder embeddings, "
                    f"more than the encoder cache holds ({limit}); raise encoder_cache_size and "
                    "max_num_encoder_input_tokens or send a smaller image.")
            if self.disable_chunked_mm_input and feature.length > self.max_num_batched_tokens:
                raise TooManyMultiModalItemsError(
                    f"an image of request {request.request_id} spans {feature.length} tokens, more than "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}, and it may not be split (the "
                    "model attends bidirectionally within an image, or disable_chunked_mm_input is set); "
                    "raise max_num_batched_tokens.")

    # -- per step -------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.encoder_compute_budget = self.max_encoder_compute_budget
        self.scheduled_encoder_inputs = {}

    def try_schedule(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> EncoderPlan | None:
        """Which items must be encoded (or loaded) for tokens [computed, computed + new), and
        the number of tokens that can be scheduled (cut before an item that cannot run).
        None for a request without multimodal inputs: it schedules num_new_tokens as asked."""
        if not request.mm_features:
            return None
        plan = EncoderPlan(num_new_tokens)
        manager = self.encoder_cache_manager
        end = num_computed_tokens + num_new_tokens
        for i, feature in enumerate(request.mm_features):
            start_pos, num_tokens = feature.offset, feature.length
            if start_pos >= end:
                break  # this item (and every later one) lies beyond this step's tokens
            if start_pos + num_tokens <= num_computed_tokens:
                continue  # already in the KV cache
            if self.disable_chunked_mm_input and start_pos + num_tokens > end:
                # The chunk would end inside the item: stop before it (or, when a prefix-cache hit
                # ended inside it, schedule nothing until its remaining tokens fit in one chunk).
                plan.num_new_tokens = max(start_pos - num_computed_tokens, 0)
                break
            if feature.identifier in plan.identifiers:
                continue  # the same image twice in one prompt: encode it once
            if manager.check_and_update_cache(request, i):
                continue  # computed before (possibly earlier this step, for another request)
            external = self.ec_connector is not None and self.ec_connector.has_cache_item(feature.identifier)
            budget = self.encoder_compute_budget - plan.num_compute_embeds
            if not manager.can_allocate(request, i, 1 << 62 if external else budget, plan.num_reserved_embeds):
                # No room this step: compute only the text before the item.
                plan.num_new_tokens = max(start_pos - num_computed_tokens, 0)
                break
            plan.identifiers.add(feature.identifier)
            plan.num_reserved_embeds += feature.num_embeds
            if external:
                plan.external.append(i)
            else:
                plan.compute.append(i)
                plan.num_compute_embeds += feature.num_embeds
        return plan

    def commit(self, request: Request, plan: EncoderPlan | None) -> None:
        """The request was scheduled: reserve its items' cache space, spend the budget."""
        if plan is None:
            return
        manager = self.encoder_cache_manager
        for i in plan.compute:
            manager.allocate(request, i)
            manager.counters.num_encoder_runs += 1
        for i in plan.external:
            manager.allocate(request, i)
            manager.counters.num_external_loads += 1
            assert self.ec_connector is not None
            self.ec_connector.update_state_after_alloc(request, i)
        if plan.compute:
            self.scheduled_encoder_inputs[request.request_id] = list(plan.compute)
            self.encoder_compute_budget -= plan.num_compute_embeds

    def finish_step(self, scheduler_output: SchedulerOutput) -> None:
        """Put the step's encoder work, evictions and connector metadata on the output."""
        scheduler_output.scheduled_encoder_inputs = self.scheduled_encoder_inputs
        scheduler_output.free_encoder_mm_hashes = self.encoder_cache_manager.get_freed_mm_hashes()
        if self.ec_connector is not None:
            scheduler_output.ec_connector_metadata = self.ec_connector.build_connector_meta(scheduler_output)

    # -- releasing ------------------------------------------------------------------------
    def free_consumed(self, request: Request) -> None:
        """Drop references to items whose tokens are all in the KV cache now (after vLLM's _free_encoder_inputs)."""
        manager = self.encoder_cache_manager
        for i, feature in enumerate(request.mm_features):
            if feature.offset + feature.length > request.num_computed_tokens:
                break
            manager.free_encoder_input(request, i)

    def free(self, request: Request) -> None:
        self.encoder_cache_manager.free(request)

    # -- stats ----------------------------------------------------------------------------
    def make_stats(self) -> EncoderCacheStats:
        manager = self.encoder_cache_manager
        counters = manager.counters
        return EncoderCacheStats(
            num_entries=len(manager.cached), num_slots=manager.cache_size,
            num_used_slots=manager.num_used_slots, num_freeable_slots=manager.num_freeable_only_slots,
            num_free_slots=manager.num_free_slots, num_lookups=counters.num_lookups,
            num_hits=counters.num_hits, num_encoder_runs=counters.num_encoder_runs,
            num_external_loads=counters.num_external_loads, num_evictions=counters.num_evictions)


class NoEncoderScheduler:
    """The encoder hooks of a text-only model: no encoder budget, no encoder cache, nothing to do."""

    def validate(self, request: Request) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def try_schedule(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> EncoderPlan | None:
        return None

    def commit(self, request: Request, plan: EncoderPlan | None) -> None:
        pass

    def finish_step(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def free_consumed(self, request: Request) -> None:
        pass

    def free(self, request: Request) -> None:
        pass

    def make_stats(self) -> EncoderCacheStats | None:
        return None
