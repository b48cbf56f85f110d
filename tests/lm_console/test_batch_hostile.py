"""`lmc batch` on hostile lines and outputs: one bad line is its own error record, fields a local
engine would not honour are refused per line, an unwritable output is one error line."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from lm_console.batch import run_batch

pytestmark = pytest.mark.hostile


def _line(custom_id: str, url: str = "/v1/completions", **body: object) -> str:
    if url == "/v1/completions":
        body.setdefault("prompt", "hello")
    else:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 2)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_a_deeply_nested_line_is_its_own_error_record(fake_async_llm) -> None:  # noqa: ANN001
    deep = '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    deep_in_body = ('{"custom_id": "deep2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", '
                    '"stop": ' + "[" * 5000 + "]" * 5000 + "}}")
    lines = [_line("a"), deep, _line("b"), deep_in_body, _line("c")]
    records = asyncio.run(run_batch(fake_async_llm(), lines, "m", progress=False))
    assert [r["custom_id"] for r in records] == ["a", None, "b", None, "c"]
    assert [r["error"] is None for r in records] == [True, False, True, False, True]
    assert "nests JSON deeper than" in records[1]["error"] and records[1]["response"]["status_code"] == 400


@pytest.mark.parametrize(("url", "body", "match"), [
    ("/v1/completions", {"temprature": 0.5}, r"body.temprature is not a known field .*did you mean 'temperature'"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, r"body.logprobs=true is not supported by a local"),
    ("/v1/completions", {"logprobs": 3}, r"body.logprobs=3 is not supported"),
    ("/v1/completions", {"stream": True}, r"body.stream=true is not supported"),
    ("/v1/completions", {"echo": True}, r"body.echo=true"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, r"body.tools="),
    ("/v1/completions", {"response_format": {"type": "xml"}}, r"response_format=.* is not supported"),
    ("/v1/completions", {"guided_choice": ["a"], "guided_regex": "a+"}, r"Only one output constraint"),
    ("/v1/completions", {"guided_choice": "yes"}, r"guided_choice"),
    ("/v1/chat/completions", {"add_special_tokens": True}, r"body.add_special_tokens=true is not supported"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": 1}}, r"body.chat_template_kwargs="),
])
def test_fields_a_local_engine_cannot_honour_are_refused_per_line(fake_async_llm, url, body, match) -> None:  # noqa: ANN001
    records = asyncio.run(run_batch(fake_async_llm(), [_line("bad", url, **body), _line("ok")], "m", progress=False))
    assert records[1]["error"] is None
    assert records[0]["custom_id"] == "bad" and records[0]["response"]["status_code"] == 400
    import re

    assert re.search(match, records[0]["error"]), records[0]["error"]


def test_honoured_fields_reach_the_engine(fake_async_llm) -> None:  # noqa: ANN001
    """response_format / guided_choice become the request's constraint; do-nothing values pass."""
    llm = fake_async_llm()
    seen, seen_extra = [], []
    original = llm.generate

    async def generate(prompt, params=None, request_id=None, **extra):  # noqa: ANN001, ANN003, ANN202
        seen.append(params)
        seen_extra.append(extra)
        async for output in original(prompt, params, request_id):
            yield output

    llm.generate = generate
    lines = [_line("json", "/v1/chat/completions", response_format={"type": "json_object"}, stream=False,
                   logprobs=False, top_logprobs=0, add_special_tokens=False, add_generation_prompt=True),
             _line("choice", guided_choice=["yes", "no"], echo=False, stop_token_ids=[5], add_special_tokens=True),
             _line("salted", cache_salt="s1", priority=0)]
    records = asyncio.run(run_batch(llm, lines, "m", progress=False))
    assert [r["error"] for r in records] == [None, None, None]
    assert seen[0].structured_outputs.json_object is True
    assert seen[1].structured_outputs.choice == ["yes", "no"] and seen[1].stop_token_ids == [5]
    assert seen_extra[2] == {"cache_salt": "s1", "priority": 0}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_that_cannot_be_written_is_one_error_line(tmp_path: Path, fake_async_llm) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from lm_console.cli import app

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(_line(f"r{i}") for i in range(3)) + "\n")
    result = CliRunner().invoke(app, ["batch", "-i", str(source), "-o", "/dev/full", "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/dev/full" in lines[0], result.output
    assert "Traceback" not in result.output
