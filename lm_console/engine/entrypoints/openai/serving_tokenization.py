"""POST /tokenize and POST /detokenize with the served model's tokenizer (vLLM's shapes).

/tokenize takes {"prompt"} or {"messages"} (rendered with the chat template, text parts only);
it answers {"count", "max_model_len", "tokens", "token_strs"}. /detokenize takes {"tokens"}.
"""

from __future__ import annotations

from typing import Any

from lm_console.engine.entrypoints.openai.errors import bad_request
from lm_console.engine.entrypoints.openai.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeCompletionRequest, TokenizeResponse,
)
from lm_console.engine.entrypoints.openai.protocol_chat import TokenizeChatRequest
from lm_console.engine.entrypoints.openai.serving_chat import render_chat_prompt
from lm_console.engine.entrypoints.openai.serving_engine import ServingContext


class OpenAIServingTokenization:
    """The tokenizer endpoints over one ServingContext."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        ctx = self.ctx
        ctx.model_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            request.check_template()
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
            prompt: dict[str, Any] = await render_chat_prompt(ctx, request, allow_images=False, tools=tools)
            token_ids = list(prompt["prompt_token_ids"])
        else:
            ctx.check_prompt_text(request.prompt, "prompt")  # refused untokenised when it cannot fit
            token_ids = await ctx.offload(ctx.encode, request.prompt, request.add_special_tokens, "prompt")
        token_strs = None
        if request.return_token_strs:
            token_strs = await ctx.offload(ctx.tokenizer.convert_ids_to_tokens, token_ids)
        return TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        ctx = self.ctx
        ctx.model_name(request.model)
        vocab_size = ctx.engine.config.model_config.vocab_size

        def decode() -> str:  # in the pool: as long as the client's list of ids
            bad = [token for token in request.tokens if token >= vocab_size]
            if bad:
                raise bad_request(f"tokens must be ids in [0, {vocab_size}); got {bad[:5]}.", "tokens")
            return ctx.tokenizer.decode(request.tokens)

        return DetokenizeResponse(prompt=await ctx.offload(decode))
