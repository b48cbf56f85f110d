"""update_from_output: a step's sampled tokens appended, stop checks, finished requests freed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console.engine.core.sched.scheduler_base import SchedulerBase
from lm_console.engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, LogprobsLists, RequestError
from lm_console.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from lm_console.engine.model_runner_output import ModelRunnerOutput
    from lm_console.engine.scheduler_output import SchedulerOutput

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


class OutputUpdate(SchedulerBase):
    """Turns a ModelRunnerOutput into the step's EngineCoreOutputs, one per client."""

    # -- update ---------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Append sampled tokens, run the stop checks, free finished requests' blocks."""
        outputs: dict[int, list[EngineCoreOutput]] = {}
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        # Insertion-ordered (not a set of objects hashed by address): finished requests free
        # their blocks in step order, so block placement is reproducible from run to run.
        stopped: dict[Request, None] = {}
        # Async scheduling only: requests preempted while a step that samples for them ran.
        stopped_preempted: set[Request] = set()
        num_generation_tokens = 0
        failed_loads = self.kv_transfer.update_from_output(model_runner_output.kv_connector_output)
        for request_id in failed_loads:
            self._restart_request(self.requests[request_id])
        delay_frees: dict[Request, bool] = {}
        for client_index, failed in self._failed_outputs:
            outputs.setdefault(client_index, []).append(failed)
        self._failed_outputs = []
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished() or request_id in failed_loads:
                continue  # aborted while the step ran, or its KV load failed (it starts over)
            if request.mm_features:
                self.encoder_scheduler.free_consumed(request)
            req_index = model_runner_output.req_id_to_index[request_id]
            generated = sampled[req_index]
            new_token_ids: list[int] = []
            was_preempted = request.status == RequestStatus.PREEMPTED
            for token_id in generated:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    stopped[request] = None
                    if was_preempted:
                        stopped_preempted.add(request)
                    break
            new_prompt_logprobs = (_take_prompt_logprobs(request, prompt_logprobs.get(request_id))
                                   if prompt_logprobs else None)
            if not new_token_ids and new_prompt_logprobs is None:
                continue
            num_generation_tokens += len(new_token_ids)
            new_logprobs = logprobs.get(request_id) if logprobs else None
            if new_logprobs is not None and len(new_logprobs.sampled_token_ranks) > len(new_token_ids):
                new_logprobs = _slice_logprobs(new_logprobs, 0, len(new_token_ids))
            is_stopped = request in stopped
            finish_reason = _FINISH_REASON.get(request.status) if is_stopped else None
            kv_transfer_params = None
            if is_stopped:
                delay_frees[request], kv_transfer_params = self.kv_transfer.request_finished(request)
            outputs.setdefault(request.client_index, []).append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    events=request.take_events(),
                    kv_transfer_params=kv_transfer_params,
                    error=RequestError(*request.error) if request.error is not None else None,
                    new_prompt_logprobs=new_prompt_logprobs,
                )
            )
        if stopped:
            self.running = [r for r in self.running if r not in stopped]
            if stopped_preempted:
                self.waiting.remove_requests(stopped_preempted)
            for request in stopped:
                self._free_request(request, delay_frees.get(request, False))
        self._last_num_generation_tokens = num_generation_tokens
        return {
            client: EngineCoreOutputs(outputs=client_outputs)
            for client, client_outputs in outputs.items()
        }

    def _check_stop(self, request: Request) -> bool:
        """Stop checks after one appended token: the grammar, length, min_tokens, EOS, stop_token_ids."""
        so_request = request.structured_output_request
        if so_request is not None:  # advance its matcher: it may end the request
            ended = so_request.accept_token(request.output_token_ids[-1])
            if ended is not None:
                request.status, request.error = ended
                if request.error is not None and request.num_output_tokens <= request.sampling_params.min_tokens:
                    # Not an engine bug: the grammar allowed only a stop token, which min_tokens masked.
                    request.error = ("RequestRejectedError", (
                        f"structured output: the constraint allowed only the stop token after "
                        f"{request.num_output_tokens - 1} tokens, but min_tokens="
                        f"{request.sampling_params.min_tokens} forbids stopping before then; lower min_tokens."))
                return True
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len or (
            request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        return False


def _take_prompt_logprobs(request: Request, chunk: tuple[int, LogprobsLists] | None) -> LogprobsLists | None:
    """The chunk's rows the frontend has not had yet: a request recomputed after a preemption
    computes its prompt positions again, and each goes out once."""
    if chunk is None:
        return None
    start, lists = chunk
    skip = request.num_prompt_logprobs_sent - start
    if skip >= len(lists.sampled_token_ranks):
        return None
    if skip > 0:
        lists = _slice_logprobs(lists, skip)
    request.num_prompt_logprobs_sent += len(lists.sampled_token_ranks)
    return lists


def _slice_logprobs(lists: LogprobsLists, start: int, stop: int | None = None) -> LogprobsLists:
    """Rows [start, stop) of a LogprobsLists."""
    return LogprobsLists(lists.logprob_token_ids[start:stop], lists.logprobs[start:stop],
                         lists.sampled_token_ranks[start:stop])
