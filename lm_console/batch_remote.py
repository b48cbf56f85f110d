"""`lmc batch --url`: an OpenAI batch file sent to a running server, line by line, over HTTP.

Each valid line's body goes to the server's own endpoint (its url: /v1/chat/completions or
/v1/completions) with stream off; the response body, or the server's error, becomes the output
record, as `vllm run-batch` writes them. The lines stream through batch.write_in_order, as with a
local engine: records are written in input order as they finish, at most `concurrency` requests
are in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from lm_console.batch import (
    DEFAULT_MAX_IN_FLIGHT, InputLines, custom_id_of, error_record, ok_record, parse_line, write_in_order,
)
from lm_console.client.openai_http import auth_headers, error_message, raise_for_status, unreachable

DEFAULT_CONCURRENCY = 64  # requests in flight to a server when --concurrency is not given


async def served_model(http: httpx.AsyncClient, url: str) -> str:
    """The first model of GET /v1/models; EngineUnavailable when the server cannot be used."""
    try:
        response = await http.get(url + "/v1/models")
    except httpx.TransportError as error:
        raise unreachable(url, error) from error
    raise_for_status(url, response.status_code, response.content)
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        from lm_console.client.types import EngineUnavailable

        raise EngineUnavailable(f"{url} does not list a model at GET /v1/models.",
                                "Point --url at an OpenAI-compatible server's root (http://HOST:PORT).") from None


async def stream_batch_remote(url: str, lines: InputLines, write: Callable[[dict[str, Any]], Any],
                              api_key: str | None = None, default_max_tokens: int = 256,
                              concurrency: int = DEFAULT_CONCURRENCY, progress: bool = True,
                              max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> tuple[int, int]:
    """Run the lines on the server at `url`; (records written, records with an error)."""
    url = url.rstrip("/")
    concurrency = max(concurrency, 1)
    timeout = httpx.Timeout(30.0, read=None)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers(api_key)) as http:
        model = await served_model(http, url)

        async def run_line(line_no: int, text: str) -> dict[str, Any]:
            item = parse_line(text)  # BatchLineError: the line's error record
            body = {**item.body, "stream": False}
            body.setdefault("model", model)
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = default_max_tokens
            try:
                response = await http.post(url + item.url, json=body)
            except httpx.HTTPError as error:
                return error_record(custom_id_of(text), f"{type(error).__name__}: {error}", 502)
            if response.status_code != 200:
                return error_record(item.custom_id, error_message(response.content, response.status_code),
                                    response.status_code)
            return ok_record(item.custom_id, response.json())

        return await write_in_order(lines, run_line, write, progress=progress, max_in_flight=max_in_flight,
                                    concurrency=concurrency)

