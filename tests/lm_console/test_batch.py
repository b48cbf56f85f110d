"""lmc batch's line handling: OpenAI batch lines in, vLLM run-batch records out, errors isolated."""

from __future__ import annotations

import asyncio
import json

import pytest

from lm_console.batch import BatchLineError, chat_messages, completion_prompt, parse_line, run_batch, sampling_kwargs


def batch_lines(num: int = 20) -> list[str]:
    """num lines: chat and completions requests, line 5 not JSON, line 12 a wrong url."""
    lines = []
    for i in range(num):
        if i == 5:
            lines.append('{"custom_id": "bad-json", "body": ')
        elif i == 12:
            lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/embeddings", "body": {}}))
        elif i % 2:
            lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"model": "m", "prompt": f"Count to {i}", "max_tokens": 3}}))
        else:
            lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": "m", "max_completion_tokens": 4, "temperature": 0,
                                              "messages": [{"role": "user", "content": f"Say {i}"}]}}))
    return lines


def test_parse_errors_name_the_problem() -> None:
    with pytest.raises(BatchLineError, match="invalid JSON"):
        parse_line("{nope")
    with pytest.raises(BatchLineError, match="url must be"):
        parse_line('{"custom_id": "a", "url": "/v1/x", "body": {}}')
    with pytest.raises(BatchLineError, match="text-only"):
        chat_messages({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert completion_prompt({"prompt": [1, 2]}) == {"prompt_token_ids": [1, 2]}
    assert sampling_kwargs({"max_tokens": 5, "temperature": 0.5}, 99) == {"temperature": 0.5, "max_tokens": 5}


def test_run_batch_keeps_order_and_isolates_bad_lines(fake_async_llm) -> None:  # noqa: ANN001
    llm = fake_async_llm()
    records = asyncio.run(run_batch(llm, batch_lines(), "m", progress=False))
    assert len(records) == 20
    assert [r["custom_id"] for r in records][:5] == [f"req-{i}" for i in range(5)]
    errors = [i for i, r in enumerate(records) if r["error"] is not None]
    assert errors == [5, 12]
    assert records[5]["custom_id"] is None and records[5]["response"]["status_code"] == 400
    ok = records[0]
    assert ok["response"]["status_code"] == 200 and ok["id"].startswith("vllm-")
    assert ok["response"]["request_id"].startswith("vllm-batch-")
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4
    assert records[1]["response"]["body"]["object"] == "text_completion"


# -- issue 18: bounded memory, streamed results, no tracebacks ---------------------------------
def _completion(custom_id: str, prompt: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 2}})


def test_input_lines_are_capped_and_decoded_one_at_a_time() -> None:
    import io

    from lm_console.batch import iter_input_lines

    data = (_completion("a", "x").encode() + b"\n" + b"\xff\xfe\x00binary\n" + b"\n"
            + b"{" + b"x" * 3_000_000 + b"}\n" + _completion("b", "y").encode())
    lines = list(iter_input_lines(io.BytesIO(data), max_line_bytes=1 << 20))
    assert [n for n, _ in lines] == [1, 2, 4, 5]
    assert isinstance(lines[0][1], str) and isinstance(lines[3][1], str)
    assert "not valid UTF-8" in str(lines[1][1]) and "longer than 1048576 bytes" in str(lines[2][1])


def test_records_are_written_as_they_finish(fake_async_llm) -> None:  # noqa: ANN001
    from lm_console.batch import stream_batch

    written: list[dict] = []

    async def lines():
        for i in range(4):
            # One request in flight: line i is read only after record i - 1 is out.
            assert len(written) == i
            yield i + 1, _completion(f"c{i}", f"prompt {i}")

    result = asyncio.run(asyncio.wait_for(
        stream_batch(fake_async_llm(), lines(), written.append, "m", progress=False, max_in_flight=1), 30))
    assert result == (4, 0) and [r["custom_id"] for r in written] == ["c0", "c1", "c2", "c3"]


def test_a_dead_engine_ends_the_job_but_keeps_the_written_records(fake_async_llm) -> None:  # noqa: ANN001
    from lm_console.engine.errors import EngineUnresponsiveError
    from lm_console.batch import stream_batch

    llm = fake_async_llm()
    original = llm.generate

    async def generate(prompt, params=None, request_id=None):
        if isinstance(prompt, str) and "DIE" in prompt:
            raise EngineUnresponsiveError("unresponsive for 30.0 s")
        async for output in original(prompt, params, request_id):
            yield output

    llm.generate = generate
    written: list[dict] = []

    async def lines():
        yield 1, _completion("ok", "fine")
        yield 2, _completion("bad", "x" * 10)
        yield 3, _completion("dies", "DIE now")

    with pytest.raises(EngineUnresponsiveError):
        asyncio.run(asyncio.wait_for(stream_batch(llm, lines(), written.append, "m", progress=False,
                                                  max_in_flight=1), 30))
    assert [r["custom_id"] for r in written] == ["ok", "bad"]


def test_write_in_order_caps_the_requests_running_at_once() -> None:
    from lm_console.batch import aiter_items, write_in_order

    running, peak, written = 0, 0, []

    async def run_line(line_no: int, text: str) -> dict:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01 * (line_no % 3))  # later lines may finish first
        running -= 1
        return {"custom_id": text, "error": None}

    lines = [(i, f"r{i}") for i in range(1, 10)] + [(10, BatchLineError("line 10 is not valid UTF-8"))]
    counts = asyncio.run(write_in_order(aiter_items(lines), run_line, written.append, progress=False,
                                        max_in_flight=4, concurrency=3))
    assert counts == (10, 1) and peak == 3
    assert [r["custom_id"] for r in written] == [f"r{i}" for i in range(1, 10)] + [None]
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        asyncio.run(write_in_order(aiter_items([]), run_line, written.append, progress=False, concurrency=0))
