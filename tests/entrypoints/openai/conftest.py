"""The OpenAI SDK client the server tests share: it talks to the test module's own `server` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:  # noqa: ANN001
    """An openai.OpenAI on the module's `server` (a ThreadServer), no retries; closed after the module."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
