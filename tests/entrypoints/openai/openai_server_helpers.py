"""Servers for the tests: in a thread of this process (engine access), or `lmc serve` as a subprocess.

Both listen on 127.0.0.1 on an ephemeral port. ThreadServer lets a test call the engine on the
server's own loop (get_stats, get_block_pool_state); ServeProcess runs the real CLI, for the
signal, engine-death and RSS tests.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 180.0
REPO_ROOT = Path(__file__).resolve().parents[3]


class ThreadServer:
    """AsyncLLM + the app under uvicorn in a daemon thread; stop() drains it and shuts down."""

    def __init__(self, model: str, settings: Any = None, **engine_args: Any) -> None:
        from lm_console.engine import AsyncLLM
        from lm_console.engine.entrypoints.openai.api_server import build_app
        from lm_console.engine.entrypoints.openai.lifecycle import ApiServer, bind_socket
        from lm_console.engine.entrypoints.openai.settings import ServerSettings

        self.settings = settings or ServerSettings()
        self.engine = AsyncLLM(model, **engine_args)
        try:
            self.app = build_app(self.engine, self.settings)
            self.server = ApiServer(self.app, self.settings, bind_socket("127.0.0.1", 0))
        except BaseException:
            self.engine.shutdown()
            raise
        self.url = self.server.url
        self.exit_code: int | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ThreadServer", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the server did not start")

    def _run(self) -> None:
        self.exit_code = asyncio.run(self.server.run(on_ready=lambda url: self._ready.set()))

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (e.g. engine.get_block_pool_state())."""
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout)

    def wait_idle(self, timeout: float = 60.0) -> Any:
        """Poll until the engine holds no request; returns the final BlockPoolState."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.call(self.engine.get_block_pool_state())
            if state.all_free or time.monotonic() > deadline:
                return state
            time.sleep(0.05)

    def stop(self) -> None:
        if self._thread.is_alive() and self.server.loop is not None:
            self.server.request_drain()
            self._thread.join(60)
        self.engine.shutdown()


class ServeProcess:
    """`python -m lm_console.cli serve MODEL --port 0 ...`; the URL and core pid come from stdout."""

    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "lm_console.cli", "serve", model, "--host", "127.0.0.1", "--port", "0",
                   *args]
        environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=environment, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url, self.core_pid = self._wait_ready()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def _wait_ready(self) -> tuple[str, int]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            match = re.search(r"ready at (http://\S+) .*engine core pid (\d+)", line)
            if match:
                return match.group(1), int(match.group(2))
        self.kill()
        raise RuntimeError("lmc serve did not start:\n" + "".join(self.lines[-40:]))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def stop(self) -> int | None:
        """SIGTERM (a drain), then SIGKILL if it does not exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


def completion_body(**fields: Any) -> dict[str, Any]:
    body = {"prompt": "The history of computing", "max_tokens": 8, "temperature": 0.0}
    body.update(fields)
    return body


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The response has `status` and OpenAI's error shape; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def read_sse(response: httpx.Response) -> list[Any]:
    """The data payloads of an SSE response: dicts, then the string "[DONE]"."""
    import json

    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def parse_metrics(text: str) -> dict[str, Any]:
    """name -> MetricFamily, with prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_value(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    """The one sample `name + suffix` whose labels include `labels`."""
    family = families[name]
    values = [s.value for s in family.samples
              if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, (name, suffix, labels, family.samples)
    return values[0]
