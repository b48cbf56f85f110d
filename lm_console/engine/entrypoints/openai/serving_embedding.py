"""POST /v1/embeddings: each input's embedding, pooled from the model's last hidden states.

`input` is a string, a list of strings, a list of token ids or a list of such lists;
`encoding_format` "float" (a list of numbers) or "base64" (the little-endian float32 bytes,
what the openai client asks for by default and decodes). The pooling is the server's
--pooler-config (vLLM's names: pooling_type LAST or MEAN, normalize). `dimensions` is refused:
no served model is trained for shortened (Matryoshka) embeddings, so a cut vector would be
silently worse. Usage counts the prompt tokens (completion_tokens 0).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field
from starlette.responses import Response

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.protocol import (
    RequestModel, ResponseModel, TokenId, UsageInfo, random_id,
)
from lm_console.engine.entrypoints.openai.serving_engine import (
    EngineRequest, ServingContext, close_all, fit_prompt, start_all, until_disconnect,
)
from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from fastapi import Request

    from lm_console.engine.outputs import RequestOutput


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings."""

    model: str | None = None
    input: list[TokenId] | list[list[TokenId]] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's extra

    def prompts(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as the response carries it (base64: little-endian float32, as OpenAI sends)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class OpenAIServingEmbedding:
    """The /v1/embeddings endpoint over one ServingContext."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(request.model)
        if request.dimensions is not None:
            raise bad_request("This model does not support Matryoshka representation (shortened embeddings): "
                              "`dimensions` would cut its vectors and make them worse; leave it out.", "dimensions")
        prompts = request.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise bad_request("input must be a non-empty string, list of strings or token ids, with no empty "
                              "entry.", "input")
        if len(prompts) > ctx.settings.max_prompts:
            raise bad_request(f"input has {len(prompts)} entries; at most {ctx.settings.max_prompts} per request.",
                              "input")
        token_lists = []
        for prompt in prompts:
            ids = prompt if isinstance(prompt, list) else await ctx.offload(
                ctx.encode, prompt, request.add_special_tokens, "input")
            token_lists.append(fit_prompt(ctx, list(ids), None, 1, "input")[0])
        pooling = ctx.settings.pooler_config
        request_id = random_id("embd")
        engine_requests = [
            EngineRequest(ctx, f"{request_id}-{i}", {"prompt_token_ids": ids},
                          SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling,
                                         output_kind=RequestOutputKind.FINAL_ONLY),
                          lora_request=ctx.lora_for(model))
            for i, ids in enumerate(token_lists)]
        await start_all(engine_requests)
        try:
            outputs = await until_disconnect(raw_request, asyncio.gather(*(_final(r) for r in engine_requests)))
        finally:
            close_all(engine_requests)
        data = []
        for index, output in enumerate(outputs):
            if output.pooled is None:  # aborted (a drain): no vector to send
                raise bad_request("the request was aborted before its embedding was computed.", "input")
            data.append(EmbeddingData(index=index, embedding=encode_embedding(output.pooled, request.encoding_format)))
        num_tokens = sum(len(ids) for ids in token_lists)
        response = EmbeddingResponse(id=request_id, model=model, data=data,
                                     usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens,
                                                     completion_tokens=0))
        return Response(response.model_dump_json(exclude_none=True), media_type="application/json")


async def _final(engine_request: EngineRequest) -> RequestOutput:
    final: Any = None
    async for output in engine_request:
        final = output
    return final
