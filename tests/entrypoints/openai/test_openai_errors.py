"""Bad input: each malformed request gets its documented status and an OpenAI-shaped error, and
the server keeps serving. Also the image paths of chat: data:, http(s) and file:// URLs.

The server runs a tiny random Idefics3 VLM (text and image requests) with a small body limit
and an allowed local media directory.
"""

from __future__ import annotations

import base64
import http.server
import json
import socket
import threading

import httpx
import pytest

from lm_console.engine import LLM, SamplingParams
from mm_factory import make_image, png_bytes
from openai_server_helpers import ThreadServer, assert_openai_error, read_sse

pytestmark = pytest.mark.slow

MAX_BODY = 256 * 1024
ENGINE_ARGS = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=256, num_threads=1, stat_loggers=[])


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png_bytes(make_image(3)))
    (root / "secret.png").write_bytes(png_bytes(make_image(4)))
    (root / "allowed" / "escape.png").symlink_to(root / "secret.png")
    return root


@pytest.fixture(scope="module")
def server(tiny_idefics3_dir, media_dir):
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    settings = ServerSettings(served_model_names=("vlm",), max_request_body=MAX_BODY,
                              allowed_local_media_path=media_dir / "allowed", media_fetch_timeout_s=5.0,
                              allow_private_media_urls=True)  # the test image host is on 127.0.0.1
    srv = ThreadServer(str(tiny_idefics3_dir), settings, **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http_client(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server for image URLs: /cat.png, /huge.png (over the cap), /missing.png (404)."""
    payload = png_bytes(make_image(5))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            else:
                self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", payload
    httpd.shutdown()
    httpd.server_close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def image_chat(url: str, **fields) -> dict:
    body = {"model": "vlm", "max_tokens": 4, "temperature": 0.0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}
    body.update(fields)
    return body


def chat(**fields) -> dict:
    body = {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return body


def completion(**fields) -> dict:
    body = {"model": "vlm", "prompt": "Hello", "max_tokens": 4}
    body.update(fields)
    return body


def assert_still_serving(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=completion())
    assert response.status_code == 200, response.text
    assert client.get("/health").status_code == 200


CASES = [
    # (id, path, body (bytes are sent raw), status, param[, a phrase of the message])
    ("not-json", "/v1/completions", b"{not json", 422, None),
    ("json-array", "/v1/completions", b"[1, 2]", 400, None),
    ("nan-temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("wrong-type-max-tokens", "/v1/completions", completion(max_tokens="ten"), 400, "max_tokens"),
    ("bool-as-int", "/v1/completions", completion(n=True), 400, "n"),
    ("wrong-type-prompt", "/v1/completions", completion(prompt=[1, "a"]), 400, "prompt"),
    ("unknown-model", "/v1/completions", completion(model="gpt-17"), 404, "model"),
    ("negative-max-tokens", "/v1/completions", completion(max_tokens=-5), 400, "max_tokens"),
    ("prompt-over-max-model-len", "/v1/completions", completion(prompt="word " * 600), 400, "prompt"),
    ("prompt-plus-max-tokens-over-len", "/v1/completions", completion(prompt="word " * 200, max_tokens=400), 400,
     "max_tokens"),
    ("10000-stop-strings", "/v1/completions", completion(stop=[f"s{i}" for i in range(10_000)]), 400, "stop"),
    ("n-zero", "/v1/completions", completion(n=0), 400, "n"),
    ("logprobs-too-many", "/v1/completions", completion(logprobs=50), 400, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", chat(top_logprobs=3), 400, "top_logprobs"),
    ("unsupported-bad-words", "/v1/completions", completion(bad_words=["x"]), 400, "bad_words"),
    ("logit-bias-out-of-vocab", "/v1/completions", completion(logit_bias={"10000000": 2.0}), 400, "logit_bias",
     "10000000"),
    ("logit-bias-out-of-range", "/v1/completions", completion(logit_bias={"5": 100.5}), 400, "logit_bias"),
    ("not-json-content-type", "/v1/completions", None, 400, None, "Unsupported Media Type"),
    ("unsupported-tools", "/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools"),
    ("stream-options-without-stream", "/v1/completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("token-id-out-of-vocab", "/v1/completions", completion(prompt=[1, 10_000_000]), 400, "prompt"),
    ("prompt-logprobs-with-stream", "/v1/completions", completion(stream=True, prompt_logprobs=1), 400,
     "prompt_logprobs"),
    ("priority-under-fcfs", "/v1/completions", completion(priority=1), 400, "priority", "scheduling_policy"),
    ("prompt-logprobs-too-many", "/v1/completions", completion(prompt_logprobs=50), 400, None, "max_logprobs"),
    ("empty-messages", "/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("empty-role", "/v1/chat/completions", chat(messages=[{"role": "", "content": "hi"}]), 400, "messages"),
    ("continue-and-generation-prompt", "/v1/chat/completions",
     chat(messages=[{"role": "assistant", "content": "Once"}], continue_final_message=True), 400,
     "continue_final_message"),
    ("bad-temperature-range", "/v1/chat/completions", chat(temperature=-1.0), 400, "temperature"),
    ("stream-with-bad-param", "/v1/completions", completion(stream=True, top_p=0.0), 400, "top_p"),
    ("corrupt-image", "/v1/chat/completions", image_chat(data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 50)), 400,
     "messages", "corrupt or truncated"),
    ("not-base64-image", "/v1/chat/completions", image_chat("data:image/png;base64,@@@"), 400, "messages", "base64"),
    ("file-url-outside-allowed-dir", "/v1/chat/completions", image_chat("file:///etc/passwd"), 400, "messages",
     "outside --allowed-local-media-path"),
    ("unreachable-image-url", "/v1/chat/completions",
     image_chat(f"http://127.0.0.1:{closed_port()}/cat.png"), 400, "messages", "could not fetch image URL"),
    ("unsupported-image-scheme", "/v1/chat/completions", image_chat("ftp://example/cat.png"), 400, "messages"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10_000_000]}, 400, "tokens"),
    ("tokenize-wrong-type", "/tokenize", {"prompt": 5}, 400, "prompt"),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_malformed_request_gets_its_status_and_server_keeps_serving(http_client, case) -> None:
    _, path, body, status, param, *phrase = case
    if body is None:  # a JSON body declared as text/plain
        response = http_client.post(path, content=json.dumps(completion()), headers={"content-type": "text/plain"})
    elif isinstance(body, bytes):
        response = http_client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http_client.post(path, json=body)
    error = assert_openai_error(response, status, param)
    assert all(p in error["message"] for p in phrase), error
    assert_still_serving(http_client)


def test_oversize_body_is_refused_before_it_is_read(http_client) -> None:
    body = json.dumps(completion(prompt="x" * (MAX_BODY + 10))).encode()
    response = http_client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 413)
    assert error["code"] == "request_too_large" and str(MAX_BODY) in error["message"]

    def chunked():  # no Content-Length: the limit applies as the body streams in
        for _ in range(MAX_BODY // 1024 + 8):
            yield b"x" * 1024

    response = http_client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
    assert_still_serving(http_client)


def test_unknown_route_and_method(http_client) -> None:
    assert_openai_error(http_client.get("/v1/nothing"), 404)
    assert_openai_error(http_client.get("/v1/completions"), 405)


def test_symlink_out_of_allowed_dir_is_refused(http_client, media_dir) -> None:
    url = (media_dir / "allowed" / "escape.png").as_uri()
    error = assert_openai_error(http_client.post("/v1/chat/completions", json=image_chat(url)), 400, "messages")
    assert "outside" in error["message"]


def test_image_chat_from_data_http_and_file_urls(server, http_client, image_host, media_dir,
                                                 tiny_idefics3_dir) -> None:
    base, payload = image_host
    replies = {}
    for kind, url in [("data", data_url(payload)), ("http", f"{base}/cat.png"),
                      ("file", (media_dir / "allowed" / "cat.png").as_uri())]:
        response = http_client.post("/v1/chat/completions", json=image_chat(url, max_tokens=6))
        assert response.status_code == 200, (kind, response.text)
        replies[kind] = response.json()
    assert replies["data"]["choices"][0]["message"] == replies["http"]["choices"][0]["message"]
    assert replies["data"]["usage"]["prompt_tokens"] > 20  # the image's placeholder tokens are in the prompt
    missing = http_client.post("/v1/chat/completions", json=image_chat(f"{base}/missing.png"))
    assert "HTTP 404" in assert_openai_error(missing, 400, "messages")["message"]

    # The same conversation through LLM.chat gives the same greedy reply.
    llm = LLM(str(tiny_idefics3_dir), dtype="float32", max_model_len=512, num_gpu_blocks_override=256, num_threads=1)
    try:
        messages = [{"role": "user", "content": [{"type": "image", "image": payload},
                                                 {"type": "text", "text": "What is this?"}]}]
        expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert replies["data"]["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert replies["data"]["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)

    with http_client.stream("POST", "/v1/chat/completions", json=image_chat(data_url(payload), stream=True,
                                                                            max_tokens=6)) as response:
        events = read_sse(response)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1] if c["choices"])
    assert streamed == expected.outputs[0].text and events[-1] == "[DONE]"
    assert server.wait_idle().all_free
