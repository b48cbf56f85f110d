"""POST /v1/completions: prompts (text, token ids, or lists of either) -> completions or a stream.

Each prompt is one engine request with n choices; choice i of prompt p has index p * n + i,
as in vLLM. The server tokenizes text prompts itself so that truncate_prompt_tokens,
add_special_tokens and the context check (prompt + max_tokens <= max_model_len) happen before
the engine sees the request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from lm_console.engine.entrypoints.openai.logprobs_format import TokenText, completion_logprobs
from lm_console.engine.entrypoints.openai.protocol import (
    CompletionLogProbs, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionResponseStreamChoice, CompletionStreamResponse, make_usage, prompt_logprobs_json, random_id,
)
from lm_console.engine.entrypoints.openai.structured_outputs import check_constraint_size, has_constraint
from lm_console.engine.entrypoints.openai.serving_engine import (
    SSE_DONE, EngineRequest, EventStreamResponse, ServingContext, beam_search_params, check_work, close_all,
    fit_prompt, make_sampling_params, merge, run_beam_search, sse, start_all, until_disconnect,
)
from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.outputs import CompletionOutput, RequestOutput
from lm_console.engine.frontend.tracing import trace_headers_of

if TYPE_CHECKING:
    from fastapi import Request


class OpenAIServingCompletion:
    """The /v1/completions endpoint over one ServingContext."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        ctx, settings = self.ctx, self.ctx.settings
        request.check(settings.max_logprobs, settings.max_stop_strings, settings.max_n, settings.max_prompts)
        model = ctx.model_name(request.model)
        if has_constraint(request):
            await ctx.offload(check_constraint_size, request, settings.max_structured_output_bytes,
                              settings.max_structured_output_choices)
        request_id = random_id("cmpl")
        engine_requests: list[EngineRequest] = []
        prompt_texts: list[str] = []
        prompts = request.prompts()
        check_prompt_sizes(ctx, prompts)
        # Tokenising (and decoding for echo) costs time in proportion to the text: in the pool.
        prepared = await ctx.offload(lambda: [self._prepare(prompt, request) for prompt in prompts])
        if request.use_beam_search:
            return await self._beam_search(request, raw_request, prepared, request_id, model)
        echo_logprobs = request.logprobs if request.echo and request.prompt_logprobs is None else None
        check_work(ctx, [len(p["prompt_token_ids"]) for p, _ in prepared], request.max_tokens, request.n,
                   request.logprobs, request.prompt_logprobs if echo_logprobs is None else echo_logprobs,
                   bool(request.echo))
        for index, (engine_prompt, echo_text) in enumerate(prepared):
            # echo + logprobs lists the prompt tokens' logprobs too (vLLM): they are prompt logprobs.
            params = make_sampling_params(request, max_tokens=engine_prompt.pop("max_tokens"),
                                          logprobs=request.logprobs, stream=bool(request.stream),
                                          prompt_logprobs=echo_logprobs)
            engine_requests.append(EngineRequest(ctx, f"{request_id}-{index}", engine_prompt, params,
                                                 request.cache_salt, request.priority or 0,
                                                 lora_request=ctx.lora_for(model),
                                                 trace_headers=trace_headers_of(raw_request.headers)))
            prompt_texts.append(echo_text)
        await start_all(engine_requests)
        try:
            view = _ChoiceView(request, prompt_texts,
                               TokenText(ctx.tokenizer, bool(request.return_tokens_as_token_ids)))
            if request.stream:
                events = self._stream(engine_requests, view, request_id, model)
                return EventStreamResponse(events, engine_requests)
            response = await until_disconnect(raw_request, self._full(engine_requests, view, request_id, model))
        finally:
            if not request.stream:
                close_all(engine_requests)
        return Response(response.model_dump_json(), media_type="application/json")

    async def _beam_search(self, request: CompletionRequest, raw_request: Request,
                           prepared: list[tuple[dict[str, Any], str]], request_id: str, model: str) -> Response:
        """use_beam_search: n beams per prompt; choice p * n + i is prompt p's i-th best beam."""
        ctx = self.ctx
        if request.logprobs is not None:
            raise bad_request("'logprobs' cannot be used with use_beam_search.", "logprobs")
        check_work(ctx, [len(p["prompt_token_ids"]) for p, _ in prepared], request.max_tokens, request.n, None, None,
                   bool(request.echo))
        params = [beam_search_params(ctx, request, p["max_tokens"], len(p["prompt_token_ids"])) for p, _ in prepared]
        results = await until_disconnect(raw_request, run_beam_search(
            ctx, request_id, [p["prompt_token_ids"] for p, _ in prepared], params, request.cache_salt,
            request.priority or 0, lora_request=ctx.lora_for(model)))
        choices: list[CompletionResponseChoice] = []
        num_completion_tokens = 0
        for index, (result, (_, echo_text)) in enumerate(zip(results, prepared)):
            for i, beam in enumerate(result.sequences):
                num_completion_tokens += len(beam.token_ids)
                choice = CompletionResponseChoice(
                    index=index * request.n + i, text=(echo_text if request.echo else "") + (beam.text or ""),
                    finish_reason=beam.finish_reason, stop_reason=beam.stop_reason)
                if request.return_token_ids:
                    choice.token_ids = list(beam.token_ids)
                    choice.prompt_token_ids = list(result.prompt_token_ids)
                choices.append(choice)
        usage = make_usage(sum(len(r.prompt_token_ids) for r in results), num_completion_tokens, 0)
        if not request.stream:
            response = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
            return Response(response.model_dump_json(), media_type="application/json")

        async def events() -> AsyncIterator[str]:  # the search is done: each beam is one chunk
            created = int(time.time())
            for choice in choices:
                chunk = CompletionStreamResponse(id=request_id, object="text_completion", created=created, model=model,
                                                 choices=[CompletionResponseStreamChoice(**choice.model_dump())])
                if request.include_usage:
                    chunk.usage = usage if request.continuous_usage else None
                yield sse(chunk)
            if request.include_usage:
                yield sse(CompletionStreamResponse(id=request_id, object="text_completion", created=created, model=model,
                                                   choices=[], usage=usage))
            yield SSE_DONE

        return EventStreamResponse(events(), [])

    def _prepare(self, prompt: str | list[int], request: CompletionRequest) -> tuple[dict[str, Any], str]:
        """(engine prompt with "max_tokens", the prompt text echo would send back)."""
        tokenizer = self.ctx.tokenizer
        if isinstance(prompt, str):
            token_ids = self.ctx.encode(prompt, request.add_special_tokens, "prompt")
        else:
            token_ids = list(prompt)
        kept, max_tokens = fit_prompt(self.ctx, token_ids, request.truncate_prompt_tokens, request.max_tokens,
                                      "prompt")
        engine_prompt: dict[str, Any] = {"prompt_token_ids": kept, "max_tokens": max_tokens}
        if isinstance(prompt, str) and len(kept) == len(token_ids):
            engine_prompt["prompt"] = prompt
            echo_text = prompt
        else:
            echo_text = tokenizer.decode(kept) if request.echo else ""
        return engine_prompt, echo_text

    async def _full(self, requests: list[EngineRequest], view: _ChoiceView, request_id: str,
                    model: str) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(requests)
        async for index, output in merge(requests):
            finals[index] = output
        choices: list[CompletionResponseChoice] = []
        for index, final in enumerate(finals):
            assert final is not None
            view.count_prompt(index, final)
            for completion in final.outputs:
                choices.append(view.choice(CompletionResponseChoice, index, final, completion))
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=view.usage())

    async def _stream(self, requests: list[EngineRequest], view: _ChoiceView, request_id: str,
                      model: str) -> AsyncIterator[str]:
        created = int(time.time())
        request = view.request
        async for index, output in merge(requests):
            view.count_prompt(index, output)
            for completion in output.outputs:
                choice = view.choice(CompletionResponseStreamChoice, index, output, completion)
                if not choice.text and not completion.token_ids and choice.finish_reason is None:
                    continue  # nothing new to send
                chunk = CompletionStreamResponse(id=request_id, object="text_completion", created=created,
                                                 model=model, choices=[choice])
                if request.include_usage:
                    chunk.usage = view.usage() if request.continuous_usage else None
                yield sse(chunk)
        if request.include_usage:
            yield sse(CompletionStreamResponse(id=request_id, object="text_completion", created=created,
                                               model=model, choices=[], usage=view.usage()))
        yield SSE_DONE


class _ChoiceView:
    """Per-choice state across outputs: echo, logprob offsets, token counts for usage."""

    def __init__(self, request: CompletionRequest, prompt_texts: list[str], token_text: TokenText) -> None:
        self.request = request
        self.prompt_texts = prompt_texts
        self.token_text = token_text
        n = request.n
        self.echo_pending = [bool(request.echo)] * (len(prompt_texts) * n)
        self.prompt_ids_pending = [bool(request.return_token_ids)] * (len(prompt_texts) * n)
        self.offsets = [len(prompt_texts[i // n]) if request.echo else 0 for i in range(len(prompt_texts) * n)]
        self.num_completion_tokens = [0] * (len(prompt_texts) * n)
        self.num_prompt_tokens = [0] * len(prompt_texts)
        self.num_cached_tokens = [0] * len(prompt_texts)
        # Per prompt: (the engine's prompt_logprobs rows, what was built from them). The n choices
        # of one prompt share its prompt logprobs, so they are built once, not once per choice; the
        # rows are held so that the identity check cannot match a recycled id().
        self._prompt_json: dict[int, tuple[Any, Any]] = {}
        self._echo_logprobs: dict[int, tuple[Any, tuple[CompletionLogProbs, int]]] = {}

    def count_prompt(self, index: int, output: RequestOutput) -> None:
        self.num_prompt_tokens[index] = len(output.prompt_token_ids)
        self.num_cached_tokens[index] = output.num_cached_tokens

    def choice(self, cls: type, index: int, output: RequestOutput, completion: CompletionOutput) -> Any:
        """One choice (full response or stream delta) from a CompletionOutput."""
        request = self.request
        i = index * request.n + completion.index
        self.num_completion_tokens[i] += len(completion.token_ids)
        text = completion.text
        echo_logprobs = None
        if self.echo_pending[i]:
            text = self.prompt_texts[index] + text
            self.echo_pending[i] = False
            if request.logprobs is not None:  # the prompt's tokens first, offsets from 0
                echo_logprobs, self.offsets[i] = self._per_prompt(
                    self._echo_logprobs, index, output, lambda: completion_logprobs(
                        output.prompt_token_ids, output.prompt_logprobs or [], self.token_text, 0))
        logprobs: CompletionLogProbs | None = None
        if request.logprobs is not None:
            logprobs, self.offsets[i] = completion_logprobs(
                completion.token_ids, completion.logprobs or [], self.token_text, self.offsets[i])
            if echo_logprobs is not None:  # new lists: the cached echo is shared by the n choices
                logprobs = CompletionLogProbs(
                    text_offset=echo_logprobs.text_offset + logprobs.text_offset,
                    token_logprobs=echo_logprobs.token_logprobs + logprobs.token_logprobs,
                    tokens=echo_logprobs.tokens + logprobs.tokens,
                    top_logprobs=echo_logprobs.top_logprobs + logprobs.top_logprobs)
        choice = cls(index=i, text=text, logprobs=logprobs, finish_reason=completion.finish_reason,
                     stop_reason=completion.stop_reason)
        if request.prompt_logprobs is not None:
            choice.prompt_logprobs = self._per_prompt(  # shared by the choices (read-only)
                self._prompt_json, index, output, lambda: prompt_logprobs_json(output.prompt_logprobs))
        if request.return_token_ids:
            choice.token_ids = list(completion.token_ids)
            if self.prompt_ids_pending[i]:
                choice.prompt_token_ids = list(output.prompt_token_ids)
                self.prompt_ids_pending[i] = False
        return choice

    @staticmethod
    def _per_prompt(cache: dict[int, tuple[Any, Any]], index: int, output: RequestOutput,
                    build: Callable[[], Any]) -> Any:
        """build() of prompt index's prompt logprobs, made once per engine rows object (the
        choices of one prompt, and later outputs that carry the same rows, reuse it)."""
        cached = cache.get(index)
        if cached is None or cached[0] is not output.prompt_logprobs:
            cached = cache[index] = (output.prompt_logprobs, build())
        return cached[1]

    def usage(self) -> Any:
        return make_usage(sum(self.num_prompt_tokens), sum(self.num_completion_tokens), sum(self.num_cached_tokens))


def check_prompt_sizes(ctx: ServingContext, prompts: list[str | list[int]]) -> None:
    """Refuse, before any tokenising, a text prompt too long to fit the context and a token-id
    prompt that cannot fit it either (both cheap: len() only)."""
    for prompt in prompts:
        if isinstance(prompt, str):
            ctx.check_prompt_text(prompt, "prompt")
