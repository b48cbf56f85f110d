"""POST /v1/chat/completions: messages -> the model's chat template -> a reply or a stream.

Image parts are resolved by the server first (media.py: data: URLs, http(s) with a timeout
and a byte cap, file:// under --allowed-local-media-path) and then go through the engine's own
chat support (lm_console/engine/multimodal/chat.py), so the HTTP path and LLM.chat build the same prompt.
A stream starts with one {"role": "assistant", "content": ""} delta per choice, as vLLM's does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from lm_console.engine.entrypoints.openai.errors import OpenAIError, bad_request
from lm_console.engine.entrypoints.openai.logprobs_format import TokenText, chat_logprobs
from lm_console.engine.entrypoints.openai.protocol import make_usage, prompt_logprobs_json, random_id
from lm_console.engine.entrypoints.openai.protocol_chat import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, ChatMessage, ChatTemplateFields,
    DeltaMessage,
)
from lm_console.engine.entrypoints.openai.structured_outputs import check_constraint_size, has_constraint
from lm_console.engine.entrypoints.openai.serving_engine import (
    SSE_DONE, EngineRequest, EventStreamResponse, ServingContext, check_work, fit_prompt, make_sampling_params,
    sse, until_disconnect,
)
from lm_console.engine.errors import EngineError
from lm_console.engine.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from fastapi import Request


async def render_chat_prompt(ctx: ServingContext, request: ChatTemplateFields, allow_images: bool = True
                             ) -> dict[str, Any]:
    """The engine prompt dict ("prompt", "prompt_token_ids", maybe "multi_modal_data").

    The text is measured before the template runs, and the template, the tokenizer and the image
    headers run in the serving pool: none of it is done on the event loop.
    """
    # Proportional to the number of messages, which only the body size bounds: in the pool too.
    messages, num_chars = await ctx.offload(_template_messages, request)
    limit = ctx.engine.input_processor.max_prompt_chars
    if limit is not None:
        if num_chars > limit:
            raise bad_request(
                f"The messages have {num_chars} characters of text: more than max_model_len={ctx.max_model_len} "
                f"tokens can hold with this tokenizer (at most {limit} characters); shorten them.",
                "messages", "context_length_exceeded")
    image_parts = [part for message in messages if isinstance(message["content"], list)
                   for part in message["content"] if part.get("type") == "image_url"]
    if image_parts:
        if not allow_images:
            raise bad_request("/tokenize takes text messages only (image parts are expanded by the model's "
                              "processor at generation time).", "messages")
        if ctx.engine.input_processor.mm_processor is None:
            raise bad_request("this model is text-only: it cannot take image content parts; serve a "
                              "vision-language model (e.g. demo-vlm).", "messages", "invalid_image")
        for part in image_parts:
            source = await ctx.media.load(part["image_url"]["url"])
            part["image_url"] = {"url": await ctx.offload(ctx.media.check_image, source)}
    return await ctx.offload(_render, ctx, request, messages)


def _render(ctx: ServingContext, request: ChatTemplateFields, messages: list[dict[str, Any]]) -> dict[str, Any]:
    from lm_console.engine.multimodal.chat import build_chat_prompt

    try:
        prompt = build_chat_prompt(ctx.tokenizer, ctx.engine.input_processor.mm_processor, messages,
                                   request.add_generation_prompt, request.template_kwargs(),
                                   check_text=lambda text: ctx.check_prompt_text(text, "messages"))
    except (EngineError, OpenAIError):
        raise
    except Exception as error:  # noqa: BLE001 - jinja and the HF template code raise anything
        raise bad_request(f"the chat template could not render these messages: {error}", "messages") from error
    if request.add_special_tokens:
        prompt["prompt_token_ids"] = ctx.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
    return prompt


def _template_messages(request: ChatTemplateFields) -> tuple[list[dict[str, Any]], int]:
    """The messages as the chat template takes them, and their characters of text."""
    messages = [message.as_template_message() for message in request.messages]
    return messages, sum(_text_length(message["content"]) for message in messages)


def _text_length(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))


class OpenAIServingChat:
    """The /v1/chat/completions endpoint over one ServingContext."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx, settings = self.ctx, self.ctx.settings
        request.check(settings.max_logprobs, settings.max_stop_strings, settings.max_n)
        model = ctx.model_name(request.model)
        if has_constraint(request):
            await ctx.offload(check_constraint_size, request, settings.max_structured_output_bytes,
                              settings.max_structured_output_choices)
        prompt = await render_chat_prompt(ctx, request)
        max_tokens = request.requested_max_tokens
        if "multi_modal_data" not in prompt:
            prompt["prompt_token_ids"], max_tokens = fit_prompt(
                ctx, prompt["prompt_token_ids"], request.truncate_prompt_tokens, max_tokens, "messages")
        elif request.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images (it would cut an image's "
                              "placeholder tokens).", "truncate_prompt_tokens")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        check_work(ctx, [len(prompt["prompt_token_ids"])], max_tokens, request.n, logprobs, request.prompt_logprobs)
        params = make_sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                      stream=bool(request.stream))
        request_id = random_id("chatcmpl")
        engine_request = EngineRequest(ctx, request_id, prompt, params, request.cache_salt, request.priority or 0,
                                       ctx.lora_for(model))
        await engine_request.start()
        try:
            token_text = TokenText(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
            if request.stream:
                events = self._stream(engine_request, request, request_id, model, token_text)
                return EventStreamResponse(events, [engine_request])
            response = await until_disconnect(raw_request, self._full(engine_request, request, request_id, model,
                                                                      token_text))
        finally:
            if not request.stream:
                engine_request.close()
        return Response(response.model_dump_json(), media_type="application/json")

    async def _full(self, engine_request: EngineRequest, request: ChatCompletionRequest, request_id: str,
                    model: str, token_text: TokenText) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async for output in engine_request:
            final = output
        assert final is not None
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            choice = ChatCompletionResponseChoice(
                index=completion.index, message=ChatMessage(role="assistant", content=completion.text),
                logprobs=self._logprobs(request, completion, token_text),
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
            if request.return_token_ids:
                choice.token_ids = list(completion.token_ids)
            choices.append(choice)
        num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        response = ChatCompletionResponse(
            id=request_id, model=model, choices=choices,
            usage=make_usage(len(final.prompt_token_ids), num_completion_tokens, final.num_cached_tokens))
        if request.return_token_ids:
            response.prompt_token_ids = list(final.prompt_token_ids)
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(final.prompt_logprobs)
        return response

    async def _stream(self, engine_request: EngineRequest, request: ChatCompletionRequest, request_id: str,
                      model: str, token_text: TokenText) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> ChatCompletionStreamResponse:
            made = ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                model=model, choices=choices)
            if request.include_usage:
                made.usage = usage() if request.continuous_usage else None
            return made

        num_prompt_tokens = num_cached_tokens = 0
        num_completion_tokens = [0] * request.n

        def usage() -> Any:
            return make_usage(num_prompt_tokens, sum(num_completion_tokens), num_cached_tokens)

        first = True
        async for output in engine_request:
            num_prompt_tokens, num_cached_tokens = len(output.prompt_token_ids), output.num_cached_tokens
            if first:
                first = False
                for index in range(request.n):
                    opening = chunk([ChatCompletionResponseStreamChoice(
                        index=index, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                        finish_reason=None)])
                    if request.return_token_ids and index == 0:
                        opening.prompt_token_ids = list(output.prompt_token_ids)
                    yield sse(opening)
            for completion in output.outputs:
                num_completion_tokens[completion.index] += len(completion.token_ids)
                if not completion.text and not completion.token_ids and completion.finish_reason is None:
                    continue
                choice = ChatCompletionResponseStreamChoice(
                    index=completion.index, delta=DeltaMessage(content=completion.text),
                    logprobs=self._logprobs(request, completion, token_text),
                    finish_reason=completion.finish_reason)
                if completion.finish_reason is not None:
                    choice.stop_reason = completion.stop_reason
                if request.return_token_ids:
                    choice.token_ids = list(completion.token_ids)
                yield sse(chunk([choice]))
        if request.include_usage:
            final = ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                 model=model, choices=[], usage=usage())
            yield sse(final)
        yield SSE_DONE

    @staticmethod
    def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput, token_text: TokenText) -> Any:
        if not request.logprobs:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0, token_text)
