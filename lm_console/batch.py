"""`lmc batch`: OpenAI batch files in, results out, as `vllm run-batch` reads and writes them.

Input lines: {custom_id, method: POST, url: /v1/chat/completions | /v1/completions, body}.
Output lines, in input order: {id, custom_id, response: {status_code, request_id, body}, error}.
A line that cannot be parsed or validated becomes an error record (status 400); the job goes on.

Memory is bounded: write_in_order() reads a line only when a request slot is free (at most
max_in_flight requests run or wait to be written; at most `concurrency` of them run), refuses a
line longer than max_line_bytes without keeping it, and writes each record as soon as it and
every earlier one are done, so a job that fails half-way keeps what it finished. The same
pipeline runs the lines on a local engine (stream_batch) or on a server (batch_remote.py, --url).
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

DEFAULT_MAX_LINE_BYTES = 8 << 20  # 8 MiB: far beyond any prompt that fits a context window
DEFAULT_MAX_IN_FLIGHT = 512

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "n": "n", "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
                 "ignore_eos": "ignore_eos", "min_tokens": "min_tokens"}


# The body fields a local engine honours (besides SAMPLING_KEYS and the structured-output ones),
# and those it takes only at their do-nothing value: anything else is refused per line, as the
# server (`--url`) refuses it, so that no line is answered as if a field had been honoured.
_COMMON_FIELDS = {"model", "max_tokens", "user", "stop_token_ids", "include_stop_str_in_output",
                  "skip_special_tokens", "spaces_between_special_tokens", "priority", "cache_salt"}
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")
_URL_FIELDS = {CHAT_URL: {"messages", "max_completion_tokens"}, COMPLETIONS_URL: {"prompt"}}
# field -> its do-nothing values; any other value is refused (local batch records carry no
# logprobs, echo or streaming; `lmc batch --url` against `lmc serve` honours them)
_NEUTRAL_ONLY: dict[str, tuple[object, ...]] = {
    "stream": (False, None), "stream_options": (None,), "logprobs": (False, None), "top_logprobs": (0, None),
    "echo": (False, None), "prompt_logprobs": (None,), "logit_bias": (None, {}), "suffix": (None, ""),
    "best_of": (None, 1), "use_beam_search": (None, False), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "allowed_token_ids": (None,), "bad_words": (None, []), "length_penalty": (None, 1.0, 1),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "truncate_prompt_tokens": (None,),
    "return_token_ids": (None, False), "return_tokens_as_token_ids": (None, False),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
}
# add_special_tokens: the server's default per endpoint (a chat template adds its own)
_ADD_SPECIAL_TOKENS = {CHAT_URL: False, COMPLETIONS_URL: True}
MAX_JSON_DEPTH = 64  # a request body nests a few levels (a JSON schema a few more)


class BatchLineError(ValueError):
    """A batch line is malformed; the message says what is wrong."""


def _json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether the JSON text nests arrays / objects deeper than limit (brackets outside strings).

    Checked before json.loads, whose recursion a deeply nested line would otherwise exhaust."""
    if text.count("[") + text.count("{") <= limit:  # the common case, at C speed
        return False
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _loads(text: str) -> Any:
    """json.loads of one line; BatchLineError for invalid or too deeply nested JSON."""
    if _json_depth_exceeds(text, MAX_JSON_DEPTH):
        raise BatchLineError(f"the line nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BatchLineError(f"invalid JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:  # defence in depth: the depth check above should catch it first
        raise BatchLineError("the line nests JSON too deeply") from None


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
    data = _loads(text)
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
        data = _loads(text)
    except BatchLineError:
        return None
    return data.get("custom_id") if isinstance(data, dict) and isinstance(data.get("custom_id"), str) else None


def check_local_body(url: str, body: dict[str, Any]) -> None:
    """Refuse a field the local engine would not honour: unknown (a misspelling), or known but
    asking for what a local batch record cannot carry (logprobs, echo, a stream, tools)."""
    allowed = set(SAMPLING_KEYS) | _COMMON_FIELDS | set(_STRUCTURED_FIELDS) | _URL_FIELDS[url]
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _NEUTRAL_ONLY or key == "add_special_tokens":
            neutral = _NEUTRAL_ONLY.get(key, (_ADD_SPECIAL_TOKENS[url],))
            if any(value == n and type(value) is type(n) for n in neutral):
                continue
            raise BatchLineError(
                f"body.{key}={json.dumps(value)[:60]} is not supported by a local `lmc batch` (its records "
                f"carry the text only); leave it out, or run the file against `lmc serve` with --url")
        import difflib

        known = sorted(allowed | set(_NEUTRAL_ONLY))
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise BatchLineError(f"body.{key} is not a known field of {url}{hint}")


def structured_outputs_of(body: dict[str, Any]) -> Any:
    """The body's output constraint (response_format, guided_*, structured_outputs) as
    StructuredOutputsParams, or None; BatchLineError for a malformed or doubled one."""
    from types import SimpleNamespace

    if not any(body.get(field) is not None for field in _STRUCTURED_FIELDS):
        return None
    from lm_console.engine.entrypoints.openai.errors import OpenAIError
    from lm_console.engine.entrypoints.openai.structured_outputs import to_structured_outputs_params

    for field in ("response_format", "structured_outputs"):
        if body.get(field) is not None and not isinstance(body[field], dict):
            raise BatchLineError(f"body.{field} must be a JSON object")
    fields = SimpleNamespace(**{field: body.get(field) for field in _STRUCTURED_FIELDS})
    try:
        return to_structured_outputs_params(cast(Any, fields))  # the server's reading of these fields
    except OpenAIError as error:
        raise BatchLineError(error.message) from None


def sampling_kwargs(body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """SamplingParams keyword arguments from an OpenAI request body."""
    kwargs = {ours: body[key] for key, ours in SAMPLING_KEYS.items() if body.get(key) is not None}
    for key in ("stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens"):
        if body.get(key) is not None:
            kwargs[key] = body[key]
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


def check_context(prompt: Any, max_tokens: int | None, max_model_len: int, tokenizer: Any,
                  check_text: Callable[[str], Any] | None = None) -> None:
    """Refuse prompt + max_tokens beyond max_model_len, as vLLM's OpenAI server does.

    check_text (the engine's InputProcessor.check_prompt_text) refuses a text too long to fit
    before it is tokenised.
    """
    if not max_model_len:
        return
    if isinstance(prompt, dict):
        num_prompt = len(prompt["prompt_token_ids"])
    else:
        if check_text is not None:
            check_text(prompt)
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


InputLines = AsyncIterator[tuple[int, str | BatchLineError]]  # (line number, text or the line's error)
LineRunner = Callable[[int, str], Awaitable[dict[str, Any]]]  # (line number, text) -> its record


async def run_batch(llm: Any, lines: list[str], model: str, default_max_tokens: int = 256,
                    progress: bool = True, concurrency: int | None = None) -> list[dict[str, Any]]:
    """One record per non-blank input line, in input order; at most `concurrency` run at once."""
    records: list[dict[str, Any]] = []
    numbered = ((i + 1, text) for i, text in enumerate(lines) if text.strip())
    await stream_batch(llm, aiter_items(numbered), records.append, model, default_max_tokens, progress,
                       concurrency=concurrency)
    return records


async def stream_batch(llm: Any, lines: InputLines, write: Callable[[dict[str, Any]], Any], model: str,
                       default_max_tokens: int = 256, progress: bool = True,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, concurrency: int | None = None) -> tuple[int, int]:
    """Run the lines on `llm` (an AsyncLLM); write each record in input order (see write_in_order)."""
    tokenizer = llm.get_tokenizer()
    max_model_len = int((getattr(llm, "model_config_summary", None) or {}).get("max_model_len") or 0)
    input_processor = getattr(llm, "input_processor", None)
    check_text = getattr(input_processor, "check_prompt_text", None)

    async def run_line(line_no: int, text: str) -> dict[str, Any]:
        return await _run_line(llm, line_no, text, model, default_max_tokens, tokenizer, max_model_len, check_text)

    return await write_in_order(lines, run_line, write, progress=progress, max_in_flight=max_in_flight,
                                concurrency=concurrency)


async def write_in_order(lines: InputLines, run_line: LineRunner, write: Callable[[dict[str, Any]], Any], *,
                         progress: bool = True, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                         concurrency: int | None = None) -> tuple[int, int]:
    """Run (line number, text or the line's error) pairs with run_line; write each record in input order.

    At most max_in_flight lines run or wait to be written, of which at most `concurrency` run
    (None: all of them). Returns (records written, records with an error). An EngineDeadError
    ends the job (what was written stays written); every other failure is its line's error record.
    """
    from tqdm.auto import tqdm

    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    limit = asyncio.Semaphore(concurrency) if concurrency is not None else None
    max_in_flight = max(max_in_flight, concurrency or 0)  # room for `concurrency` requests to run
    bar = tqdm(file=sys.stderr, disable=not progress, desc="Batch requests")
    pending: collections.deque[asyncio.Task] = collections.deque()
    num_written = num_failed = 0

    def flush(task: asyncio.Task) -> None:
        nonlocal num_written, num_failed
        record = task.result()
        write(record)
        num_written += 1
        num_failed += record["error"] is not None
        bar.update(1)

    async def one(line_no: int, text: str | BatchLineError) -> dict[str, Any]:
        if isinstance(text, BatchLineError):
            return error_record(None, str(text))
        custom_id = custom_id_of(text)
        try:
            if limit is None:
                return await run_line(line_no, text)
            async with limit:
                return await run_line(line_no, text)
        except BatchLineError as error:
            return error_record(custom_id, str(error))
        except Exception as error:  # noqa: BLE001 - one request's failure is its own record
            if _is_engine_dead(error):
                raise
            status = 400 if isinstance(error, (ValueError, TypeError)) else 500
            return error_record(custom_id, f"{type(error).__name__}: {error}", status)

    try:
        async for line_no, text in lines:
            pending.append(asyncio.ensure_future(one(line_no, text)))
            while pending and (pending[0].done() or len(pending) >= max_in_flight):
                await pending[0]
                flush(pending.popleft())
        while pending:
            await pending[0]
            flush(pending.popleft())
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
    return num_written, num_failed


async def _run_line(llm: Any, line_no: int, text: str, model: str, default_max_tokens: int, tokenizer: Any,
                    max_model_len: int, check_text: Callable[[str], Any] | None) -> dict[str, Any]:
    from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams

    item = parse_line(text)
    check_local_body(item.url, item.body)
    params = SamplingParams(**sampling_kwargs(item.body, default_max_tokens), output_kind=RequestOutputKind.FINAL_ONLY,
                            structured_outputs=structured_outputs_of(item.body))
    if item.url == CHAT_URL:
        rendered = tokenizer.apply_chat_template(chat_messages(item.body), tokenize=False, add_generation_prompt=True)
        if check_text is not None:
            check_text(rendered)
        prompt: Any = {"prompt": rendered, "prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)}
    else:
        prompt = completion_prompt(item.body)
    check_context(prompt, params.max_tokens, max_model_len, tokenizer, check_text)
    final = None
    # priority / cache_salt as the server passes them (given only when set: the engine checks them)
    extra = {key: item.body[key] for key in ("priority", "cache_salt") if item.body.get(key) is not None}
    async for output in llm.generate(prompt, params, request_id=f"batch-{line_no}-{_uid()[:8]}", **extra):
        final = output
    if final is None:
        return error_record(item.custom_id, "the engine returned no output", 500)
    return ok_record(item.custom_id, response_body(item, final, item.body.get("model") or model))


def _is_engine_dead(error: BaseException) -> bool:
    return any(cls.__name__ == "EngineDeadError" for cls in type(error).__mro__)


async def aiter_items(items: Any) -> AsyncIterator[Any]:
    """An iterable as an async iterator (run_batch's in-memory lines)."""
    for item in items:
        yield item


def iter_input_lines(stream: BinaryIO, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
                     ) -> Iterator[tuple[int, str | BatchLineError]]:
    """(line number, text) of each non-blank line; a BatchLineError for a line too long or not UTF-8.

    A line longer than max_line_bytes is skipped in pieces, never held whole.
    """
    line_no = 0
    while True:
        raw = stream.readline(max_line_bytes + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            while True:
                rest = stream.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield line_no, BatchLineError(
                f"line {line_no} is longer than {max_line_bytes} bytes (raise --max-line-bytes to allow it)")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            yield line_no, BatchLineError(f"line {line_no} is not valid UTF-8 (byte {error.start}): a batch "
                                          "file is JSON lines text")
            continue
        if text.strip():
            yield line_no, text


async def read_input_lines(stream: BinaryIO, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
                           ) -> AsyncIterator[tuple[int, str | BatchLineError]]:
    """iter_input_lines() without blocking the event loop (stdin may wait for input)."""
    lines = iter_input_lines(stream, max_line_bytes)
    done = object()
    while True:
        item = await asyncio.to_thread(next, lines, done)
        if item is done:
            return
        yield item


def read_lines(text: str) -> list[str]:
    """The non-blank lines of an input file."""
    return [line for line in text.splitlines() if line.strip()]
