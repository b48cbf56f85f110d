"""POST /v1/responses: the input -> the chat template -> one message item, whole or as events.

A stream sends OpenAI's event sequence (each frame `event: <type>` then `data: <json>` with a
sequence_number): response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut it). Like OpenAI's, it ends without [DONE].
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from lm_console.engine.entrypoints.openai.protocol_chat import ChatTemplateFields
from lm_console.engine.entrypoints.openai.protocol_responses import (
    IncompleteDetails, InputTokensDetails, OutputMessage, OutputText, ResponsesRequest, ResponsesResponse,
    ResponseUsage,
)
from lm_console.engine.entrypoints.openai.serving_chat import render_chat_prompt
from lm_console.engine.entrypoints.openai.serving_engine import (
    EngineRequest, EventStreamResponse, ServingContext, check_work, fit_prompt, until_disconnect,
)
from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from fastapi import Request


def openai_id(prefix: str) -> str:
    """An id as OpenAI spells them in this API (resp_..., msg_...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses:
    """The /v1/responses endpoint over one ServingContext."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        request.check()
        model = ctx.model_name(request.model)
        fields = ChatTemplateFields.model_validate({"messages": request.chat_messages()})
        prompt = await render_chat_prompt(ctx, fields, allow_images=False)
        prompt["prompt_token_ids"], max_tokens = fit_prompt(
            ctx, prompt["prompt_token_ids"], None, request.max_output_tokens, "input")
        check_work(ctx, [len(prompt["prompt_token_ids"])], max_tokens, 1, None, None)
        params = SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p, seed=request.seed, max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
        response_id = openai_id("resp")
        engine_request = EngineRequest(ctx, response_id, prompt, params, lora_request=ctx.lora_for(model))
        await engine_request.start()
        base = ResponsesResponse(id=response_id, status="in_progress", model=model, output=[],
                                 instructions=request.instructions, max_output_tokens=request.max_output_tokens,
                                 temperature=request.temperature, top_p=request.top_p, metadata=request.metadata,
                                 user=request.user, parallel_tool_calls=request.parallel_tool_calls is not False)
        if request.stream:
            return EventStreamResponse(self._stream(engine_request, base), [engine_request])
        try:
            response = await until_disconnect(raw_request, self._full(engine_request, base))
        finally:
            engine_request.close()
        return Response(response.model_dump_json(), media_type="application/json")

    async def _full(self, engine_request: EngineRequest, base: ResponsesResponse) -> ResponsesResponse:
        final = None
        async for output in engine_request:
            final = output
        assert final is not None
        completion = final.outputs[0]
        return _finished(base, openai_id("msg"), completion.text, completion.finish_reason,
                         len(final.prompt_token_ids), len(completion.token_ids), final.num_cached_tokens)

    async def _stream(self, engine_request: EngineRequest, base: ResponsesResponse) -> AsyncIterator[str]:
        sequence = 0

        def event(kind: str, **payload: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **payload}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        item_id = openai_id("msg")
        location = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=base.model_dump(mode="json"))
        yield event("response.in_progress", response=base.model_dump(mode="json"))
        item = OutputMessage(id=item_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=item.model_dump(mode="json"))
        yield event("response.content_part.added", **location, part=OutputText(text="").model_dump(mode="json"))
        text, finish_reason = "", None
        num_prompt_tokens = num_output_tokens = num_cached_tokens = 0
        async for output in engine_request:
            completion = output.outputs[0]
            num_prompt_tokens, num_cached_tokens = len(output.prompt_token_ids), output.num_cached_tokens
            num_output_tokens += len(completion.token_ids)
            finish_reason = completion.finish_reason
            if completion.text:
                text += completion.text
                yield event("response.output_text.delta", **location, delta=completion.text, logprobs=[])
        yield event("response.output_text.done", **location, text=text, logprobs=[])
        yield event("response.content_part.done", **location, part=OutputText(text=text).model_dump(mode="json"))
        done = _finished(base, item_id, text, finish_reason, num_prompt_tokens, num_output_tokens, num_cached_tokens)
        yield event("response.output_item.done", output_index=0, item=done.output[0].model_dump(mode="json"))
        kind = "response.completed" if done.status == "completed" else "response.incomplete"
        yield event(kind, response=done.model_dump(mode="json"))


def _finished(base: ResponsesResponse, item_id: str, text: str, finish_reason: str | None, num_prompt_tokens: int,
              num_output_tokens: int, num_cached_tokens: int) -> ResponsesResponse:
    """The final response object: completed, or incomplete when max_output_tokens cut the text."""
    cut = finish_reason == "length"
    status = "incomplete" if cut else "completed"
    message = OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])
    usage = ResponseUsage(input_tokens=num_prompt_tokens,
                          input_tokens_details=InputTokensDetails(cached_tokens=num_cached_tokens),
                          output_tokens=num_output_tokens, total_tokens=num_prompt_tokens + num_output_tokens)
    return base.model_copy(update={
        "status": status, "output": [message], "usage": usage,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None})
