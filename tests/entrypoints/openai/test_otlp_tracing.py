"""`lmc serve --otlp-traces-endpoint`: an in-test OTLP/HTTP collector receives one "llm_request" span per request.

The collector is a plain HTTP server accepting OTLP/HTTP protobuf on /v1/traces and decoding each
body with opentelemetry-proto's ExportTraceServiceRequest. A real `lmc serve` is driven by the
official openai client; each span's attributes must equal that request's own figures: token counts
exactly (the response's usage), sampling knobs as sent, latencies equal to the per-request figures
the server's Prometheus histograms recorded for it (one request at a time, so a histogram's _sum
moves by exactly that request's value), and the client's traceparent as the span's parent.
"""

from __future__ import annotations

import gzip
import secrets
import socket
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from lm_console.engine.errors import InvalidEngineArgsError
from openai_server_helpers import ServeProcess, parse_metrics

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

# Float sums in the Prometheus text round-trip exactly (repr); a difference of two sums can be off
# by a few ulps of the sum, far below this.
LATENCY_TOLERANCE_S = 1e-9
# The span's start/end are nanosecond integers from float seconds (~1.7e18 ns: a double's ulp there
# is 256 ns), so its duration matches e2e to about a microsecond.
SPAN_TIME_TOLERANCE_S = 2e-6
SPAN_WAIT_S = 60.0  # the batch span processor exports every few seconds

# Span attribute -> the server's per-request histogram for the same figure.
LATENCY_HISTOGRAMS = {
    "gen_ai.latency.time_to_first_token": "vllm:time_to_first_token_seconds",
    "gen_ai.latency.e2e": "vllm:e2e_request_latency_seconds",
    "gen_ai.latency.time_in_queue": "vllm:request_queue_time_seconds",
    "gen_ai.latency.time_in_model_prefill": "vllm:request_prefill_time_seconds",
    "gen_ai.latency.time_in_model_decode": "vllm:request_decode_time_seconds",
    "gen_ai.latency.time_in_model_inference": "vllm:request_inference_time_seconds",
}


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with collector.lock:
                    for resource_spans in request.resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            collector.spans.extend(scope_spans.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout: float = SPAN_WAIT_S) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.1)
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes_of(span: Any) -> dict[str, Any]:
    """A span's attributes as Python values (OTLP's AnyValue: string, int, double or bool)."""
    values: dict[str, Any] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        values[kv.key] = getattr(kv.value, kind)
    return values


def histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """(_sum, _count) of each latency histogram on the server's /metrics."""
    families = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    sums = {}
    for name in LATENCY_HISTOGRAMS.values():
        family = families[name]
        total = sum(s.value for s in family.samples if s.name == name + "_sum")
        count = sum(s.value for s in family.samples if s.name == name + "_count")
        sums[name] = (total, count)
    return sums


def per_request_figures(url: str, before: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The one request's figures since `before`: each histogram's _sum moved by exactly its value.

    The stat logger folds a finished request in shortly after the response: wait until every
    histogram counted it.
    """
    deadline = time.monotonic() + 30
    while True:
        after = histogram_sums(url)
        if all(after[name][1] == before[name][1] + 1 for name in after):
            return {name: after[name][0] - before[name][0] for name in after}
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.1)


def latency_mismatches(attributes: dict[str, Any], figures: dict[str, float],
                       mapping: dict[str, str]) -> list[str]:
    """Where the span's latency attributes differ from the server's per-request figures."""
    return [f"{attribute}={attributes.get(attribute)!r} but {histogram} recorded {figures[histogram]!r}"
            for attribute, histogram in mapping.items()
            if attribute not in attributes or abs(attributes[attribute] - figures[histogram]) > LATENCY_TOLERANCE_S]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_spans_match_each_requests_figures_and_parent(tiny_llama_dir) -> None:
    from openai import OpenAI

    collector = Collector()
    server = ServeProcess(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "128",
                          "--num-threads", "1", "--otlp-traces-endpoint", collector.url)
    try:
        assert f"request spans to {collector.url}" in server.output
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        trace_id, parent_span_id = secrets.token_hex(16), secrets.token_hex(8)
        traceparent = f"00-{trace_id}-{parent_span_id}-01"

        before = histogram_sums(server.url)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me about the history of computing."}],
            max_tokens=7, temperature=0.7, top_p=0.9, seed=1, extra_headers={"traceparent": traceparent})
        chat_figures = per_request_figures(server.url, before)

        before = histogram_sums(server.url)
        completion = client.completions.create(model=model, prompt="The history of computing", max_tokens=5,
                                               temperature=0.0)
        completion_figures = per_request_figures(server.url, before)

        spans = collector.wait_for(2)
        assert len(spans) == 2, [attributes_of(s) for s in spans]
        by_id = {attributes_of(s)["gen_ai.request.id"]: s for s in spans}
        assert set(by_id) == {chat.id, f"{completion.id}-0"}, by_id.keys()  # completions: one engine request per prompt

        for span, response, figures, params in (
                (by_id[chat.id], chat, chat_figures, {"max_tokens": 7, "temperature": 0.7, "top_p": 0.9}),
                (by_id[f"{completion.id}-0"], completion, completion_figures,
                 {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0})):
            attributes = attributes_of(span)
            assert span.name == "llm_request"
            assert span.kind == span.SPAN_KIND_SERVER
            assert attributes["gen_ai.usage.prompt_tokens"] == response.usage.prompt_tokens
            assert attributes["gen_ai.usage.completion_tokens"] == response.usage.completion_tokens
            assert attributes["gen_ai.request.max_tokens"] == params["max_tokens"]
            assert attributes["gen_ai.request.temperature"] == params["temperature"]
            assert attributes["gen_ai.request.top_p"] == params["top_p"]
            assert attributes["gen_ai.request.n"] == 1
            assert not latency_mismatches(attributes, figures, LATENCY_HISTOGRAMS), latency_mismatches(
                attributes, figures, LATENCY_HISTOGRAMS)
            # The span runs from arrival to finish: its duration is the e2e latency.
            duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
            assert abs(duration - attributes["gen_ai.latency.e2e"]) < SPAN_TIME_TOLERANCE_S
            # Negative control: a wrong mapping (phases swapped) must fail the same comparison.
            swapped = dict(LATENCY_HISTOGRAMS)
            swapped["gen_ai.latency.time_in_model_prefill"] = LATENCY_HISTOGRAMS["gen_ai.latency.time_in_model_decode"]
            swapped["gen_ai.latency.time_in_model_decode"] = LATENCY_HISTOGRAMS["gen_ai.latency.time_in_model_prefill"]
            swapped["gen_ai.latency.time_to_first_token"] = LATENCY_HISTOGRAMS["gen_ai.latency.e2e"]
            assert len(latency_mismatches(attributes, figures, swapped)) == 3

        # The client's traceparent is the chat span's parent; the other request starts its own trace.
        chat_span = by_id[chat.id]
        assert chat_span.trace_id.hex() == trace_id
        assert chat_span.parent_span_id.hex() == parent_span_id
        other = by_id[f"{completion.id}-0"]
        assert other.parent_span_id == b"" and other.trace_id.hex() != trace_id
    finally:
        server.stop()
        collector.close()


def test_endpoint_is_validated() -> None:
    from lm_console.engine.config import ObservabilityConfig

    assert ObservabilityConfig().otlp_traces_endpoint is None
    assert ObservabilityConfig("http://localhost:4318/v1/traces").tracing_enabled
    for bad in ("localhost:4317", "grpc://localhost:4317", "http://", 4318):
        with pytest.raises(InvalidEngineArgsError, match="otlp_traces_endpoint"):
            ObservabilityConfig(bad)  # type: ignore[arg-type]


def test_missing_opentelemetry_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from lm_console.engine.config import EngineArgs, ObservabilityConfig

    real_find_spec = importlib.util.find_spec

    def without_otel(name: str, *args: Any) -> Any:
        return None if name.startswith("opentelemetry") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_otel)
    with pytest.raises(InvalidEngineArgsError, match=r"lm-console\[otel\]"):
        ObservabilityConfig("http://localhost:4318/v1/traces")
    with pytest.raises(InvalidEngineArgsError, match=r"lm-console\[otel\]"):
        EngineArgs(otlp_traces_endpoint="http://localhost:4318/v1/traces").create_observability_config()
    assert ObservabilityConfig(None).otlp_traces_endpoint is None  # no endpoint: nothing needed


def test_serve_refuses_a_bad_endpoint_before_starting_the_engine(tiny_llama_dir) -> None:
    import subprocess
    import sys

    from openai_server_helpers import REPO_ROOT

    done = subprocess.run([sys.executable, "-m", "lm_console.cli", "serve", str(tiny_llama_dir), "--port",
                           str(free_port()), "--otlp-traces-endpoint", "grpc://localhost:4317"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "otlp_traces_endpoint='grpc://localhost:4317' is invalid" in done.stderr


@pytest.mark.slow
def test_offline_llm_traces_each_request(tiny_llama_dir) -> None:
    """LLM(otlp_traces_endpoint=...): one span per prompt, equal to its RequestOutput's own metrics."""
    from lm_console.engine import LLM, SamplingParams

    collector = Collector()
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              num_threads=1, multiprocess=False, otlp_traces_endpoint=collector.url)
    try:
        outputs = llm.generate(["The history of computing", "Once upon a time there was"],
                               SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()  # flushes the batch span processor
    try:
        spans = collector.wait_for(2)
        assert len(spans) == 2
        by_id = {attributes_of(s)["gen_ai.request.id"]: attributes_of(s) for s in spans}
        assert set(by_id) == {o.request_id for o in outputs}
        for output in outputs:
            attributes, metrics = by_id[output.request_id], output.metrics
            assert attributes["gen_ai.usage.prompt_tokens"] == len(output.prompt_token_ids)
            assert attributes["gen_ai.usage.completion_tokens"] == len(output.outputs[0].token_ids) == 4
            assert attributes["gen_ai.latency.e2e"] == metrics.e2e_latency
            assert attributes["gen_ai.latency.time_to_first_token"] == metrics.time_to_first_token
            assert attributes["gen_ai.latency.time_in_queue"] == metrics.queue_time
            # Negative control: another request's figure differs (the comparison is not vacuous).
            other = next(o for o in outputs if o.request_id != output.request_id)
            assert attributes["gen_ai.latency.e2e"] != other.metrics.e2e_latency
    finally:
        collector.close()
