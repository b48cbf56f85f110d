"""`lmc bench serve` over HTTP: streaming /v1/completions against any OpenAI-compatible server.

Measures as `vllm bench serve` does with its openai backend: TTFT at the first chunk with
choices, one ITL per later chunk, E2EL at the last chunk, output tokens from the final usage.
Prompts are token ids (the random and shared-prefix datasets), so no tokenizer is needed here.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from lm_console.bench.datasets import BenchRequest
from lm_console.bench.trace import TraceRecord, replay_requests, save_trace, trace_of
from lm_console.bench.serve import RequestResult, Send, run_requests, serve_metrics, serve_summary
from lm_console.client.openai_http import auth_headers, error_message
from lm_console.client.sse import iter_sse

SAFE_VOCAB = 1000  # token ids below this exist in any real vocabulary (when the server does not say)


def http_sender(http: httpx.AsyncClient, base_url: str, model: str) -> Send:
    """Send one request as a streaming completion of its prompt token ids, filling its result."""

    async def send(index: int, request: BenchRequest, result: RequestResult) -> None:
        body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
                "temperature": 1.0, "top_p": 1.0, "seed": index, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        num_chunks = 0
        usage_tokens: int | None = None
        result.start_time = last = time.perf_counter()
        async with http.stream("POST", base_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                message = error_message(await response.aread(), response.status_code)
                result.error = f"HTTP {response.status_code}: {message}"
                return
            async for event in iter_sse(response.aiter_lines()):
                if event.data.strip() == "[DONE]":
                    break
                data = json.loads(event.data)
                if "error" in data:
                    result.error = error_message(event.data, 500)
                    return
                if data.get("choices"):
                    last = time.perf_counter()
                    result.record_tokens(last)
                    num_chunks += 1
                    result.generated_text += data["choices"][0].get("text") or ""
                elif data.get("usage"):
                    usage_tokens = int(data["usage"].get("completion_tokens") or 0)
        result.latency = last - result.start_time
        result.output_len = usage_tokens if usage_tokens is not None else num_chunks
        result.success = result.output_len > 0
        if not result.success:
            result.error = "no tokens generated"

    return send


async def server_facts(http: httpx.AsyncClient, base_url: str) -> tuple[str, int]:
    """(served model name, vocabulary size for the random prompts) of the server."""
    from lm_console.batch_remote import served_model

    model = await served_model(http, base_url)
    vocab_size = SAFE_VOCAB
    try:
        info = await http.get(base_url + "/lmc/v1/info")
        if info.status_code == 200 and info.json().get("server") == "lm-console":
            vocab_size = int(info.json().get("vocab_size") or SAFE_VOCAB)
    except (httpx.HTTPError, ValueError):
        pass
    return model, vocab_size


async def measure_http(base_url: str, api_key: str | None, model: str | None, workload: Any, rate: float,
                       burstiness: float, max_concurrency: int | None, progress: bool,
                       replay: list[TraceRecord] | None = None,
                       ) -> tuple[str, list[BenchRequest], list[RequestResult], float]:
    """Warm up with two requests, then run the workload (or replay the trace at its pace);
    (model, requests, results, duration)."""
    base_url = base_url.rstrip("/")
    connections = max_concurrency or max(len(replay) if replay else workload.num_prompts, 1)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), limits=limits,
                                 headers=auth_headers(api_key)) as http:
        served, vocab_size = await server_facts(http, base_url)
        model = model or served
        offsets = None
        if replay is not None:
            requests, offsets = replay_requests(replay, vocab_size)
        else:
            requests = workload.build(vocab_size)
        send = http_sender(http, base_url, model)
        await run_requests(send, requests[:2], float("inf"), 1.0, None, progress=False)  # warm-up
        results, duration = await run_requests(send, requests, rate, burstiness, max_concurrency, workload.seed,
                                               progress, offsets)
    return model, requests, results, duration


def bench_serve_http(base_url: str, api_key: str | None, model: str | None, workload: Any, save_path: str | None,
                     rate: float, burstiness: float, max_concurrency: int | None, percentile_metrics: list[str],
                     percentiles: list[float], progress: bool = True, label: str | None = None,
                     save_trace_path: str | None = None, replay: list[TraceRecord] | None = None) -> int:
    """The serving benchmark against `base_url`; prints vLLM's summary, saves its JSON keys (and the
    requests' trace with save_trace_path); returns failures. `replay`: a trace's requests at its pace."""
    from lm_console.bench.report import save_result

    served, requests, results, duration = asyncio.run(measure_http(
        base_url, api_key, model, workload, rate, burstiness, max_concurrency, progress, replay))
    if save_trace_path:
        # What was sent and when; the output lengths the server generated (the asked ones if it failed).
        save_trace(save_trace_path, trace_of(requests, [r.arrival_time for r in results],
                                             [r.output_len or q.output_len for r, q in zip(results, requests)]))
    metrics = serve_metrics(results, duration, percentile_metrics, percentiles)
    print("\n".join(serve_summary(metrics, max_concurrency, rate, percentile_metrics, percentiles)), flush=True)
    result = {"endpoint_type": "openai", "backend": "openai", "label": label, "base_url": base_url,
              "model_id": served, "tokenizer_id": served, "num_prompts": len(requests),
              "request_rate": rate if rate != float("inf") else "inf", "burstiness": burstiness,
              "max_concurrency": max_concurrency,
              "dataset_name": "trace" if replay is not None else workload.dataset_name, **metrics}
    save_result(save_path, result)
    return metrics["failed"]
