"""Fixtures for the KV cache tests: hand-built requests with a prefix-cache block hasher."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kv_helpers import build_request

from lm_console.engine.request import Request

MakeRequest = Callable[..., Request]


@pytest.fixture
def make_request() -> MakeRequest:
    """Factory fixture: make_request(request_id, token_ids, block_size=4, **kwargs)."""
    return build_request
