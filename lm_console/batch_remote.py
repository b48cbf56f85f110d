"""`lmc batch --url`: an OpenAI batch file sent to a running server, line by line, over HTTP.

Each valid line's body goes to the server's own endpoint (its url: /v1/chat/completions or
/v1/completions) with stream off; the response body, or the server's error, becomes the output
record, as `vllm run-batch` writes them. At most `concurrency` requests are in flight.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx

from lm_console.batch import BatchLineError, custom_id_of, error_record, ok_record, parse_line
from lm_console.client.openai_http import auth_headers, error_message, raise_for_status, unreachable


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


async def run_batch_remote(url: str, lines: list[str], api_key: str | None = None, default_max_tokens: int = 256,
                           concurrency: int = 32, progress: bool = True) -> list[dict[str, Any]]:
    """One record per input line, in input order."""
    from tqdm.auto import tqdm

    url = url.rstrip("/")
    limit = asyncio.Semaphore(max(concurrency, 1))
    bar = tqdm(total=len(lines), file=sys.stderr, disable=not progress, desc="Batch requests")
    timeout = httpx.Timeout(30.0, read=None)
    limits = httpx.Limits(max_connections=max(concurrency, 1))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers(api_key)) as http:
        model = await served_model(http, url)

        async def one(text: str) -> dict[str, Any]:
            custom_id = custom_id_of(text)
            try:
                item = parse_line(text)
                body = {**item.body, "stream": False}
                body.setdefault("model", model)
                if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                    body["max_tokens"] = default_max_tokens
                async with limit:
                    response = await http.post(url + item.url, json=body)
                if response.status_code != 200:
                    return error_record(custom_id, error_message(response.content, response.status_code),
                                        response.status_code)
                return ok_record(item.custom_id, response.json())
            except BatchLineError as error:
                return error_record(custom_id, str(error))
            except httpx.HTTPError as error:
                return error_record(custom_id, f"{type(error).__name__}: {error}", 502)
            finally:
                bar.update(1)

        try:
            return list(await asyncio.gather(*(one(text) for text in lines)))
        finally:
            bar.close()
