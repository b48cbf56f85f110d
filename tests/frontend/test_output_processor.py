"""OutputProcessor timing and n > 1 streaming, and AsyncLLM's collectors (no engine needed)."""

from __future__ import annotations

import asyncio

import pytest

from lm_console.engine.errors import DuplicateRequestError, EngineDeadError
from lm_console.engine.frontend.input_processor import InputProcessor
from lm_console.engine.frontend.output_collector import Broadcast, RequestOutputCollector
from lm_console.engine.frontend.output_processor import OutputProcessor
from lm_console.engine.metrics.stats import IterationStats
from lm_console.engine.protocol import (
    EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, FinishReason,
)
from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams


class ListQueue(list):
    def put(self, output) -> None:
        self.append(output)


def _processor(request_id: str, params: SamplingParams, queue=None) -> OutputProcessor:
    inputs = InputProcessor(None, max_model_len=64, vocab_size=100, eos_token_id=None)
    processor = OutputProcessor(None)
    for text, request, parent, index in inputs.process_request(request_id, {"prompt_token_ids": [1, 2]}, params):
        request.arrival_time = 10.0
        processor.add_request(request, text, parent, index, queue=queue)
    return processor


def test_metrics_from_core_events_and_iteration_stats() -> None:
    processor = _processor("r", SamplingParams(max_tokens=3))
    events = [EngineCoreEvent(EngineCoreEventType.QUEUED, 10.5), EngineCoreEvent(EngineCoreEventType.SCHEDULED, 11.0)]
    stats = IterationStats()
    processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5], events=events)]), stats)
    (out,), _ = processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [6, 7], finish_reason=FinishReason.LENGTH)]), stats)
    m = out.metrics
    assert m.queue_time == 0.5 and m.queued_time == 10.5 and m.first_scheduled_time == 11.0
    assert m.num_generation_tokens == 3 and len(m.inter_token_latencies) == 1 and m.e2e_latency > 0
    assert stats.num_prompt_tokens == 2 and stats.num_generation_tokens == 3 and stats.num_finished_requests == 1
    assert out.outputs[0].token_ids == [5, 6, 7] and not processor.has_unfinished_requests()
    (finished,) = stats.finished_requests  # the phases vLLM's per-request histograms observe
    assert finished.finish_reason == "length" and finished.queued_time == 0.5
    assert finished.num_prompt_tokens == 2 and finished.num_generation_tokens == 3
    assert finished.prefill_time == pytest.approx(m.first_token_time - 11.0)
    assert finished.decode_time == pytest.approx(m.last_token_time - m.first_token_time)
    assert finished.inference_time == pytest.approx(finished.prefill_time + finished.decode_time)
    assert finished.e2e_latency == pytest.approx(m.finished_time - 10.0)


def test_each_preemption_is_timed() -> None:
    processor = _processor("r", SamplingParams(max_tokens=3))
    events = [EngineCoreEvent(EngineCoreEventType.SCHEDULED, 11.0), EngineCoreEvent(EngineCoreEventType.PREEMPTED, 11.5)]
    processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [], events=events)]))
    again = [EngineCoreEvent(EngineCoreEventType.SCHEDULED, 12.0), EngineCoreEvent(EngineCoreEventType.PREEMPTED, 12.5)]
    processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5], events=again)]))
    (out,), _ = processor.process_outputs(
        EngineCoreOutputs(outputs=[EngineCoreOutput("r", [6, 7], finish_reason=FinishReason.LENGTH)]))
    assert out.metrics.num_preemptions == 2 and out.metrics.preempted_times == [11.5, 12.5]
    assert out.metrics.first_scheduled_time == 11.0


def test_n_children_stream_delta_and_abort_with_final_outputs() -> None:
    queue = ListQueue()
    params = SamplingParams(n=2, max_tokens=5, output_kind=RequestOutputKind.DELTA)
    processor = _processor("p", params, queue)
    with pytest.raises(DuplicateRequestError):
        processor.add_request(*_first_child(params))
    child_ids = processor.parent_requests["p"].child_request_ids
    processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput(child_ids[0], [3]),
                                                         EngineCoreOutput(child_ids[1], [4])]))
    assert [[c.index for c in o.outputs] for o in queue] == [[0], [1]]  # DELTA: only the news
    assert [o.outputs[0].token_ids for o in queue] == [[3], [4]] and not queue[-1].finished
    assert sorted(processor.abort_requests(["p"], emit_outputs=True)) == sorted(child_ids)
    assert queue[-1].finished and queue[-1].outputs[0].finish_reason == "abort"
    assert not processor.request_states and not processor.parent_requests


def _first_child(params: SamplingParams):
    inputs = InputProcessor(None, max_model_len=64, vocab_size=100, eos_token_id=None)
    text, request, parent, index = inputs.process_request("p", {"prompt_token_ids": [1]}, params)[0]
    return request, text, parent, index


def test_dead_engine_reaches_every_queued_request() -> None:
    queue = ListQueue()
    processor = _processor("r", SamplingParams(), queue)
    processor.propagate_error(EngineDeadError("gone"))
    assert isinstance(queue[0], EngineDeadError) and not processor.has_unfinished_requests()


def test_collector_merges_deltas_and_keeps_the_latest_cumulative() -> None:
    async def main():
        processor_queue = ListQueue()
        processor = _processor("r", SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA), processor_queue)
        for token in (3, 4, 5):
            processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [token])]))
        delta = RequestOutputCollector(RequestOutputKind.DELTA)
        cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        for output in processor_queue:
            delta.put(output)
            cumulative.put(output)
        merged = await delta.get()
        assert merged.outputs[0].token_ids == [3, 4, 5] and delta.get_nowait() is None
        assert (await cumulative.get()) is processor_queue[-1]
        delta.put(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await delta.get()

    asyncio.run(main())


def test_broadcast_drops_the_oldest_for_a_slow_subscriber() -> None:
    async def main():
        broadcast = Broadcast()
        stream = broadcast.subscribe(maxsize=2)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # subscribed
        for item in range(5):
            broadcast.publish(item)
        got = [await first, await stream.__anext__()]
        broadcast.close()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        return got

    assert asyncio.run(main()) == [3, 4]


def test_prompt_logprobs_chunks_wait_for_the_first_token_and_go_out_once() -> None:
    """A prefill chunk's prompt logprobs (no token yet) make no output; DELTA hands each row out
    once, with the first token; CUMULATIVE repeats the whole list."""
    from lm_console.engine.frontend.logprobs import Logprob
    from lm_console.engine.protocol import LogprobsLists

    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        queue = ListQueue()
        processor = _processor("r", SamplingParams(max_tokens=3, prompt_logprobs=0, output_kind=kind), queue)
        chunk = EngineCoreOutput("r", [], new_prompt_logprobs=LogprobsLists([[2]], [[-1.5]], [4]))
        processor.process_outputs(EngineCoreOutputs(outputs=[chunk]))
        assert queue == []  # the row waits for the first token
        processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [7])]))
        processor.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [8], finish_reason=FinishReason.LENGTH)]))
        rows = [None, {2: Logprob(-1.5, 4, None)}]
        assert queue[0].prompt_logprobs == rows
        assert queue[1].prompt_logprobs == ([] if kind == RequestOutputKind.DELTA else rows)
