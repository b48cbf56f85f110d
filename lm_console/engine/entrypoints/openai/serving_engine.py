"""What the completion and chat endpoints share: the context, engine requests, SSE, disconnects.

EngineRequest splits AsyncLLM.generate in two: start() validates and sends the request (so a
bad request is an HTTP 400, not an event in a 200 stream), then iterating yields its outputs.
Leaving the iteration early (a client that disconnects, a drain that runs out of time) aborts
the request in the engine core, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from lm_console.engine.entrypoints.openai.errors import bad_request, from_exception
from lm_console.engine.entrypoints.openai.gate import ServerState
from lm_console.engine.entrypoints.openai.media import MediaLoader
from lm_console.engine.entrypoints.openai.protocol import SamplingFields, check_model
from lm_console.engine.entrypoints.openai.serving_lora import LoRAModules
from lm_console.engine.entrypoints.openai.settings import ServerSettings
from lm_console.engine.outputs import RequestOutput
from lm_console.engine.entrypoints.openai.structured_outputs import to_structured_outputs_params
from lm_console.engine.errors import InvalidPromptError
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from fastapi import Request

    from lm_console.engine.frontend.async_llm import AsyncLLM

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
# Threads for the work whose cost grows with a client's input (JSON parsing, tokenising, chat
# templates, image decoding): never on the event loop, and at most this many at once, so a burst
# of large requests queues here instead of taking every core and the memory of each at once.
SERVING_POOL_THREADS = 2


class ClientDisconnected(Exception):
    """The client closed its connection before the response was ready."""


class ServingContext:
    """The engine, the settings and the shared state every endpoint uses."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, state: ServerState) -> None:
        self.engine = engine
        self.settings = settings
        self.state = state
        self.media = MediaLoader(settings)
        self.pool = ThreadPoolExecutor(max_workers=SERVING_POOL_THREADS, thread_name_prefix="lmc-serve")
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len: int = engine.config.model_config.max_model_len
        self.served_model_names = list(settings.served_model_names) or [engine.config.model_config.model_name]
        self.loras = LoRAModules(engine, self.served_model_names)  # --lora-modules and runtime loads
        # Told how many engine requests ended by abort (client gone, drain timeout): the
        # frontend never sees their final step, so the metrics learn of them here.
        self.on_aborted: Callable[[int], None] | None = None

    def model_name(self, requested: str | None) -> str:
        """The model to answer with: a served name or a LoRA adapter's; 404 for any other."""
        if requested is not None and self.loras.get(requested) is not None:
            return requested
        return check_model(requested, self.served_model_names + self.loras.names())

    def lora_for(self, model: str) -> LoRARequest | None:
        """The adapter a request's (checked) model name selects; None for the base model."""
        return self.loras.get(model)

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in the serving pool (off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def check_prompt_text(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit max_model_len tokens, untokenised (the engine's bound; 400)."""
        try:
            self.engine.input_processor.check_prompt_text(text)
        except InvalidPromptError as error:
            raise bad_request(str(error), param, "context_length_exceeded") from None

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Tokenise after the length check (call it in the pool: offload)."""
        self.check_prompt_text(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def count_aborted(self, num_requests: int) -> None:
        if self.on_aborted is not None:
            self.on_aborted(num_requests)


class EngineRequest:
    """One request in the engine: start() it, then `async for output in request`."""

    def __init__(self, ctx: ServingContext, request_id: str, prompt: Any, params: SamplingParams,
                 cache_salt: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None,
                 trace_headers: Mapping[str, str] | None = None) -> None:
        self.ctx = ctx
        self.lora_request = lora_request
        self.priority = priority
        self.trace_headers = trace_headers  # the client's traceparent: the parent of the request's span
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.cache_salt = cache_salt
        self._collector: Any = None
        self.finished = False

    async def start(self) -> None:
        """Validate and send; raises the engine's error (mapped to 400 by the caller)."""
        self._collector = await self.ctx.engine.add_request(self.request_id, self.prompt, self.params,
                                                            self.cache_salt, self.priority,
                                                            lora_request=self.lora_request,
                                                            trace_headers=self.trace_headers)
        self.ctx.state.request_ids.add(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        collector = self._collector
        assert collector is not None, "start() first"
        try:
            while not self.finished:
                output = collector.get_nowait() or await collector.get()
                self.finished = output.finished
                if self.finished and any(c.finish_reason == "abort" for c in output.outputs):
                    self.ctx.count_aborted(self.params.n)  # aborted by the server's drain
                yield output
        finally:
            self.close()

    def close(self) -> None:
        """Forget the request; abort it in the engine unless it finished (idempotent)."""
        self.ctx.state.request_ids.discard(self.request_id)
        if self._collector is not None and not self.finished:
            self.finished = True
            self.ctx.engine.abort_nowait(self.request_id)
            self.ctx.count_aborted(self.params.n)


async def start_all(requests: list[EngineRequest]) -> None:
    """Start every request; if one is refused, close the ones already started and re-raise."""
    try:
        for request in requests:
            await request.start()
    except BaseException:
        close_all(requests)
        raise


async def merge(requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the request, output) from several running requests, as they arrive."""
    if len(requests) == 1:
        async for output in requests[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, request: EngineRequest) -> None:
        try:
            async for output in request:
                queue.put_nowait((index, output))
        except Exception as error:  # noqa: BLE001 - handed to the consumer (cancellation is not)
            queue.put_nowait((index, error))
            return
        queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        close_all(requests)


async def until_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that closes its engine requests however it ends.

    The events generator closes them too, but a client that disconnects before the first event
    is sent cancels the response before the generator ever runs.
    """

    def __init__(self, events: AsyncIterator[str], requests: list[EngineRequest]) -> None:
        super().__init__(guarded_stream(events), media_type="text/event-stream")
        self.requests = requests

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.requests)


def close_all(requests: list[EngineRequest]) -> None:
    """Abort whatever has not finished (idempotent)."""
    for request in requests:
        request.close()


def sse(payload: BaseModel | dict[str, Any], exclude_unset: bool = True) -> str:
    """One server-sent event frame, exactly as OpenAI sends it."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_unset=exclude_unset)
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(error: BaseException) -> str:
    """The error event that ends a stream (followed by [DONE])."""
    return f"data: {json.dumps(from_exception(error).body())}\n\n"


async def guarded_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; an error mid-stream becomes an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as error:  # noqa: BLE001 - every stream ends with an answer
        yield sse_error(error)
        yield SSE_DONE


def make_sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                         stream: bool, prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams from the shared fields (the engine validates the ranges)."""
    return SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        presence_penalty=0.0 if request.presence_penalty is None else request.presence_penalty,
        frequency_penalty=0.0 if request.frequency_penalty is None else request.frequency_penalty,
        seed=request.seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop_list,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=to_structured_outputs_params(request),
        logit_bias=dict(request.logit_bias) if request.logit_bias else None,  # type: ignore[arg-type]
        allowed_token_ids=list(request.allowed_token_ids) if request.allowed_token_ids is not None else None,
    )


def beam_search_params(ctx: ServingContext, request: SamplingFields, max_tokens: int | None,
                       num_prompt_tokens: int) -> Any:
    """The BeamSearchParams of a use_beam_search request (400 naming n when the width cannot be served)."""
    from lm_console.engine.frontend.beam_search import BeamSearchParams

    max_logprobs = ctx.engine.input_processor.max_logprobs
    if 0 <= max_logprobs < 2 * request.n:
        raise bad_request(f"Beam search with n={request.n} asks for 2 x n = {2 * request.n} logprobs per step, more "
                          f"than the engine's max_logprobs={max_logprobs}; use n <= {max_logprobs // 2}.", "n")
    return BeamSearchParams(
        beam_width=request.n, max_tokens=max_tokens if max_tokens is not None else ctx.max_model_len - num_prompt_tokens,
        ignore_eos=request.ignore_eos, length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens)


async def run_beam_search(ctx: ServingContext, request_id: str, prompts: list[list[int]], params: list[Any],
                          cache_salt: str | None = None, priority: int = 0,
                          lora_request: LoRARequest | None = None) -> list[Any]:
    """Beam search of each prompt (token ids) with its BeamSearchParams; each step sends one
    one-token request per live beam of every prompt, all at once. Cancelling it aborts the step."""
    from lm_console.engine.frontend.beam_search import BeamSearch, candidates_of, check_beam_width

    processor = ctx.engine.input_processor
    stop_ids: set[int] = set(processor.extra_stop_token_ids)
    if processor.eos_token_id is not None:
        stop_ids.add(processor.eos_token_id)
    searches = []
    for token_ids, search_params in zip(prompts, params):
        check_beam_width(search_params.beam_width, processor.max_logprobs)
        searches.append(BeamSearch(token_ids, search_params, stop_ids))
    steps = itertools.count()
    while True:
        pending = [search.pending() for search in searches]
        requests = [EngineRequest(ctx, f"{request_id}-beam{next(steps)}", {"prompt_token_ids": tokens},
                                  search.params.step_params(), cache_salt, priority, lora_request=lora_request)
                    for search, beams in zip(searches, pending) for tokens in beams]
        if not requests:
            break
        await start_all(requests)
        finals: list[Any] = [None] * len(requests)
        async for index, output in merge(requests):
            finals[index] = output
        outputs = iter(finals)
        for search, beams in zip(searches, pending):
            if beams:
                search.advance([candidates_of(next(outputs)) for _ in beams])
    return [search.result(functools.partial(_decode, ctx.tokenizer, search.params.skip_special_tokens))
            for search in searches]


def _decode(tokenizer: Any, skip_special_tokens: bool, token_ids: list[int]) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def fit_prompt(ctx: ServingContext, token_ids: list[int], truncate: int | None, max_tokens: int | None,
               param: str) -> tuple[list[int], int | None]:
    """Truncate (vLLM's truncate_prompt_tokens keeps the last k) and check the context budget.

    Returns (token ids, max_tokens); like vLLM, a prompt plus max_tokens over max_model_len is a
    400 rather than a silently shortened completion. max_tokens None means "up to the context".
    """
    limit = ctx.max_model_len
    if truncate is not None:
        if truncate == -1:
            truncate = limit - 1
        if truncate < 1:
            raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {truncate}.", "truncate_prompt_tokens")
        if truncate > limit:  # vLLM's bound; a prompt of max_model_len tokens then fails the context check
            raise bad_request(f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len ({limit}). "
                              "Please, select a smaller truncation size.", "truncate_prompt_tokens")
        token_ids = token_ids[-truncate:]
    if len(token_ids) >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{len(token_ids)} tokens, which leaves no room for a completion. Please shorten the prompt.",
            param, "context_length_exceeded")
    if max_tokens is not None and len(token_ids) + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or completion.",
            "max_tokens", "context_length_exceeded")
    return token_ids, max_tokens


def check_work(ctx: ServingContext, prompt_lengths: list[int], max_tokens: int | None, n: int,
               logprobs: int | None, prompt_logprobs: int | None, echo: bool = False) -> None:
    """Refuse up front (400 naming --max-request-work) a request whose outputs could exceed the
    server's budget of token entries: each limit alone (n, logprobs, prompts, max_tokens) is
    checked elsewhere, but their product is what the engine computes and the response carries.

    Per prompt: n x max_tokens x (1 + logprobs) entries for the completions (max_tokens None: up
    to the context), its tokens x (1 + prompt_logprobs) when prompt logprobs are asked for, and
    n x its tokens again when echo sends the prompt back with each choice.
    """
    limit = ctx.settings.max_request_work
    per_token = 1 + (logprobs or 0) + (1 if logprobs is not None else 0)  # the token, its alternatives, its own
    total = 0
    for length in prompt_lengths:
        completion = max_tokens if max_tokens is not None else max(ctx.max_model_len - length, 0)
        total += n * completion * per_token
        if prompt_logprobs is not None:
            total += length * (1 + prompt_logprobs + 1)
        if echo:
            total += n * length
    if total > limit:
        parts = [f"{len(prompt_lengths)} prompt(s)", f"n={n}",
                 f"max_tokens={max_tokens if max_tokens is not None else 'up to the context'}"]
        if logprobs is not None:
            parts.append(f"logprobs={logprobs}")
        if prompt_logprobs is not None:
            parts.append(f"prompt_logprobs={prompt_logprobs}")
        if echo:
            parts.append("echo")
        raise bad_request(
            f"This request asks for up to {total} token entries ({', '.join(parts)}), more than the server's "
            f"limit of {limit} per request (--max-request-work); lower n, max_tokens, logprobs or the number "
            "of prompts, or split the request.", "n" if n > 1 else "max_tokens", "request_too_large")
