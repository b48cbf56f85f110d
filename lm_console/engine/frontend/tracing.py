"""Request tracing over OTLP: one "llm_request" span per finished request (vLLM's name and attributes).

The span is built in the frontend when the OutputProcessor sees a request finish, from the same
RequestMetrics timestamps (through engine/metrics/phases.py) that feed the Prometheus histograms
and the console's request inspector. Spans go through OpenTelemetry's BatchSpanProcessor: ending
a span only queues it, and a background thread exports batches, so neither the event loop nor the
engine ever waits on the collector. A client's W3C `traceparent` (and `tracestate`) header makes
the span a child of the caller's span.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from lm_console.engine.config.observability import ObservabilityConfig
from lm_console.engine.metrics.phases import request_phases
from lm_console.engine.outputs import RequestMetrics

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
# The W3C trace-context headers a request may carry (what the propagator reads).
TRACE_HEADERS = ("traceparent", "tracestate")
SHUTDOWN_WAIT_S = 5.0  # the longest an engine's shutdown waits for its last spans to be exported


class SpanAttributes:
    """vLLM's span attribute names (OpenTelemetry's gen_ai semantic conventions, plus its own)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace-context headers among an HTTP request's headers (None when it has none)."""
    found = {name: headers[name] for name in TRACE_HEADERS if headers.get(name)}
    return found or None


def span_attributes(request_id: str, metrics: RequestMetrics, num_prompt_tokens: int, num_generation_tokens: int,
                    params: Mapping[str, Any], model_name: str | None = None) -> dict[str, Any]:
    """The attributes of a finished request's span: vLLM's names, our RequestMetrics' figures.

    params: the request's max_tokens, temperature, top_p and n (an absent or None one is left out).
    """
    phases = request_phases(metrics.arrival_time, metrics.queued_time, metrics.first_scheduled_time,
                            metrics.first_token_time, metrics.last_token_time, metrics.finished_time)
    attributes: dict[str, Any] = {
        SpanAttributes.GEN_AI_REQUEST_ID: request_id,
        SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
        SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: num_generation_tokens,
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: phases.time_in_queue,
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: phases.prefill,
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: phases.decode,
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: phases.inference,
    }
    if phases.time_to_first_token is not None:
        attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = phases.time_to_first_token
    if phases.e2e is not None:
        attributes[SpanAttributes.GEN_AI_LATENCY_E2E] = phases.e2e
    for name, key in (("max_tokens", SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS),
                      ("temperature", SpanAttributes.GEN_AI_REQUEST_TEMPERATURE),
                      ("top_p", SpanAttributes.GEN_AI_REQUEST_TOP_P), ("n", SpanAttributes.GEN_AI_REQUEST_N)):
        value = params.get(name)
        if value is not None:
            attributes[key] = value
    if model_name is not None:
        attributes[SpanAttributes.GEN_AI_RESPONSE_MODEL] = model_name
    return attributes


class RequestTracer:
    """Exports one span per finished request to an OTLP/HTTP endpoint (batched, in the background)."""

    def __init__(self, endpoint: str, service_name: str = "lm-console") -> None:
        # Imported here: OpenTelemetry is an optional extra (ObservabilityConfig refuses the
        # endpoint when it is missing, naming the extra).
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": service_name, "process.pid": os.getpid()})
        # A provider of our own, not the global one: an application embedding the engine keeps its own.
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("lm_console.engine")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self.endpoint = endpoint
        self._closed = False

    def record(self, attributes: dict[str, Any], start_time: float, end_time: float,
               trace_headers: Mapping[str, str] | None = None) -> None:
        """Queue one finished request's span (start at arrival, end at finish; time.time() seconds)."""
        context = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._kind, attributes=attributes,
                                       start_time=int(start_time * 1e9))
        span.end(end_time=int(end_time * 1e9))

    def shutdown(self) -> None:
        """Export what is queued and stop the export thread (idempotent).

        An unreachable collector makes the exporter retry for its whole timeout: the flush runs on
        a daemon thread and the engine's shutdown waits for it at most SHUTDOWN_WAIT_S.
        """
        if self._closed:
            return
        self._closed = True

        def flush() -> None:
            try:
                self._provider.shutdown()
            except Exception:  # a collector gone at exit must not fail the engine's shutdown
                logger.warning("OTLP tracer shutdown failed", exc_info=True)

        thread = threading.Thread(target=flush, name="lmc-otlp-shutdown", daemon=True)
        thread.start()
        thread.join(SHUTDOWN_WAIT_S)
        if thread.is_alive():
            logger.warning("spans not yet exported to %s after %.0f s at shutdown were dropped",
                           self.endpoint, SHUTDOWN_WAIT_S)


def make_tracer(config: ObservabilityConfig) -> RequestTracer | None:
    """The engine's RequestTracer when tracing is on (otlp_traces_endpoint), else None."""
    if config.otlp_traces_endpoint is None:
        return None
    logger.info("exporting one %r span per finished request to %s (OTLP/HTTP)", SPAN_NAME, config.otlp_traces_endpoint)
    return RequestTracer(config.otlp_traces_endpoint)
