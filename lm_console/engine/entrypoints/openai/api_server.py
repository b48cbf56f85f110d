"""The OpenAI-compatible server: build_app(engine, settings) -> FastAPI, and run_server.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
POST /v1/embeddings, POST /tokenize, POST /detokenize, POST /invocations (SageMaker's single route:
dispatched on the body's shape to the route that serves it), the console stream's /lmc/v1/...
(lm_console/engine/entrypoints/console_stream.py; all
behind require_api_key), and the open GET /health, /version, /metrics.
ServerGate (gate.py) answers 401 / 408 / 413 / 503 before a route runs (the key is checked
before the body is read); the routes parse their own bodies off the event loop (400 for a content
type other than application/json, as vLLM; 422 for not-JSON, 400 naming the field or the limit),
and every exception becomes an OpenAI-shaped error.
A watchdog task marks the server dead within 0.1 s of the engine core's death; lifecycle.py
then stops it with exit code 1, and drains it on SIGINT / SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from lm_console.engine import envs

from lm_console.engine.entrypoints.console_protocol import STREAM_PATH
from lm_console.engine.entrypoints.console_stream import build_console_router
from lm_console.engine.entrypoints.openai import errors
from lm_console.engine.entrypoints.openai.auth import require_api_key
from lm_console.engine.entrypoints.openai.errors import OpenAIError
from lm_console.engine.entrypoints.openai.gate import ServerGate, ServerState
from lm_console.engine.entrypoints.openai.lifecycle import ApiServer
from lm_console.engine.entrypoints.openai.metrics import HttpRequestsMiddleware, make_stat_logger
from lm_console.engine.entrypoints.openai.protocol import (
    CompletionRequest, collect_ignored_fields, DetokenizeRequest, ModelCard, ModelList, TokenizeCompletionRequest,
)
from lm_console.engine.entrypoints.openai.protocol_chat import ChatCompletionRequest, TokenizeChatRequest
from lm_console.engine.entrypoints.openai.protocol_responses import ResponsesRequest
from lm_console.engine.entrypoints.openai.serving_chat import OpenAIServingChat
from lm_console.engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from lm_console.engine.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from lm_console.engine.entrypoints.openai.serving_engine import ClientDisconnected, ServingContext
from lm_console.engine.entrypoints.openai.serving_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from lm_console.engine.entrypoints.openai.serving_responses import OpenAIServingResponses
from lm_console.engine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from lm_console.engine.entrypoints.openai.settings import ServerSettings
from lm_console.engine.version import __version__

if TYPE_CHECKING:
    from lm_console.engine.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


# Bodies up to this size are parsed on the event loop (a thread hop costs more); larger ones in
# the serving pool, so that no client's megabytes of JSON stall the other requests.
INLINE_PARSE_BYTES = 64 << 10
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_json_content_type(raw_request: Request) -> None:
    """400 (vLLM's status) unless the body is declared as application/json; checked before it is read."""
    declared = raw_request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = repr(declared[:80]) if declared else "none"
        raise errors.bad_request(f"Unsupported Media Type: only 'application/json' is allowed (got {shown}).",
                                 code="unsupported_media_type")


async def parse_body(raw_request: Request, model: type[BaseModel] | Callable[[dict], type[BaseModel]],
                     ctx: ServingContext) -> Any:
    """The JSON body as `model` (or as the model chosen from the decoded object): 400 when it is
    not declared as JSON, 422 when it is not JSON, 400 when a field is wrong or the JSON is
    hostile (too deep, huge numbers, lone surrogates)."""
    check_json_content_type(raw_request)
    body = await raw_request.body()
    if len(body) <= INLINE_PARSE_BYTES:
        return decode_body(body, model)
    return await ctx.offload(decode_body, body, model)


def decode_body(body: bytes, model: type[BaseModel] | Callable[[dict], type[BaseModel]]) -> Any:
    """parse_body's work, callable from any thread."""
    data = decode_json_object(body)
    chosen: type[BaseModel] = model if isinstance(model, type) else model(data)
    try:
        with collect_ignored_fields():  # one warning line per body, however many models it nests
            return chosen.model_validate(data)
    except ValidationError as error:
        raise errors.from_validation_error(error) from error
    except RecursionError:
        raise errors.bad_request("The request body's JSON is nested too deeply.", code="invalid_json") from None


def decode_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the OpenAIError that says why it is not one."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OpenAIError(HTTPStatus.UNPROCESSABLE_ENTITY, f"The request body is not valid JSON: {error}.",
                          code="invalid_json") from error
    except RecursionError:
        raise errors.bad_request("The request body's JSON is nested too deeply.", code="invalid_json") from None
    except ValueError as error:  # an integer beyond Python's digit limit (sys.get_int_max_str_digits)
        raise errors.bad_request(f"The request body has a number too long to read: {error}.",
                                 code="invalid_json") from None
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(body):  # escaped UTF-16 halves: fine in pairs, not alone
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as error:
            raise errors.bad_request(
                "The request body has a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), which is "
                f"not text: {error.reason}.", code="invalid_json") from None
    return data


async def answer(work: Any, prompt_param: str = "prompt") -> Any:
    """Await a handler's work; map whatever it raises to an OpenAIError."""
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except OpenAIError:
        raise
    except Exception as error:  # noqa: BLE001 - every request gets an OpenAI-shaped answer
        raise errors.from_exception(error, prompt_param) from error


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over a started AsyncLLM (the caller owns the engine and shuts it down)."""
    state = ServerState()
    ctx = ServingContext(engine, settings, state)
    for name, path in settings.lora_modules:  # checked now: a bad adapter stops the start
        ctx.loras.add(name, path)
    stat_logger = make_stat_logger(engine, ctx.served_model_names[0])
    engine.add_stat_logger(stat_logger)
    ctx.on_aborted = stat_logger.record_aborted
    completion, chat = OpenAIServingCompletion(ctx), OpenAIServingChat(ctx)
    tokenization = OpenAIServingTokenization(ctx)
    responses = OpenAIServingResponses(ctx)
    embedding = OpenAIServingEmbedding(ctx)
    console = build_console_router(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watchdog = asyncio.create_task(_watch_engine(app), name="engine-watchdog")
        try:
            yield
        finally:
            watchdog.cancel()
            console.console_hub.close()  # type: ignore[attr-defined]
            await ctx.media.aclose()
            ctx.close()

    app = FastAPI(title="lm-console OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.server_state = state
    app.state.ctx = ctx
    app.state.engine = engine
    app.state.stat_logger = stat_logger
    app.state.console_hub = console.console_hub  # type: ignore[attr-defined]  # closed when the server stops
    app.state.on_engine_dead = None  # set by ApiServer: stops the server after dead_exit_delay_s
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.engine_dead or engine.errored:
            raise errors.engine_dead(str(engine.dead_error or ""))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        await stat_logger.refresh(engine)
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    api = APIRouter(dependencies=[Depends(require_api_key)])

    @api.get("/v1/models")
    async def show_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=engine.config.model_config.model_dir, max_model_len=ctx.max_model_len)
                 for name in ctx.served_model_names]
        cards += [ModelCard(id=name, root=lora.lora_path, parent=ctx.served_model_names[0],
                            max_model_len=ctx.max_model_len) for name, lora in ctx.loras.items()]
        return JSONResponse(ModelList(data=cards).model_dump())

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING.get().lower() in ("1", "true"):
        @api.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw_request: Request) -> Response:
            request = await parse_body(raw_request, LoadLoRAAdapterRequest, ctx)
            await answer(ctx.offload(ctx.loras.add, request.lora_name, request.lora_path))
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

        @api.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw_request: Request) -> Response:
            request = await parse_body(raw_request, UnloadLoRAAdapterRequest, ctx)
            await answer(ctx.offload(ctx.loras.remove, request.lora_name, request.lora_int_id))
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    @api.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest, ctx)
        return await answer(completion.create(request, raw_request))

    @api.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest, ctx)
        return await answer(chat.create(request, raw_request), prompt_param="messages")

    @api.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ResponsesRequest, ctx)
        return await answer(responses.create(request, raw_request), prompt_param="input")

    @api.post("/v1/embeddings")
    async def create_embedding(raw_request: Request) -> Response:
        request = await parse_body(raw_request, EmbeddingRequest, ctx)
        return await answer(embedding.create(request, raw_request), prompt_param="input")

    @api.post("/tokenize")
    async def tokenize(raw_request: Request) -> Response:
        request = await parse_body(
            raw_request, lambda data: TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, ctx)
        result = await answer(tokenization.tokenize(request))
        return Response(result.model_dump_json(), media_type="application/json")

    @api.post("/detokenize")
    async def detokenize(raw_request: Request) -> Response:
        request = await parse_body(raw_request, DetokenizeRequest, ctx)
        result = await answer(tokenization.detokenize(request))
        return Response(result.model_dump_json(), media_type="application/json")

    @api.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        check_json_content_type(raw_request)
        body = await raw_request.body()
        data = decode_json_object(body) if len(body) <= INLINE_PARSE_BYTES else \
            await ctx.offload(decode_json_object, body)
        path = invocation_path(data)
        endpoint = _post_endpoint(api, path)
        if endpoint is None:
            raise errors.bad_request(f"/invocations: this server has no {path} route for this request.")
        return await endpoint(raw_request)  # the body stays cached on raw_request: read again there

    app.include_router(api)
    app.include_router(console, dependencies=[Depends(require_api_key)])
    # A console stream holds no engine request: a drain does not wait for it (the server closes
    # the console hub when it stops, which ends the streams).
    app.add_middleware(ServerGate, state=state, max_body=settings.max_request_body, uncounted=frozenset({STREAM_PATH}),
                       api_key=settings.api_key, body_timeout_s=settings.body_timeout_s)
    app.add_middleware(HttpRequestsMiddleware, registry=stat_logger.registry)  # added last: outermost
    return app


# /invocations: the field that tells each request shape apart, and the route that serves it (in
# vLLM's order: a body with messages is a chat, even if it has a prompt too).
INVOCATION_ROUTES = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"), ("input", "/v1/embeddings"))


def invocation_path(data: dict[str, Any]) -> str:
    """The route an /invocations body goes to; 400 when its shape is none of them."""
    for field, path in INVOCATION_ROUTES:
        if field in data:
            return path
    expected = ", ".join(f"'{field}' ({path})" for field, path in INVOCATION_ROUTES)
    raise errors.bad_request(f"Cannot find a suitable handler for this /invocations request: its body must have "
                             f"one of {expected}.")


def _post_endpoint(router: APIRouter, path: str) -> Callable[[Request], Any] | None:
    for route in router.routes:
        if getattr(route, "path", None) == path and "POST" in (getattr(route, "methods", None) or ()):
            return route.endpoint  # type: ignore[attr-defined]
    return None


def _install_error_handlers(app: FastAPI) -> None:
    def respond(error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return respond(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == HTTPStatus.NOT_FOUND:
            message = f"No route {request.method} {request.url.path}; see /docs for the API."
            return respond(OpenAIError(error.status_code, message, code="not_found"))
        return respond(OpenAIError(error.status_code, str(error.detail), code=None))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return respond(errors.bad_request(f"Invalid request: {error.errors()}"))


async def _watch_engine(app: FastAPI) -> None:
    """Mark the server dead as soon as the engine core dies, then tell the ApiServer."""
    engine, state = app.state.engine, app.state.server_state
    while not engine.errored:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    state.engine_dead = True
    state.dead_reason = str(engine.dead_error or "")
    logger.error("The engine core died (%s); answering 503 and exiting.", state.dead_reason)
    callback = app.state.on_engine_dead
    if callback is not None:
        callback()


def run_server(engine: AsyncLLM, settings: ServerSettings, on_ready: Callable[[str], None] | None = None) -> int:
    """Serve in this thread until a signal drains the server or the engine dies, then shut the
    engine down; returns the exit code (0 drained, 1 engine died)."""
    try:
        server = ApiServer(build_app(engine, settings), settings)
        return asyncio.run(server.run(on_ready))
    finally:
        engine.shutdown()
