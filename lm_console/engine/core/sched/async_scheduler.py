"""AsyncScheduler: the Scheduler for async scheduling, where the next step is scheduled while the
worker still runs the current one (vLLM's vllm/v1/core/sched/async_scheduler.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console.engine.core.sched.scheduler import Scheduler
from lm_console.engine.errors import DuplicateRequestError, InvalidEngineArgsError
from lm_console.engine.protocol import EngineCoreOutputs
from lm_console.engine.request import Request, RequestStatus
from lm_console.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from lm_console.engine.core.sched.scheduler import _Admission  # the scheduler's admission plan
    from lm_console.engine.model_runner_output import ModelRunnerOutput


class AsyncScheduler(Scheduler):
    """A Scheduler that does not wait for a step's sampled tokens before scheduling the next one.

    With async scheduling the engine core keeps two batches in flight (EngineCore.step_with_batch_queue):
    it schedules step N+1 while the worker still runs step N. A decoding request's next input is the
    token step N is sampling, which nobody on this side knows yet, so the scheduler counts it as a
    *placeholder* (Request.num_output_placeholders): num_computed_tokens includes it, num_tokens does
    not. The worker substitutes the real token id from its own last sample (ModelRunner's
    prev_sampled_token_ids). update_from_output turns placeholders back into real tokens.

    Corner cases, each covered by tests/core/sched/test_async_scheduler.py:
    - stop (EOS, stop token, max_tokens, max_model_len) at step N while step N+1 already samples for
      the request: the request finishes at N; N+1's token for it is discarded (the request is gone),
      never emitted. A request whose in-flight tokens will reach max_tokens or max_model_len is not
      scheduled again, so no step is wasted on it.
    - aborts and stops free a request's KV blocks only once no step in flight still writes them
      (`_deferred_frees`), so a block is never handed to another request while it is written.
    - preemption of a request with a token in flight: the token still arrives (it is a real token,
      computed from a KV cache that was whole when its step was scheduled) and is appended; the
      request is re-admitted only once no token of it is in flight, so its recomputation starts from
      every token it has.
    - prefix caching: block hashes cover real tokens only (Request.block_hashes grows on append),
      and allocate_slots caches blocks up to num_tokens; update_from_output (and the final free)
      caches the blocks the arrived tokens complete.

    Invariant: for every request, num_output_placeholders == the number of steps in flight that
    sample for it; `_num_steps_in_flight[req_id]` counts the steps in flight that compute any token of
    it (a prefill chunk included).
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        if self.speculative_config is not None:
            # Drafts come from the tokens a step accepted, which this scheduler does not wait for.
            raise InvalidEngineArgsError("speculative_config cannot be combined with async_scheduling.")
        self._num_steps_in_flight: dict[str, int] = {}
        # Finished requests whose blocks a step in flight still writes: freed when it returns.
        self._deferred_frees: dict[str, Request] = {}

    def _num_tokens_to_compute(self, request: Request) -> int:
        """Known tokens plus those in flight; no more once the tokens in flight reach the
        request's max_tokens or max_model_len (its last token is already being sampled), or
        while a structured request has a token in flight."""
        num_tokens = request.num_tokens + request.num_output_placeholders
        if request.num_output_placeholders > 0 and (
                # A structured request's bitmask needs its grammar advanced over every token, so
                # its next step waits for the token in flight (no overlap for it).
                request.structured_output_request is not None
                or num_tokens >= self.max_model_len
                or (request.max_tokens is not None
                    and request.num_output_tokens + request.num_output_placeholders >= request.max_tokens)):
            return request.num_computed_tokens  # nothing new to schedule
        return num_tokens

    def _get_computed_tokens(self, request: Request) -> _Admission | None:
        """A preempted request waits (keeping its place) until its tokens in flight arrive: its
        recomputation must start from all of its tokens."""
        if request.num_output_placeholders > 0:
            return None
        return super()._get_computed_tokens(request)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput, num_preempted: int) -> None:
        """Advance as the base scheduler does, then count a placeholder for every request whose
        step samples a token (its computed tokens reach all of its tokens, those in flight included)."""
        super()._update_after_schedule(scheduler_output, num_preempted)
        in_flight = self._num_steps_in_flight
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[request_id]
            in_flight[request_id] = in_flight.get(request_id, 0) + 1
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Replace this step's placeholders by its sampled tokens, then update as the base
        scheduler does; free the blocks of finished requests no step in flight uses any more."""
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request_id not in index:
                continue  # finished while the step ran: its token is discarded
            num_sampled = len(sampled[index[request_id]])
            assert request.num_output_placeholders >= num_sampled, (request_id, request.num_output_placeholders)
            request.num_output_placeholders -= num_sampled
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request_id in scheduler_output.num_scheduled_tokens:
            self._step_returned(request_id)
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self._cache_computed_blocks(request)
        return outputs

    def _cache_computed_blocks(self, request: Request) -> None:
        """Enter the blocks whose tokens are all known into the prefix cache: allocate_slots
        stopped at the real tokens, and the tokens that arrived since may complete a block."""
        if request.num_computed_tokens > 0:  # it holds blocks (a preempted request holds none)
            num_tokens = min(request.num_computed_tokens - request.num_output_placeholders, request.num_tokens)
            self.kv_cache_manager.cache_blocks(request, num_tokens)

    def _step_returned(self, request_id: str) -> None:
        """One step that computed tokens of request_id is done: free deferred blocks at the last."""
        in_flight = self._num_steps_in_flight
        num_left = in_flight.get(request_id, 0) - 1
        if num_left > 0:
            in_flight[request_id] = num_left
            return
        in_flight.pop(request_id, None)
        request = self._deferred_frees.pop(request_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    def _free_request(self, request: Request, delay_free: bool | None = None) -> None:
        """Cache the finished request's completed blocks (its last tokens may have completed
        one since its last allocate_slots), then free it as the base scheduler does."""
        self._cache_computed_blocks(request)
        super()._free_request(request, delay_free)

    def _free_blocks(self, request: Request, delay_free: bool) -> None:
        """Defer the free while a step in flight still writes the request's blocks."""
        if not delay_free and self._num_steps_in_flight.get(request.request_id, 0) > 0:
            self._deferred_frees[request.request_id] = request
            return
        super()._free_blocks(request, delay_free)

    def add_request(self, request: Request) -> None:
        """Refuse the id of a finished request that a step in flight still computes: its output
        would be taken for the new request's."""
        if request.request_id in self._num_steps_in_flight:
            raise DuplicateRequestError(
                f"Request id {request.request_id!r} belongs to a request that just finished but is still in a "
                "step in flight (async scheduling); use a fresh id, or resubmit after its final output.")
        super().add_request(request)

    @property
    def num_deferred_frees(self) -> int:
        """Finished requests whose blocks wait for a step in flight."""
        return len(self._deferred_frees)
