"""`lmc serve` as a process: SIGTERM drains (exit 0), the shutdown timeout aborts what is left,
and SIGKILL of the engine core ends streams with an error event, turns /health to 503 and makes
the server exit non-zero so that a supervisor restarts it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from openai_server_helpers import ServeProcess, ThreadServer, assert_openai_error

SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--num-blocks", "1024", "--num-threads", "1")


class StreamReader:
    """Reads one streaming completion in a thread; `first_chunk` is set once text flows."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url = url
        self.body = {"prompt": "The history of computing is", "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self.events: list = []
        self.error: BaseException | None = None
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120) as http, \
                    http.stream("POST", "/v1/completions", json=self.body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line:
                        data = line.removeprefix("data: ")
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first_chunk.set()
        except BaseException as error:  # noqa: BLE001 - checked by the test
            self.error = error
        finally:
            self.first_chunk.set()

    def join(self) -> list:
        self.thread.join(120)
        assert not self.thread.is_alive()
        assert self.error is None, self.error
        return self.events

    def text_and_finish(self) -> tuple[str, str | None, dict | None]:
        chunks = [e for e in self.events if isinstance(e, dict) and e.get("choices")]
        usage = next((e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")), None)
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"], usage


def poll_health(url: str, status: int, timeout: float = 30.0) -> float:
    """Seconds until /health answers `status`."""
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=5) as http:
        while time.perf_counter() - started < timeout:
            if http.get("/health").status_code == status:
                return time.perf_counter() - started
            time.sleep(0.02)
    raise AssertionError(f"/health never answered {status}")


@pytest.mark.slow
def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(tiny_llama_dir) -> None:
    server = ServeProcess(str(tiny_llama_dir), *SERVER_ARGS, "--shutdown-timeout", "60")
    try:
        stream = StreamReader(server.url, max_tokens=300)
        assert stream.first_chunk.wait(60)
        started = time.perf_counter()
        server.signal(signal.SIGTERM)
        poll_health(server.url, 503)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            refused = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert assert_openai_error(refused, 503)["code"] == "server_shutting_down"
            assert http.get("/metrics").status_code == 200  # still scrapeable while draining
        events = stream.join()
        text, finish, usage = stream.text_and_finish()
        assert events[-1] == "[DONE]" and finish == "length" and usage["completion_tokens"] == 300
        code = server.wait(60)
        print(f"\ndrain: the in-flight stream finished and the server exited {time.perf_counter() - started:.2f} s "
              "after SIGTERM")
    finally:
        server.kill()
    assert code == 0, server.output[-3000:]
    assert "draining" in server.output


@pytest.mark.slow
def test_shutdown_timeout_aborts_what_is_left(tiny_llama_dir) -> None:
    server = ServeProcess(str(tiny_llama_dir), *SERVER_ARGS, "--shutdown-timeout", "0")
    try:
        stream = StreamReader(server.url, max_tokens=1000)
        assert stream.first_chunk.wait(60)
        server.signal(signal.SIGTERM)
        events = stream.join()
        _, finish, usage = stream.text_and_finish()
        assert events[-1] == "[DONE]" and finish == "abort" and usage["completion_tokens"] < 1000
        code = server.wait(60)
    finally:
        server.kill()
    assert code == 0, server.output[-3000:]


@pytest.mark.slow
def test_engine_core_sigkill_ends_streams_with_an_error_and_exits_non_zero(tiny_llama_dir) -> None:
    server = ServeProcess(str(tiny_llama_dir), *SERVER_ARGS)
    try:
        stream = StreamReader(server.url, max_tokens=1000)
        assert stream.first_chunk.wait(60)
        os.kill(server.core_pid, signal.SIGKILL)
        seconds_to_503 = poll_health(server.url, 503)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            error = assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
            assert error["code"] == "engine_dead" and "died" in error["message"]
        events = stream.join()
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_dead", events[-2]
        code = server.wait(60)
        print(f"\nengine core SIGKILL: /health 503 after {seconds_to_503:.3f} s, server exit code {code}")
    finally:
        server.kill()
    assert code == 1, server.output[-3000:]


def test_a_drain_does_not_wait_for_an_attached_console(tiny_llama_dir) -> None:
    """A console stream holds no engine request: the drain ignores it and then ends it."""
    from lm_console.engine.entrypoints.openai.settings import ServerSettings

    # A drain that waited for the console would sit out this timeout instead of exiting at once.
    settings = ServerSettings(shutdown_timeout_s=600.0)
    server = ThreadServer(str(tiny_llama_dir), settings, dtype="float32", max_model_len=256,
                          num_gpu_blocks_override=64, stat_loggers=[])
    try:
        lines: list[str] = []
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=120)) as http, \
                http.stream("GET", "/lmc/v1/stream", params={"topics": "stats"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if line == "event: hello" and len(lines) == 1:
                    # Attached, and not counted as a request in flight.
                    assert server.app.state.server_state.num_inflight == 0
                    server.server.request_drain()
    finally:
        server.stop()
    assert server.exit_code == 0
    assert lines[0] == "event: hello" and ": the server is shutting down" in lines  # ended by the server

