"""OutputProcessor: EngineCoreOutputs -> RequestOutput (after vLLM's OutputProcessor)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lm_console.engine.errors import DuplicateRequestError, error_type_named, fresh_error
from lm_console.engine.frontend.detokenizer import IncrementalDetokenizer
from lm_console.engine.frontend.logprobs import LogprobsProcessor
from lm_console.engine.metrics.phases import request_phases
from lm_console.engine.metrics.stats import FinishedRequestStats, IterationStats
from lm_console.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lm_console.engine.protocol import (
    EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, LogprobsLists,
    RequestError,
)
from lm_console.engine.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from lm_console.engine.frontend.tracing import RequestTracer

logger = logging.getLogger(__name__)


class OutputQueue(Protocol):
    """Where AsyncLLM wants a request's outputs (RequestOutputCollector)."""

    def put(self, output: RequestOutput | BaseException) -> None: ...


@dataclass
class ParentRequest:
    """Groups the n child requests of one user request (n > 1) into one RequestOutput."""

    request_id: str
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    child_request_ids: list[str] = field(default_factory=list)

    def is_finished(self) -> bool:
        return len(self.completions) == self.n and all(c.finished() for c in self.completions.values())


@dataclass
class RequestState:
    """The frontend's per-request state: detokenizer, logprobs, timing and output queue."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs_processor: LogprobsProcessor
    metrics: RequestMetrics
    parent: ParentRequest | None = None
    child_index: int = 0
    queue: OutputQueue | None = None
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    pooled: list[float] | None = None  # a pooling request's embedding (SamplingParams.pooling)
    priority: int = 0  # as sent (scheduling_policy="priority"), for the console's request table
    max_tokens_param: int | None = None  # after the InputProcessor's default (up to the context)
    # For the request's OTLP span: its sampling knobs and the caller's trace context (traceparent).
    temperature: float | None = None
    top_p: float | None = None
    trace_headers: Mapping[str, str] | None = None
    lora_name: str | None = None  # its LoRA adapter, for the console's request table


class OutputProcessor:
    """Detokenizes, applies stop strings and builds RequestOutputs; tells the caller what to abort.

    Outputs of a request with a queue (AsyncLLM) go to that queue; the others are returned.
    Invariant: every child in request_states belongs to the parent in parent_requests under
    its parent's id, and a parent is dropped when its last child finishes or is aborted.
    """

    def __init__(self, tokenizer: Any, tracer: RequestTracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.tracer = tracer  # one span per finished request when tracing is on
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    parent: ParentRequest | None = None, child_index: int = 0,
                    queue: OutputQueue | None = None, trace_headers: Mapping[str, str] | None = None) -> None:
        """Track one request (DuplicateRequestError if its id, or its parent's, is live)."""
        self.add_requests([(prompt, request, parent, child_index)], queue, trace_headers)

    def add_requests(self, children: list[tuple[str | None, EngineCoreRequest, ParentRequest | None, int]],
                     queue: OutputQueue | None = None, trace_headers: Mapping[str, str] | None = None) -> None:
        """Track a user request's children, all or none: every id is checked before any is added.

        trace_headers: the caller's W3C trace context (traceparent), the parent of its spans.
        """
        new_ids = [request.request_id for _, request, _, _ in children]
        new_parents = {id(parent): parent for _, _, parent, _ in children if parent is not None}
        for request_id in new_ids:
            if request_id in self.request_states or request_id in self.parent_requests:
                raise DuplicateRequestError(f"Request id {request_id!r} is already running; use a new id.")
        if len(set(new_ids)) != len(new_ids):
            raise DuplicateRequestError(f"Request ids {new_ids} repeat; each must be unique.")
        for parent in new_parents.values():
            live = self.parent_requests.get(parent.request_id)
            if (live is not None and live is not parent) or parent.request_id in self.request_states:
                raise DuplicateRequestError(f"Request id {parent.request_id!r} is already running; use a new id.")
        for prompt, request, parent, child_index in children:
            self._add(request, prompt, parent, child_index, queue, trace_headers)

    def _add(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None,
             child_index: int, queue: OutputQueue | None, trace_headers: Mapping[str, str] | None = None) -> None:
        request_id = request.request_id
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
            parent.child_request_ids.append(request_id)
        params = request.sampling_params
        self.request_states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer.from_new_request(
                self.tokenizer, request.prompt_token_ids, params),
            logprobs_processor=LogprobsProcessor.from_new_request(self.tokenizer, params),
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            parent=parent,
            child_index=child_index,
            queue=queue,
            priority=request.priority,
            max_tokens_param=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            trace_headers=trace_headers,
            lora_name=request.lora_request.lora_name if request.lora_request is not None else None,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(self, request_ids: list[str], emit_outputs: bool = False) -> list[str]:
        """Forget requests (user or parent ids); returns the engine-core ids to abort.

        emit_outputs: give each queued request a final output with finish_reason "abort".
        """
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            child_ids = parent.child_request_ids if parent is not None else [request_id]
            for child_id in child_ids:
                state = self.request_states.pop(child_id, None)
                if state is None:
                    continue
                core_ids.append(child_id)
                if emit_outputs and state.queue is not None:
                    state.metrics.finished_time = time.time()
                    output = self._make_request_output(state, str(FinishReason.ABORT), None)
                    if output is not None:
                        state.queue.put(output)
        return core_ids

    def propagate_error(self, error: BaseException) -> None:
        """Fail every queued request (the engine core died)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put(fresh_error(error))
        self.request_states.clear()
        self.parent_requests.clear()

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs,
                        iteration_stats: IterationStats | None = None
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Return (RequestOutputs of queue-less requests, request ids to abort in the core).

        A request the core refused (output.error) ends with that error: put in its queue, or,
        for a queue-less request, raised once the whole batch is processed.
        """
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        unqueued_error: BaseException | None = None
        now = time.time()
        for output in engine_core_outputs.outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            if output.error is not None:
                error = self._fail(state, output.error, reqs_to_abort)
                if error is not None and unqueued_error is None:
                    unqueued_error = error
                continue
            self._update_stats(state, output, now, iteration_stats)
            if output.new_prompt_logprobs is not None:
                state.logprobs_processor.update_prompt_logprobs(output.new_prompt_logprobs)
            if not output.new_token_ids and output.finish_reason is None:
                continue  # a prefill chunk's prompt logprobs: they go out with the first token
            finish_reason, stop_reason = self._update_state(state, output)
            if finish_reason is not None and output.finish_reason is None:
                reqs_to_abort.append(output.request_id)  # a stop string ended it in the frontend
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[output.request_id]
                if iteration_stats is not None:
                    iteration_stats.num_finished_requests += 1
                    iteration_stats.e2e_latencies.append(now - state.metrics.arrival_time)
                    iteration_stats.finished_requests.append(
                        _finished_stats(state, finish_reason, now))
                if self.tracer is not None:
                    self._trace(state, self.tracer)
            request_output = self._make_request_output(state, finish_reason, stop_reason)
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put(request_output)
                else:
                    request_outputs.append(request_output)
            parent = state.parent
            if parent is not None and parent.is_finished():
                self.parent_requests.pop(parent.request_id, None)
        if unqueued_error is not None:
            raise unqueued_error
        return request_outputs, reqs_to_abort

    @staticmethod
    def _trace(state: RequestState, tracer: RequestTracer) -> None:
        """Queue the finished request's span; a tracing failure never fails the request."""
        from lm_console.engine.frontend.tracing import span_attributes

        metrics = state.metrics
        parent = state.parent
        params = {"max_tokens": state.max_tokens_param, "temperature": state.temperature, "top_p": state.top_p,
                  "n": parent.n if parent is not None else 1}
        try:
            attributes = span_attributes(parent.request_id if parent is not None else state.request_id, metrics,
                                         len(state.prompt_token_ids), len(state.token_ids), params)
            tracer.record(attributes, metrics.arrival_time, metrics.finished_time or time.time(), state.trace_headers)
        except Exception:
            logger.warning("could not record the span of request %s", state.request_id, exc_info=True)

    def _fail(self, state: RequestState, wire_error: RequestError, reqs_to_abort: list[str]) -> BaseException | None:
        """End a refused request (with its siblings when n > 1); the error if it has no queue."""
        error = error_type_named(wire_error.exc_type)(wire_error.message)
        user_id = state.parent.request_id if state.parent is not None else state.request_id
        # The siblings still run in the core: abort them there.
        reqs_to_abort.extend(i for i in self.abort_requests([user_id]) if i != state.request_id)
        if state.queue is None:
            return error
        state.queue.put(error)
        return None

    @staticmethod
    def _update_stats(state: RequestState, output: EngineCoreOutput, now: float,
                      iteration_stats: IterationStats | None) -> None:
        metrics = state.metrics
        for event in output.events or ():
            if event.type == EngineCoreEventType.QUEUED:
                metrics.queued_time = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                metrics.num_preemptions += 1
                metrics.preempted_times.append(event.timestamp)
                if iteration_stats is not None:
                    iteration_stats.num_preempted_reqs += 1
        num_new_tokens = len(output.new_token_ids)
        if not num_new_tokens:
            return
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            state.num_cached_tokens = output.num_cached_tokens
            if iteration_stats is not None:
                iteration_stats.num_prompt_tokens += len(state.prompt_token_ids)
                iteration_stats.time_to_first_tokens.append(now - metrics.arrival_time)
        else:
            latency = now - (metrics.last_token_time or now)
            metrics.inter_token_latencies.append(latency)
            if iteration_stats is not None:
                iteration_stats.inter_token_latencies.append(latency)
        metrics.last_token_time = now
        metrics.num_generation_tokens += num_new_tokens
        if iteration_stats is not None:
            iteration_stats.num_generation_tokens += num_new_tokens

    @staticmethod
    def _update_state(state: RequestState, output: EngineCoreOutput
                      ) -> tuple[str | None, int | str | None]:
        if output.kv_transfer_params is not None:
            state.kv_transfer_params = output.kv_transfer_params
        if output.pooled is not None:
            state.pooled = output.pooled
        finish_reason = str(output.finish_reason) if output.finish_reason is not None else None
        stop_reason = output.stop_reason
        # The core stops only on EOS or a stop token id, whose text is not part of the output.
        stop_terminated = output.finish_reason == FinishReason.STOP
        num_before = state.detokenizer.num_output_tokens
        stop_string = state.detokenizer.update(output.new_token_ids, stop_terminated)
        # A stop string inside a multi-token output (speculative decoding) drops the tokens after it.
        num_kept = state.detokenizer.num_output_tokens - num_before
        state.token_ids.extend(output.new_token_ids[:num_kept])
        new_logprobs = output.new_logprobs
        if new_logprobs is not None:
            if len(new_logprobs.sampled_token_ranks) > num_kept:
                new_logprobs = LogprobsLists(new_logprobs.logprob_token_ids[:num_kept],
                                             new_logprobs.logprobs[:num_kept],
                                             new_logprobs.sampled_token_ranks[:num_kept])
            state.logprobs_processor.update_from_output(new_logprobs)
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
        return finish_reason, stop_reason

    def _make_request_output(self, state: RequestState, finish_reason: str | None,
                             stop_reason: int | str | None) -> RequestOutput | None:
        finished = finish_reason is not None
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = state.output_kind == RequestOutputKind.DELTA
        text = state.detokenizer.get_next_output_text(finished, delta)
        if delta:
            token_ids = state.token_ids[state.num_sent_tokens:]
            state.num_sent_tokens = len(state.token_ids)
            logprobs = state.logprobs_processor.new_logprobs(len(token_ids))
            prompt_logprobs = state.logprobs_processor.pop_prompt_logprobs()
        else:
            token_ids = list(state.token_ids)
            logprobs = state.logprobs_processor.logprobs
            prompt_logprobs = state.logprobs_processor.prompt_logprobs
        completion = CompletionOutput(
            index=state.child_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.logprobs_processor.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        parent = state.parent
        if parent is None:
            return RequestOutput(
                request_id=state.request_id, prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids, outputs=[completion], finished=finished,
                num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
                kv_transfer_params=state.kv_transfer_params, prompt_logprobs=prompt_logprobs,
                pooled=state.pooled,
            )
        parent.completions[state.child_index] = completion
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not parent.is_finished():
            return None
        # DELTA: only this child's news; otherwise every child's latest state.
        outputs = [completion] if delta else [parent.completions[i] for i in sorted(parent.completions)]
        return RequestOutput(
            request_id=parent.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=outputs,
            finished=parent.is_finished(), num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics, prompt_logprobs=prompt_logprobs,
        )


def _finished_stats(state: RequestState, finish_reason: str, now: float) -> FinishedRequestStats:
    """The phase durations of a request that just finished (0 for a phase it never reached)."""
    metrics = state.metrics
    # The same split the request's OTLP span and the console's inspector show (metrics/phases.py).
    phases = request_phases(metrics.arrival_time, metrics.queued_time, metrics.first_scheduled_time,
                            metrics.first_token_time, metrics.last_token_time, now)
    return FinishedRequestStats(
        finish_reason=finish_reason, e2e_latency=now - metrics.arrival_time,
        num_prompt_tokens=len(state.prompt_token_ids), num_generation_tokens=len(state.token_ids),
        queued_time=phases.time_in_queue, prefill_time=phases.prefill,
        decode_time=phases.decode, inference_time=phases.inference,
        n_param=(state.parent.n if state.parent is not None else 1) if state.child_index == 0 else None,
        max_tokens_param=state.max_tokens_param if state.child_index == 0 else None)
