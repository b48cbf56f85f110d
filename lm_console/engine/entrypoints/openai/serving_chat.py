"""POST /v1/chat/completions: messages -> the model's chat template -> a reply or a stream.

Image parts are resolved by the server first (media.py: data: URLs, http(s) with a timeout
and a byte cap, file:// under --allowed-local-media-path) and then go through the engine's own
chat support (lm_console/engine/multimodal/chat.py), so the HTTP path and LLM.chat build the same prompt.
A stream starts with one {"role": "assistant", "content": ""} delta per choice, as vLLM's does.
Tools (tool_calling.py): the tools reach the chat template; "required" and named tool choices
constrain the output; "auto" parses it with --tool-call-parser. A stream sends each call as
vLLM does: a delta with its index, id, type and name, then deltas of its arguments' text.
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
    DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall,
)
from lm_console.engine.entrypoints.openai.tool_calling import (
    HERMES_CHATML_TEMPLATE, ToolPlan, needs_tool_template, plan_tools,
)
from lm_console.engine.entrypoints.openai.tool_parsers import StreamPiece, ToolCallDelta, get_tool_parser, tool_call_id
from lm_console.engine.entrypoints.openai.structured_outputs import check_constraint_size, has_constraint
from lm_console.engine.entrypoints.openai.serving_engine import (
    SSE_DONE, EngineRequest, EventStreamResponse, ServingContext, beam_search_params, check_work, fit_prompt,
    make_sampling_params, run_beam_search, sse, until_disconnect,
)
from lm_console.engine.errors import EngineError
from lm_console.engine.frontend.tracing import trace_headers_of
from lm_console.engine.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from fastapi import Request


async def render_chat_prompt(ctx: ServingContext, request: ChatTemplateFields, allow_images: bool = True,
                             tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
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
    return await ctx.offload(_render, ctx, request, messages, tools)


def _render(ctx: ServingContext, request: ChatTemplateFields, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    from lm_console.engine.multimodal.chat import build_chat_prompt

    kwargs = request.template_kwargs()
    if tools is not None:
        kwargs["tools"] = tools  # transformers' apply_chat_template(tools=...)
    mm_processor = ctx.engine.input_processor.mm_processor
    if mm_processor is None and needs_tool_template(getattr(ctx.tokenizer, "chat_template", None), tools, messages):
        kwargs.setdefault("chat_template", HERMES_CHATML_TEMPLATE)
    try:
        prompt = build_chat_prompt(ctx.tokenizer, ctx.engine.input_processor.mm_processor, messages,
                                   request.add_generation_prompt, kwargs,
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
        parser_name = ctx.settings.tool_call_parser
        self.tool_parser = get_tool_parser(parser_name) if parser_name else None

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx, settings = self.ctx, self.ctx.settings
        request.check(settings.max_logprobs, settings.max_stop_strings, settings.max_n)
        model = ctx.model_name(request.model)
        if has_constraint(request):
            await ctx.offload(check_constraint_size, request, settings.max_structured_output_bytes,
                              settings.max_structured_output_choices)
        tool_plan = await ctx.offload(plan_tools, request, settings.enable_auto_tool_choice, self.tool_parser,
                                      has_constraint(request), settings.max_structured_output_bytes)
        prompt = await render_chat_prompt(ctx, request, tools=tool_plan.tools)
        max_tokens = request.requested_max_tokens
        if "multi_modal_data" not in prompt:
            prompt["prompt_token_ids"], max_tokens = fit_prompt(
                ctx, prompt["prompt_token_ids"], request.truncate_prompt_tokens, max_tokens, "messages")
        elif request.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images (it would cut an image's "
                              "placeholder tokens).", "truncate_prompt_tokens")
        if request.use_beam_search:
            return await self._beam_search(request, raw_request, prompt, max_tokens, model)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        check_work(ctx, [len(prompt["prompt_token_ids"])], max_tokens, request.n, logprobs, request.prompt_logprobs)
        params = make_sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                      stream=bool(request.stream))
        if tool_plan.constraint is not None:
            params.structured_outputs = tool_plan.constraint
        request_id = random_id("chatcmpl")
        engine_request = EngineRequest(ctx, request_id, prompt, params, request.cache_salt, request.priority or 0,
                                       lora_request=ctx.lora_for(model),
                                       trace_headers=trace_headers_of(raw_request.headers))
        await engine_request.start()
        try:
            token_text = TokenText(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
            if request.stream:
                events = self._stream(engine_request, request, request_id, model, token_text, tool_plan)
                return EventStreamResponse(events, [engine_request])
            response = await until_disconnect(raw_request, self._full(engine_request, request, request_id, model,
                                                                      token_text, tool_plan))
        finally:
            if not request.stream:
                engine_request.close()
        return Response(response.model_dump_json(), media_type="application/json")

    async def _beam_search(self, request: ChatCompletionRequest, raw_request: Request, prompt: dict[str, Any],
                           max_tokens: int | None, model: str) -> Response:
        """use_beam_search: the n best beams are the n choices, best first."""
        ctx = self.ctx
        if "multi_modal_data" in prompt:
            raise bad_request("use_beam_search takes text messages only.", "use_beam_search")
        if request.logprobs:
            raise bad_request("'logprobs' cannot be used with use_beam_search.", "logprobs")
        token_ids = prompt["prompt_token_ids"]
        check_work(ctx, [len(token_ids)], max_tokens, request.n, None, None)
        params = beam_search_params(ctx, request, max_tokens, len(token_ids))
        request_id = random_id("chatcmpl")
        [result] = await until_disconnect(raw_request, run_beam_search(ctx, request_id, [token_ids], [params],
                                                                       request.cache_salt, request.priority or 0,
                                                                       lora_request=ctx.lora_for(model)))
        echo = request.echo_text()
        choices = []
        for i, beam in enumerate(result.sequences):
            message = ChatMessage(role="assistant", content=echo + (beam.text or ""))
            choice = ChatCompletionResponseChoice(index=i, message=message, finish_reason=beam.finish_reason,
                                                  stop_reason=beam.stop_reason)
            if request.return_token_ids:
                choice.token_ids = list(beam.token_ids)
            choices.append(choice)
        usage = make_usage(len(token_ids), sum(len(beam.token_ids) for beam in result.sequences), 0)
        if not request.stream:
            response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
            if request.return_token_ids:
                response.prompt_token_ids = list(token_ids)
            return Response(response.model_dump_json(), media_type="application/json")

        async def events() -> AsyncIterator[str]:  # the search is done: a role chunk, then each beam's text
            created = int(time.time())

            def chunk(choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
                made = ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                    model=model, choices=[choice])
                if request.include_usage:
                    made.usage = usage if request.continuous_usage else None
                return made

            for choice in choices:
                yield sse(chunk(ChatCompletionResponseStreamChoice(
                    index=choice.index, delta=DeltaMessage(role="assistant", content=""), finish_reason=None)))
                yield sse(chunk(ChatCompletionResponseStreamChoice(
                    index=choice.index, delta=DeltaMessage(content=choice.message.content),
                    finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)))
            if request.include_usage:
                yield sse(ChatCompletionStreamResponse(id=request_id, object="chat.completion.chunk", created=created,
                                                       model=model, choices=[], usage=usage))
            yield SSE_DONE

        return EventStreamResponse(events(), [])

    async def _full(self, engine_request: EngineRequest, request: ChatCompletionRequest, request_id: str,
                    model: str, token_text: TokenText, tool_plan: ToolPlan) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async for output in engine_request:
            final = output
        assert final is not None
        choices = []
        echo = request.echo_text()
        for completion in sorted(final.outputs, key=lambda c: c.index):
            content, calls = tool_plan.parse(completion.text)
            if echo:
                content = echo + (content or "")
            message = ChatMessage(role="assistant", content=content, tool_calls=[
                ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                for call in calls])
            choice = ChatCompletionResponseChoice(
                index=completion.index, message=message,
                logprobs=self._logprobs(request, completion, token_text),
                finish_reason=tool_plan.finish_reason(completion.finish_reason, bool(calls)),
                stop_reason=completion.stop_reason)
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
                      model: str, token_text: TokenText, tool_plan: ToolPlan) -> AsyncIterator[str]:
        created = int(time.time())
        tools = [_ToolStream(tool_plan) for _ in range(request.n)]

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
                echo = request.echo_text()
                if echo:  # vLLM sends the echoed text as each choice's first content delta
                    for index in range(request.n):
                        yield sse(chunk([ChatCompletionResponseStreamChoice(
                            index=index, delta=DeltaMessage(content=echo), logprobs=None, finish_reason=None)]))
            for completion in output.outputs:
                num_completion_tokens[completion.index] += len(completion.token_ids)
                if not completion.text and not completion.token_ids and completion.finish_reason is None:
                    continue
                tool_stream = tools[completion.index]
                delta = tool_stream.delta(completion.text, completion.finish_reason is not None)
                if delta is None and completion.finish_reason is None and not request.logprobs:
                    continue  # text held back (a tag's beginning) with nothing else to send
                choice = ChatCompletionResponseStreamChoice(
                    index=completion.index, delta=delta or DeltaMessage(content=""),
                    logprobs=self._logprobs(request, completion, token_text),
                    finish_reason=tool_plan.finish_reason(completion.finish_reason, tool_stream.called))
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


class _ToolStream:
    """One choice's stream through its ToolPlan: text deltas -> content and tool-call deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.streamer()
        self.ids: dict[int, str] = {}
        self.named_started = False

    @property
    def called(self) -> bool:
        if self.plan.mode == "named":
            return self.named_started
        return bool(self.ids)

    def delta(self, text: str, last: bool) -> DeltaMessage | None:
        """The delta for this text (None when nothing is to be sent yet)."""
        if self.plan.mode == "named":
            return self._named(text)
        if self.parser is None:
            return DeltaMessage(content=text)
        piece = self.parser.feed(text)
        if last:
            tail = self.parser.finish()
            piece = StreamPiece(piece.content + tail.content, piece.tool_calls + tail.tool_calls)
        calls = [self._call(d) for d in piece.tool_calls if self.plan.parallel or d.index == 0]
        if self.ids and not piece.content.strip():
            piece.content = ""  # the whitespace between and after calls is not content
        if not calls and not piece.content:
            return None
        delta = DeltaMessage()
        if piece.content:
            delta.content = piece.content
        if calls:
            delta.tool_calls = calls
        return delta

    def _named(self, text: str) -> DeltaMessage | None:
        if self.named_started:
            if not text:
                return None
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))])
        self.named_started = True
        return DeltaMessage(tool_calls=[DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                                      function=DeltaFunctionCall(name=self.plan.named, arguments=text))])

    def _call(self, piece: ToolCallDelta) -> DeltaToolCall:
        if piece.name is not None:
            self.ids[piece.index] = tool_call_id()
            return DeltaToolCall(index=piece.index, id=self.ids[piece.index], type="function",
                                 function=DeltaFunctionCall(name=piece.name, arguments=""))
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
