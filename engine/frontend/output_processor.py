"""OutputProcessor: EngineCoreOutputs -> RequestOutput (seed: OutputProcessor, lines 4605-4739)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.logprobs import LogprobsProcessor
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine.sampling_params import RequestOutputKind


@dataclass
class ParentRequest:
    """Groups the n child requests of one user request (n > 1) into one RequestOutput."""

    request_id: str
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)

    def is_finished(self) -> bool:
        return len(self.completions) == self.n and all(c.finished() for c in self.completions.values())


@dataclass
class RequestState:
    """The frontend's per-request state: detokenizer, logprobs and timing."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    logprobs_processor: LogprobsProcessor
    metrics: RequestMetrics
    parent: ParentRequest | None = None
    child_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    num_cached_tokens: int = 0


class OutputProcessor:
    """Detokenizes, applies stop strings and builds RequestOutputs; tells the caller what to abort."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    parent: ParentRequest | None = None, child_index: int = 0) -> None:
        params = request.sampling_params
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer.from_new_request(
                self.tokenizer, request.prompt_token_ids, params),
            logprobs_processor=LogprobsProcessor.from_new_request(self.tokenizer, params),
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            parent=parent,
            child_index=child_index,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Return (RequestOutputs ready for the user, request ids to abort in the core)."""
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        now = time.time()
        for output in engine_core_outputs.outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted by the user meanwhile
            finish_reason, stop_reason = self._update_state(state, output, now)
            if finish_reason is not None and output.finish_reason is None:
                reqs_to_abort.append(output.request_id)  # a stop string ended it in the frontend
            request_output = self._make_request_output(state, finish_reason, stop_reason)
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[output.request_id]
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs, reqs_to_abort

    def _update_state(self, state: RequestState, output: EngineCoreOutput, now: float
                      ) -> tuple[str | None, int | str | None]:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            state.num_cached_tokens = output.num_cached_tokens
        metrics.last_token_time = now
        metrics.num_generation_tokens += len(output.new_token_ids)
        state.token_ids.extend(output.new_token_ids)
        finish_reason = str(output.finish_reason) if output.finish_reason is not None else None
        stop_reason = output.stop_reason
        # The core stops only on EOS or a stop token id, whose text is not part of the output.
        stop_terminated = output.finish_reason == FinishReason.STOP
        stop_string = state.detokenizer.update(output.new_token_ids, stop_terminated)
        if output.new_logprobs is not None:
            state.logprobs_processor.update_from_output(output.new_logprobs)
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
        else:
            token_ids = list(state.token_ids)
            logprobs = state.logprobs_processor.logprobs
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
            )
        parent.completions[state.child_index] = completion
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not parent.is_finished():
            return None
        return RequestOutput(
            request_id=parent.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[parent.completions[i] for i in sorted(parent.completions)],
            finished=parent.is_finished(), num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
