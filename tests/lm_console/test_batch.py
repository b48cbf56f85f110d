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
