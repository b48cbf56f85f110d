"""A stand-in for another OpenAI-compatible server (vLLM-like): /v1 routes with SSE, /metrics, no /lmc.

Replies echo a fixed word list, one word per SSE chunk, as OpenAI streams them; /metrics is
real Prometheus text (prometheus-client) under vLLM's names, with values the test sets.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

MODEL = "standin-model"
WORDS = ["Hello", " from", " the", " stand", "-in", " server", "."]


@dataclass
class StandinState:
    """What the stand-in saw and what its /metrics report."""

    api_key: str | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    num_closed_early: int = 0  # streams the client closed before the end
    chunk_delay_s: float = 0.0
    num_words: int = len(WORDS)
    metrics: bool = True
    fail_stream_after: int | None = None  # drop the connection after this many chunks
    in_flight: int = 0
    max_in_flight: int = 0
    metrics_text: str | None = None  # served as /metrics instead of the registry's (a real server's text)


def _metrics_registry() -> tuple[CollectorRegistry, dict[str, Any]]:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = {name: Gauge(name, name, labels, registry=registry) for name in
              ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    counters = {name: Counter(name, name, labels, registry=registry) for name in
                ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:prompt_tokens", "vllm:generation_tokens")}
    info = Gauge("vllm:cache_config_info", "cache config", ["block_size", "cache_dtype", "num_gpu_blocks"],
                 registry=registry)
    info.labels("16", "auto", "2048").set(1)
    return registry, {**gauges, **counters}


def standin_app(state: StandinState) -> FastAPI:
    """The stand-in's routes; `app.state.metrics` holds its gauges and counters by vLLM name."""
    app = FastAPI()
    registry, metrics = _metrics_registry()
    app.state.metrics = metrics

    def authorized(request: Request) -> bool:
        return state.api_key is None or request.headers.get("authorization") == f"Bearer {state.api_key}"

    def unauthorized() -> JSONResponse:
        return JSONResponse({"error": {"message": "Unauthorized", "type": "AuthenticationError", "param": None,
                                       "code": 401}}, status_code=401)

    @app.get("/v1/models")
    async def models(request: Request):  # noqa: ANN202
        if not authorized(request):
            return unauthorized()
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL, "max_model_len": 2048}]}

    @app.get("/health")
    async def health():  # noqa: ANN202
        return PlainTextResponse("")

    @app.get("/metrics")
    async def prometheus():  # noqa: ANN202
        if not state.metrics:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(state.metrics_text or generate_latest(registry).decode())

    async def completion(request: Request, chat: bool):  # noqa: ANN202
        if not authorized(request):
            return unauthorized()
        body = await request.json()
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        if body.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1, got "
                                           f"{body['max_tokens']}.", "type": "BadRequestError", "param": "max_tokens",
                                           "code": 400}}, status_code=400)
        words = (WORDS * 10)[: min(state.num_words, int(body.get("max_tokens") or 16))]
        kind = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 5 + len(words),
                 "prompt_tokens_details": {"cached_tokens": 3}}
        if not body.get("stream"):
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            await asyncio.sleep(state.chunk_delay_s)
            state.in_flight -= 1
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            return {"id": "cmpl-1", "object": kind, "created": int(time.time()), "model": MODEL,
                    "choices": [choice], "usage": usage}

        async def events():  # noqa: ANN202
            finished = False
            try:
                for i, word in enumerate(words):
                    if state.fail_stream_after is not None and i >= state.fail_stream_after:
                        raise RuntimeError("the stand-in drops the connection")
                    await asyncio.sleep(state.chunk_delay_s)
                    last = i == len(words) - 1
                    choice = ({"index": 0, "delta": {"content": word}, "finish_reason": "length" if last else None}
                              if chat else {"index": 0, "text": word, "finish_reason": "length" if last else None})
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'object': kind + '.chunk', 'choices': [choice]})}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    state.num_closed_early += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # noqa: ANN202
        return await completion(request, chat=True)

    return app


def set_metrics(app: FastAPI, **values: float) -> None:
    """Set gauges (running=..., waiting=..., usage=...) or add to counters (prompt_tokens=... etc.)."""
    metrics = app.state.metrics
    names = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "usage": "vllm:kv_cache_usage_perc"}
    for key, value in values.items():
        name = names.get(key, f"vllm:{key}")
        metric = metrics[name].labels(MODEL, "0")
        if name in names.values():
            metric.set(value)
        else:
            metric.inc(value)


if __name__ == "__main__":  # `python openai_standin.py PORT`: the stand-in as a process (launcher tests)
    import sys

    import uvicorn

    uvicorn.run(standin_app(StandinState()), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
