"""Hostile input and slow clients over real HTTP: each gets a clear 4xx (or its connection closed)
before the server does work in proportion to it, and /health keeps answering meanwhile.

One server (a tiny random Idefics3 VLM, so text and image requests) with an API key, short read
deadlines, a small work budget and a small pixel limit; image URLs to loopback are refused (the
default). The media loader's fetch rules are checked on a MediaLoader of their own, since a
fetch from 127.0.0.1 is exactly what the server refuses.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mm_factory import make_image, png_bytes
from openai_server_helpers import ThreadServer, assert_openai_error

pytestmark = [pytest.mark.slow, pytest.mark.hostile]

API_KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 16 << 20
MAX_WORK = 4000
MAX_PIXELS = 1_000_000
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
HEALTH_BOUND_S = 1.0  # what the issue asks: /health answers within 1 s while a hostile request runs
ENGINE_ARGS = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=256, num_threads=1, stat_loggers=[])


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile_media")
    (root / "cat.png").write_bytes(png_bytes(make_image(3)))
    (root / "loop_a.png").symlink_to(root / "loop_b.png")
    (root / "loop_b.png").symlink_to(root / "loop_a.png")
    return root


@pytest.fixture(scope="module")
def server(tiny_idefics3_dir, media_dir) -> Iterator[ThreadServer]:
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    settings = ServerSettings(served_model_names=("vlm",), api_key=API_KEY, max_request_body=MAX_BODY,
                              allowed_local_media_path=media_dir, max_request_work=MAX_WORK,
                              max_image_pixels=MAX_PIXELS, header_timeout_s=HEADER_TIMEOUT_S,
                              body_timeout_s=BODY_TIMEOUT_S, media_fetch_timeout_s=2.0)
    srv = ThreadServer(str(tiny_idefics3_dir), settings, **ENGINE_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http_client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


def completion(**fields) -> dict:
    body = {"model": "vlm", "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    body.update(fields)
    return body


def chat(content, **fields) -> dict:
    body = {"model": "vlm", "max_tokens": 4, "temperature": 0.0, "messages": [{"role": "user", "content": content}]}
    body.update(fields)
    return body


def image_chat(url: str) -> dict:
    return chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}])


def assert_still_serving(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=completion())
    assert response.status_code == 200, response.text
    assert client.get("/health").status_code == 200


def while_health_polled(server: ThreadServer, send) -> tuple[httpx.Response, list[float]]:
    """send(client) in a thread while /health is polled; (its response, the /health latencies)."""
    result: dict[str, httpx.Response] = {}

    def run() -> None:
        with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as client:
            result["response"] = send(client)

    thread = threading.Thread(target=run)
    latencies: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        thread.start()
        while thread.is_alive() or not latencies:
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join()
    return result["response"], latencies


# -- item 2: huge prompts are measured, not tokenised on the event loop ------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(prompt="hello world " * 700_000)),
    ("/v1/chat/completions", chat("hello world " * 700_000)),
    ("/tokenize", {"prompt": "hello world " * 700_000}),
], ids=["completions", "chat", "tokenize"])
def test_huge_prompt_is_refused_untokenised_while_health_answers(server, http_client, path, body) -> None:
    raw = json.dumps(body).encode()  # ~8 MB
    response, latencies = while_health_polled(
        server, lambda client: client.post(path, content=raw, headers={"content-type": "application/json"}))
    error = assert_openai_error(response, 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"], error
    assert max(latencies) < HEALTH_BOUND_S, latencies
    assert_still_serving(http_client)


# -- item 13 (and 2): hostile JSON is an OpenAI-shaped 400, not a plain 500 ---------------------------
HOSTILE_BODIES = [
    ("deep-nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("5000-digit-int", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "number too long"),
    ("lone-surrogate-completion", b'{"prompt": "abc \\ud800 def", "max_tokens": 2}', "surrogate"),
    ("lone-surrogate-chat", b'{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2}',
     "surrogate"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("case", HOSTILE_BODIES, ids=[case[0] for case in HOSTILE_BODIES])
def test_hostile_json_is_an_openai_400(http_client, path, case) -> None:
    _, body, phrase = case
    response = http_client.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert phrase in error["message"], error


def test_surrogate_pairs_are_still_text(http_client) -> None:
    """An escaped pair (what json.dumps sends for an emoji) is text, not refused."""
    response = http_client.post("/tokenize", content=json.dumps({"prompt": "hi \U0001F600"}).encode(),
                                headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("url, phrase", [
    ("file://{dir}/loop_a.png", "symlink loop"),
    ("file://{dir}/cat%00.png", "NUL byte"),
], ids=["symlink-loop", "nul-byte"])
def test_bad_file_urls_are_an_openai_400(http_client, media_dir, url, phrase) -> None:
    response = http_client.post("/v1/chat/completions", json=image_chat(url.format(dir=media_dir)))
    error = assert_openai_error(response, 400, "messages")
    assert phrase in error["message"], error
    assert_still_serving(http_client)


# -- item 4: an image's pixels are counted from its header, before anything decodes it --------------
def bomb_png(width: int, height: int) -> bytes:
    """A 1-bit PNG of width x height black pixels: a few KB that decode to width * height pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    pixels = zlib.compress(row * height, 9)
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_before_decoding(server, http_client) -> None:
    raw = bomb_png(2000, 2000)  # 4 M pixels > MAX_PIXELS, in a few KB
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    response, latencies = while_health_polled(
        server, lambda client: client.post("/v1/chat/completions", json=image_chat(url)))
    error = assert_openai_error(response, 400, "messages")
    assert error["code"] == "image_too_large" and "2000x2000" in error["message"], error
    assert max(latencies) < HEALTH_BOUND_S, latencies
    assert_still_serving(http_client)


def test_engine_refuses_an_image_over_its_pixel_limit_undecoded(monkeypatch) -> None:
    from lm_console.engine.errors import InvalidImageError
    from lm_console.engine.multimodal import image

    monkeypatch.setattr(image, "MAX_IMAGE_PIXELS", 100 * 100)
    with pytest.raises(InvalidImageError, match="101x100 pixels"):
        image.load_image(bomb_png(101, 100))
    assert image.load_image(bomb_png(100, 100)).image.size == (100, 100)


# -- item 5: the key before the body; read deadlines on headers and bodies ---------------------------
def raw_connection(server: ThreadServer) -> socket.socket:
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_response_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def closed_within(sock: socket.socket, bound_s: float, trickle: bytes = b"") -> bool:
    """Whether the server closes the connection within bound_s (while we send `trickle` every 0.2 s)."""
    deadline = time.monotonic() + bound_s
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if trickle:
                sock.sendall(trickle)
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_missing_key_is_refused_before_the_body_is_read(server) -> None:
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 30000000\r\n\r\n")  # and no body at all
        head = read_response_head(sock)
    assert head.startswith(b"HTTP/1.1 401"), head


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc"])
def test_docs_need_the_key(server, path) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert_openai_error(anonymous.get(path), 401)
        assert anonymous.get("/health").status_code == 200  # probes stay open
        assert anonymous.get(path, headers=AUTH).status_code == 200


def test_slow_headers_are_cut_off(server) -> None:
    with raw_connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert closed_within(sock, HEADER_TIMEOUT_S + 4.0, trickle=b"X-Slow: 1\r\n")


def test_idle_connection_without_a_request_is_cut_off(server) -> None:
    with raw_connection(server) as sock:
        assert closed_within(sock, HEADER_TIMEOUT_S + 4.0)


def test_slow_body_gets_408_and_is_closed(server) -> None:
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
        sock.settimeout(BODY_TIMEOUT_S + 5.0)
        head = read_response_head(sock)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert closed_within(sock, 3.0)


def test_trickled_body_after_an_early_answer_is_cut_off(server) -> None:
    """A 401 goes out before the body; the client trickling the rest of it is then cut off."""
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{")
        assert read_response_head(sock).startswith(b"HTTP/1.1 401")
        assert closed_within(sock, BODY_TIMEOUT_S + 6.0, trickle=b" ")


def test_a_slow_generation_is_not_cut_off(server, http_client) -> None:
    """The deadlines cover the client's sending, not the server's answer."""
    response = http_client.post("/v1/completions", json=completion(max_tokens=400, min_tokens=400))
    assert response.status_code == 200, response.text


# -- item 8: the product of the limits is bounded up front ------------------------------------------
def test_request_work_over_the_budget_is_refused_up_front(http_client) -> None:
    body = completion(prompt=["Hello", "World"], n=2, max_tokens=50, logprobs=20, echo=True)
    error = assert_openai_error(http_client.post("/v1/completions", json=body), 400)
    assert "--max-request-work" in error["message"] and str(MAX_WORK) in error["message"], error
    chat_body = chat("Hello", n=4, max_tokens=100, logprobs=True, top_logprobs=20)
    error = assert_openai_error(http_client.post("/v1/chat/completions", json=chat_body), 400)
    assert "--max-request-work" in error["message"], error
    assert_still_serving(http_client)


# -- item 3: constraints too large to compile in bounded time are refused ---------------------------
@pytest.mark.parametrize("field, value, phrase", [
    ("guided_choice", [f"choice number {i}" for i in range(10_000)], "--max-structured-output-choices"),
    ("guided_choice", ["x" * 2000 + str(i) for i in range(100)], "--max-structured-output-bytes"),
    ("guided_regex", "(ab|cd)" * 20_000, "--max-structured-output-bytes"),
], ids=["10000-choices", "200KB-choices", "140KB-regex"])
def test_oversized_constraint_is_refused_without_compiling(http_client, field, value, phrase) -> None:
    response = http_client.post("/v1/completions", json=completion(**{field: value}))
    error = assert_openai_error(response, 400, field)
    assert phrase in error["message"], error
    response = http_client.post("/v1/completions", json=completion(response_format={"type": "json_object"}))
    assert response.status_code == 200, response.text


# -- item 16: a choice and a min_tokens it cannot meet ------------------------------------------------
def test_choice_with_unreachable_min_tokens_is_a_clear_400(http_client) -> None:
    response = http_client.post("/v1/completions", json=completion(guided_choice=["yes"], min_tokens=6, max_tokens=16))
    error = assert_openai_error(response, 400, "min_tokens")
    assert "engine bug" not in error["message"] and "choice" in error["message"], error
    # Reachable in principle (one token a byte), not in practice: the grammar then allows only the
    # stop token that min_tokens masks; the request ends with that said, not with "an engine bug".
    response = http_client.post("/v1/completions", json=completion(guided_choice=["yes"], min_tokens=3,
                                                                   max_tokens=16))
    if response.status_code != 200:  # unless the model spelt "yes" a byte a token
        error = assert_openai_error(response, 400)
        assert "engine bug" not in error["message"] and "min_tokens=3" in error["message"], error


# -- item 10: image URLs: no private addresses, one deadline, texts that say nothing of the network --
SEEN_HOSTS: list[str] = []  # the Host header of each request the image host got
@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """/cat.png, /redirect (a redirect), /trickle (a byte every 0.3 s), /silent (no answer)."""
    payload = png_bytes(make_image(5))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            SEEN_HOSTS.append(self.headers.get("Host", ""))
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/cat.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/trickle":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.3)
            elif self.path == "/silent":
                time.sleep(5)
            else:
                self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "2130706433", "localhost"])
def test_image_url_to_a_loopback_address_is_refused(http_client, image_host, host) -> None:
    url = image_host.replace("127.0.0.1", host) + "/cat.png"
    error = assert_openai_error(http_client.post("/v1/chat/completions", json=image_chat(url)), 400, "messages")
    assert error["code"] == "image_url_not_allowed", error
    assert "--allow-private-media-urls" in error["message"], error


def loader(**settings):
    from lm_console.engine.entrypoints.openai.media import MediaLoader
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    return MediaLoader(ServerSettings(**settings))


def fetch(media, url: str):
    async def run():
        try:
            return await media.load(url)
        finally:
            await media.aclose()

    return asyncio.run(run())


def test_image_fetch_has_one_deadline_for_the_whole_fetch(image_host) -> None:
    from lm_console.engine.entrypoints.openai.errors import OpenAIError

    start = time.monotonic()
    with pytest.raises(OpenAIError, match="within 1 s") as caught:
        fetch(loader(allow_private_media_urls=True, media_fetch_timeout_s=1.0), image_host + "/trickle")
    assert caught.value.status == 400
    assert time.monotonic() - start < 10  # a byte every 0.3 s would otherwise hold it 30 s


def test_each_redirect_hop_is_checked(image_host, monkeypatch) -> None:
    from lm_console.engine.entrypoints.openai import media
    from lm_console.engine.entrypoints.openai.errors import OpenAIError

    # Stand-in for "127.0.0.1 is public, localhost is not": the first hop passes, the redirect does not.
    monkeypatch.setattr(media, "_is_public", lambda address: True)
    checked: list[str] = []
    original = media.MediaLoader._check_host

    async def check_host(self, url: str, current: str) -> None:
        checked.append(current)
        if urllib.parse.urlparse(current).hostname == "localhost":
            raise media.bad_request("private", "messages", "image_url_not_allowed")
        await original(self, url, current)

    monkeypatch.setattr(media.MediaLoader, "_check_host", check_host)
    with pytest.raises(OpenAIError, match="private") as caught:
        fetch(loader(), image_host + "/redirect")
    assert len(checked) == 2 and "localhost" in checked[1], (checked, caught.value.message)


def test_a_fetch_connects_to_the_address_it_checked(image_host, monkeypatch) -> None:
    """No second DNS answer is trusted: the checked address is dialled, with the URL's own Host."""
    from lm_console.engine.entrypoints.openai import media

    checked: list[str] = []

    def is_public(address: str) -> bool:
        checked.append(address)
        return True  # stand-in: a test cannot reach a public address

    monkeypatch.setattr(media, "_is_public", is_public)
    port = image_host.rsplit(":", 1)[1]
    SEEN_HOSTS.clear()
    raw = fetch(loader(), f"http://localhost:{port}/cat.png")  # may resolve to ::1 first: the next is tried
    assert raw == png_bytes(make_image(5))
    assert "127.0.0.1" in checked and SEEN_HOSTS == [f"localhost:{port}"], (checked, SEEN_HOSTS)


def test_fetch_errors_do_not_tell_a_closed_port_from_a_silent_one(image_host) -> None:
    from lm_console.engine.entrypoints.openai.errors import OpenAIError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/x.png"
    messages = []
    for url in (closed, image_host + "/silent"):
        with pytest.raises(OpenAIError) as caught:
            fetch(loader(allow_private_media_urls=True, media_fetch_timeout_s=1.0), url)
        messages.append(caught.value.message.replace(url, "URL"))
    assert messages[0] == messages[1], messages
    assert "refused" not in messages[0].lower() and "errno" not in messages[0].lower(), messages
