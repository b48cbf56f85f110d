"""The engine's per-token {token_id: Logprob} dicts -> OpenAI's completion and chat logprobs.

Each dict's first entry is the sampled token with its true rank; the others are the top-k
with ranks 1..k (lm_console/engine/frontend/logprobs.py). Completions list the sampled token and the top k
(as vLLM does); chat lists exactly the k most likely tokens in rank order, as OpenAI does.
JSON has no -inf, so a logprob below -9999 is sent as -9999.0 (vLLM's convention).
"""

from __future__ import annotations

from typing import Any

from lm_console.engine.entrypoints.openai.protocol import CompletionLogProbs
from lm_console.engine.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent,
)

MIN_LOGPROB = -9999.0


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenText:
    """Token strings for logprobs: the decoded text, or 'token_id:N' when asked for ids."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int, entry: Any | None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])


def completion_logprobs(token_ids: list[int], steps: list[dict[int, Any] | None], token_text: TokenText,
                        text_offset: int) -> tuple[CompletionLogProbs, int]:
    """Logprobs of the given tokens, offsets counted from text_offset; returns the next offset.

    A None step (the first prompt token under echo) has no logprob: null value and top_logprobs.
    """
    result = CompletionLogProbs()
    offset = text_offset
    for token_id, step in zip(token_ids, steps):
        if step is None:
            token = token_text(token_id, None)
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(token)
            continue
        entry = step.get(token_id)
        token = token_text(token_id, entry)
        result.tokens.append(token)
        result.token_logprobs.append(clamp(entry.logprob) if entry is not None else None)
        result.top_logprobs.append({token_text(tid, lp): clamp(lp.logprob) for tid, lp in step.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Any]], top_k: int,
                  token_text: TokenText) -> ChatCompletionLogProbs:
    """OpenAI's chat logprobs: each sampled token and the top_k most likely at its position."""
    content: list[ChatCompletionLogProbsContent] = []
    for token_id, step in zip(token_ids, steps):
        entry = step.get(token_id)
        token = token_text(token_id, entry)
        ranked = sorted(((lp.rank, tid, lp) for tid, lp in step.items()
                         if lp.rank is not None and lp.rank <= top_k), key=lambda item: item[0])
        top = []
        for _, tid, lp in ranked[:top_k]:
            text = token_text(tid, lp)
            top.append(ChatCompletionLogProb(token=text, logprob=clamp(lp.logprob), bytes=list(text.encode())))
        content.append(ChatCompletionLogProbsContent(
            token=token, logprob=clamp(entry.logprob) if entry is not None else MIN_LOGPROB,
            bytes=list(token.encode()), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)
