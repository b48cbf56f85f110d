"""API keys: 401 without a key or with a wrong one on /v1/* and the tokenizer routes; /health,
/metrics and /version stay open (as in vLLM); the openai client authenticates with api_key."""

from __future__ import annotations

import httpx
import openai
import pytest

from lm_console.engine.entrypoints.openai.auth import api_key_matches
from openai_server_helpers import ThreadServer, assert_openai_error

pytestmark = pytest.mark.slow

KEY = "sk-test-4d1e8f"
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=128, num_threads=1, stat_loggers=[])
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    srv = ThreadServer(str(tiny_llama_dir), ServerSettings(api_key=KEY), **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.mark.parametrize("method, path, body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_protected_routes_need_the_key(server, method, path, body) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            error = assert_openai_error(http.request(method, path, json=body, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        # A malformed body is not even parsed without the key.
        if method == "POST":
            assert http.post(path, content=b"{oops", headers={"content-type": "application/json"}).status_code == 401
        response = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200, response.text


def test_open_routes(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").status_code == 200
        assert "vllm:num_requests_running" in http.get("/metrics").text


def test_openai_client_with_and_without_the_key(server) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as good:
        assert good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=2).choices
    with openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_api_key_matches() -> None:
    assert api_key_matches("k", "Bearer k") and api_key_matches("k", "bearer  k ")
    assert not api_key_matches("k", None) and not api_key_matches("k", "Bearer") and not api_key_matches("k", "k")
