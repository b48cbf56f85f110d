"""The request span's attributes (engine/frontend/tracing.py) against the request's own figures.

The OutputProcessor builds the span from the same RequestMetrics the Prometheus histograms
(FinishedRequestStats) and the console's request inspector use: a recording tracer stands in for
the OTLP exporter here (tests/entrypoints/openai/test_otlp_tracing.py runs the real one), and
a Pilot test opens the inspector on the same request and reads the same figures off its screen.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lm_console.client.asyncllm import chunk_of
from lm_console.engine.frontend.input_processor import InputProcessor
from lm_console.engine.frontend.output_processor import OutputProcessor
from lm_console.engine.frontend.tracing import SpanAttributes, span_attributes, trace_headers_of
from lm_console.engine.metrics.stats import IterationStats
from lm_console.engine.protocol import (
    EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, FinishReason,
)
from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams
from lm_console.tui.screens.request_inspector import fmt_phase, timeline_phases

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# Span attribute -> the FinishedRequestStats field the Prometheus histogram observes.
STATS_FIELDS = {
    SpanAttributes.GEN_AI_LATENCY_E2E: "e2e_latency",
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: "queued_time",
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: "prefill_time",
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: "decode_time",
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: "inference_time",
    SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: "num_prompt_tokens",
    SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: "num_generation_tokens",
}
# Span attribute -> its name on the inspector's phases line.
INSPECTOR_NAMES = {
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: "queue",
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: "prefill",
    SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: "decode",
    SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: "TTFT",
    SpanAttributes.GEN_AI_LATENCY_E2E: "e2e",
}


class RecordingTracer:
    """RequestTracer's interface, keeping each span's arguments."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def record(self, attributes: dict[str, Any], start_time: float, end_time: float,
               trace_headers: Any = None) -> None:
        self.spans.append({"attributes": attributes, "start": start_time, "end": end_time, "headers": trace_headers})

    def shutdown(self) -> None:
        pass


def run_request(tracer: RecordingTracer, params: SamplingParams, clock: list[float]) -> tuple[Any, IterationStats]:
    """One request through the OutputProcessor: queued 10.5, scheduled 11.0, three outputs, finished."""
    inputs = InputProcessor(None, max_model_len=64, vocab_size=100, eos_token_id=None)
    processor = OutputProcessor(None, tracer=tracer)  # type: ignore[arg-type]
    children = inputs.process_request("r", {"prompt_token_ids": [1, 2, 3, 4]}, params)
    for _, request, _, _ in children:
        request.arrival_time = 10.0
    processor.add_requests(children, trace_headers={"traceparent": TRACEPARENT})
    stats = IterationStats()
    events = [EngineCoreEvent(EngineCoreEventType.QUEUED, 10.5), EngineCoreEvent(EngineCoreEventType.SCHEDULED, 11.0)]
    steps = [EngineCoreOutput("r", [5], events=events), EngineCoreOutput("r", [6]),
             EngineCoreOutput("r", [7], finish_reason=FinishReason.LENGTH)]
    final = None
    import lm_console.engine.frontend.output_processor as module

    for step, now in zip(steps, clock):
        original = module.time.time
        module.time.time = lambda now=now: now  # type: ignore[assignment]
        try:
            outputs, _ = processor.process_outputs(EngineCoreOutputs(outputs=[step]), stats)
        finally:
            module.time.time = original  # type: ignore[assignment]
        final = outputs[-1] if outputs else final
    return final, stats


def test_span_equals_the_requests_histogram_figures_and_carries_the_traceparent() -> None:
    tracer = RecordingTracer()
    params = SamplingParams(max_tokens=3, temperature=0.5, top_p=0.8, output_kind=RequestOutputKind.FINAL_ONLY)
    output, stats = run_request(tracer, params, clock=[11.25, 11.5, 12.0])
    (span,) = tracer.spans
    attributes = span["attributes"]
    (finished,) = stats.finished_requests
    for attribute, stat_field in STATS_FIELDS.items():
        assert attributes[attribute] == getattr(finished, stat_field), attribute
    assert attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == stats.time_to_first_tokens[0] == 1.25
    assert attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] == 0.5
    assert attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] == 0.25
    assert attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] == 0.75
    assert attributes[SpanAttributes.GEN_AI_LATENCY_E2E] == 2.0
    assert attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == 4
    assert attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == 3 == len(output.outputs[0].token_ids)
    assert attributes[SpanAttributes.GEN_AI_REQUEST_ID] == "r"
    assert attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] == 3
    assert attributes[SpanAttributes.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attributes[SpanAttributes.GEN_AI_REQUEST_TOP_P] == 0.8
    assert attributes[SpanAttributes.GEN_AI_REQUEST_N] == 1
    assert (span["start"], span["end"]) == (10.0, 12.0)
    assert span["headers"] == {"traceparent": TRACEPARENT}


def test_a_wrong_mapping_fails_the_comparison() -> None:
    """Negative control: the comparison above catches an attribute fed from the wrong timestamp."""
    tracer = RecordingTracer()
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    output, stats = run_request(tracer, params, clock=[11.25, 11.5, 12.0])
    (finished,) = stats.finished_requests
    metrics = output.metrics
    # prefill measured from arrival instead of from scheduling (a plausible slip).
    metrics.first_scheduled_time, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    wrong = span_attributes("r", metrics, 4, 3, {})
    metrics.first_scheduled_time = scheduled
    assert wrong[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] != finished.prefill_time
    # and attribute names swapped between two phases.
    right = tracer.spans[0]["attributes"]
    swapped = dict(STATS_FIELDS)
    swapped[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = "decode_time"
    swapped[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = "prefill_time"
    assert any(right[a] != getattr(finished, f) for a, f in swapped.items())


def test_n_children_each_get_a_span_under_the_request_id() -> None:
    tracer = RecordingTracer()
    params = SamplingParams(n=2, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    inputs = InputProcessor(None, max_model_len=64, vocab_size=100, eos_token_id=None)
    processor = OutputProcessor(None, tracer=tracer)  # type: ignore[arg-type]
    children = inputs.process_request("p", {"prompt_token_ids": [1, 2]}, params)
    processor.add_requests(children)
    child_ids = [request.request_id for _, request, _, _ in children]
    processor.process_outputs(EngineCoreOutputs(outputs=[
        EngineCoreOutput(i, [5, 6, 7], finish_reason=FinishReason.LENGTH) for i in child_ids]))
    assert [s["attributes"][SpanAttributes.GEN_AI_REQUEST_ID] for s in tracer.spans] == ["p", "p"]
    assert all(s["attributes"][SpanAttributes.GEN_AI_REQUEST_N] == 2 for s in tracer.spans)
    assert all(s["headers"] is None for s in tracer.spans)


def test_trace_headers_of_keeps_only_the_trace_context() -> None:
    assert trace_headers_of({"traceparent": TRACEPARENT, "authorization": "Bearer x"}) == {"traceparent": TRACEPARENT}
    assert trace_headers_of({"content-type": "application/json"}) is None


def test_inspector_shows_the_spans_figures() -> None:
    """Pilot: the request's output, through the console's own conversion (chunk_of) into its
    request book, opened in the inspector: the phases line shows each span figure."""
    from lm_console.tui.demo import demo_app
    from lm_console.tui.screens.request_inspector import RequestInspector

    tracer = RecordingTracer()
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
    output, _ = run_request(tracer, params, clock=[11.25, 11.5, 12.0])
    attributes = tracer.spans[0]["attributes"]

    async def scenario() -> str:
        app, _, _ = demo_app(chat_only=True)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            app.book.submit("r", "chat", 10.0, prompt="hello")
            app.book.on_chunk(chunk_of(output), 12.0)
            app.open_inspector("r")
            await pilot.pause()
            await pilot.pause()
            assert isinstance(app.screen, RequestInspector)
            return str(app.screen.query_one("#inspector-head").render())

    head = asyncio.run(scenario())
    phases_line = next(line for line in head.splitlines() if line.startswith("phases:"))
    for attribute, name in INSPECTOR_NAMES.items():
        assert f"{name} {fmt_phase(attributes[attribute])}" in phases_line, (name, phases_line)
    # Negative control: a figure from another phase is not what the inspector shows under this name.
    assert f"prefill {fmt_phase(attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE])}" not in phases_line
    assert timeline_phases(chunk_of(output).timeline) == phases_line


@pytest.mark.parametrize("seconds,text", [(0.25, "250.0 ms"), (0.00012, "0.1 ms"), (2.0, "2.000 s")])
def test_fmt_phase(seconds: float, text: str) -> None:
    assert fmt_phase(seconds) == text
