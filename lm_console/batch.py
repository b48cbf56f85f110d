"""`lmc batch`: OpenAI batch files in, results out, as `vllm run-batch` reads and writes them.

Input lines: {custom_id, method: POST, url: /v1/chat/completions | /v1/completions, body}.
Output lines, in input order: {id, custom_id, response: {status_code, request_id, body}, error}.
A line that cannot be parsed or validated becomes an error record (status 400); the job goes on.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "n": "n", "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "min_tokens": "min_tokens"}


class BatchLineError(ValueError):
    """A batch line is malformed; the message says what is wrong."""


@dataclass(slots=True)
class BatchItem:
    """One valid request line."""

    custom_id: str
    url: str
    body: dict[str, Any]


def _uid() -> str:
    return uuid.uuid4().hex


def parse_line(text: str) -> BatchItem:
    """Parse and check one input line; BatchLineError says what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise BatchLineError(f"invalid JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(data, dict):
        raise BatchLineError("each line must be a JSON object with custom_id, method, url and body")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError("custom_id must be a non-empty string")
    if data.get("method", "POST") != "POST":
        raise BatchLineError(f"method must be POST, got {data.get('method')!r}")
    url = data.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BatchLineError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("body must be a JSON object")
    return BatchItem(custom_id, url, body)


def custom_id_of(text: str) -> str | None:
    """The custom_id of a line, if one can be read at all (for error records)."""
    try:
        data = json.loads(text)
        return data.get("custom_id") if isinstance(data, dict) and isinstance(data.get("custom_id"), str) else None
    except json.JSONDecodeError:
        return None


def sampling_kwargs(body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """SamplingParams keyword arguments from an OpenAI request body."""
    kwargs = {ours: body[key] for key, ours in SAMPLING_KEYS.items() if body.get(key) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    kwargs["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    return kwargs


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The body's messages with text content (parts joined); images are refused."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BatchLineError("body.messages must be a non-empty list")
    result = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise BatchLineError("each message needs a role and content")
        content = message.get("content", "")
        if isinstance(content, list):
            if any(isinstance(p, dict) and p.get("type") != "text" for p in content):
                raise BatchLineError("this model is text-only: only text content parts are accepted")
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise BatchLineError("message content must be a string or a list of text parts")
        result.append({"role": str(message["role"]), "content": content})
    return result


def completion_prompt(body: dict[str, Any]) -> Any:
    """The body's prompt: a string, a one-element list of strings, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise BatchLineError("body.prompt must be a non-empty string, [string] or a list of token ids")


def check_context(prompt: Any, max_tokens: int | None, max_model_len: int, tokenizer: Any) -> None:
    """Refuse prompt + max_tokens beyond max_model_len, as vLLM's OpenAI server does."""
    if not max_model_len:
        return
    if isinstance(prompt, dict):
        num_prompt = len(prompt["prompt_token_ids"])
    else:
        num_prompt = len(tokenizer.encode(prompt))
    if num_prompt + (max_tokens or 0) > max_model_len:
        raise BatchLineError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + (max_tokens or 0)} tokens ({num_prompt} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.")


def response_body(item: BatchItem, output: Any, model: str) -> dict[str, Any]:
    """An OpenAI ChatCompletion or Completion object from a finished RequestOutput."""
    num_prompt = len(output.prompt_token_ids or [])
    num_completion = sum(len(c.token_ids) for c in output.outputs)
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
             "total_tokens": num_prompt + num_completion}
    created = int(time.time())
    if item.url == CHAT_URL:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None, "finish_reason": str(c.finish_reason or "stop")} for c in output.outputs]
        return {"id": f"chatcmpl-{_uid()}", "object": "chat.completion", "created": created,
                "model": model, "choices": choices, "usage": usage}
    choices = [{"index": c.index, "text": c.text, "logprobs": None,
                "finish_reason": str(c.finish_reason or "stop")} for c in output.outputs]
    return {"id": f"cmpl-{_uid()}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def ok_record(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"vllm-{_uid()}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"vllm-batch-{_uid()}", "body": body},
            "error": None}


def error_record(custom_id: str | None, message: str, status_code: int = 400) -> dict[str, Any]:
    return {"id": f"vllm-{_uid()}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": f"vllm-batch-{_uid()}", "body": None},
            "error": message}


async def run_batch(llm: Any, lines: list[str], model: str, default_max_tokens: int = 256,
                    progress: bool = True, concurrency: int | None = None) -> list[dict[str, Any]]:
    """One record per non-blank input line, in input order; at most `concurrency` run at once."""
    from engine.sampling_params import RequestOutputKind, SamplingParams
    from tqdm.auto import tqdm

    tokenizer = llm.get_tokenizer()
    max_model_len = int((getattr(llm, "model_config_summary", None) or {}).get("max_model_len") or 0)
    bar = tqdm(total=len(lines), file=sys.stderr, disable=not progress, desc="Batch requests")
    limit = asyncio.Semaphore(concurrency or max(len(lines), 1))

    async def one(index: int, text: str) -> dict[str, Any]:
        async with limit:
            return await run_one(index, text)

    async def run_one(index: int, text: str) -> dict[str, Any]:
        custom_id = custom_id_of(text)
        try:
            item = parse_line(text)
            params = SamplingParams(**sampling_kwargs(item.body, default_max_tokens),
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            if item.url == CHAT_URL:
                rendered = tokenizer.apply_chat_template(chat_messages(item.body), tokenize=False,
                                                         add_generation_prompt=True)
                prompt: Any = {"prompt": rendered,
                               "prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)}
            else:
                prompt = completion_prompt(item.body)
            check_context(prompt, params.max_tokens, max_model_len, tokenizer)
            final = None
            async for output in llm.generate(prompt, params, request_id=f"batch-{index}-{_uid()[:8]}"):
                final = output
            if final is None:
                return error_record(custom_id, "the engine returned no output", 500)
            return ok_record(item.custom_id, response_body(item, final, item.body.get("model") or model))
        except (BatchLineError, ValueError, TypeError) as error:
            return error_record(custom_id, f"{type(error).__name__}: {error}" if not isinstance(error, BatchLineError) else str(error))
        except Exception as error:  # noqa: BLE001 - one request's failure is its own record
            if type(error).__name__ == "EngineDeadError":
                raise
            return error_record(custom_id, f"{type(error).__name__}: {error}", 500)
        finally:
            bar.update(1)

    try:
        return list(await asyncio.gather(*(one(i, text) for i, text in enumerate(lines))))
    finally:
        bar.close()


def read_lines(text: str) -> list[str]:
    """The non-blank lines of an input file."""
    return [line for line in text.splitlines() if line.strip()]
