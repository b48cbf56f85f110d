"""Start `lmc serve` on a free 127.0.0.1 port for a benchmark, wait until it is ready, stop it after.

`lmc bench serve` without --url measures over HTTP against a server of its own, so the numbers
include what a client sees (HTTP, JSON, SSE). The server runs as `python -m lm_console.cli serve
[MODEL] --host 127.0.0.1 --port P [engine flags]`; readiness is GET /health answering 200.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

class ServeLaunchError(RuntimeError):
    """`lmc serve` is missing, exited, or did not become ready; the message says which and why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_flags(engine_args: dict[str, Any]) -> list[str]:
    """`lmc serve` flags for these EngineArgs keywords (each knob's own flag, from its declaration)."""
    from lm_console.engine_options import serve_flags as flags_of

    return flags_of(engine_args)


def serve_command(model: str | None, port: int, engine_args: dict[str, Any]) -> list[str]:
    """The command line of `lmc serve` with this interpreter; ServeLaunchError when it is not installed."""
    if importlib.util.find_spec("lm_console.cli_serve") is None:
        raise ServeLaunchError(
            "`lmc serve` is not available in this installation (no lm_console/cli_serve.py), so `lmc bench serve` "
            "cannot start a server of its own. Pass --url http://HOST:PORT to measure a running server, or "
            "--in-process to measure AsyncLLM without HTTP.")
    return [sys.executable, "-m", "lm_console.cli", "serve", *([model] if model else []),
            "--host", "127.0.0.1", "--port", str(port), *serve_flags(engine_args)]


class ServeProcess:
    """`with ServeProcess(command, port) as url:` runs the server for the block's duration."""

    def __init__(self, command: list[str], port: int, api_key: str | None = None,
                 startup_timeout_s: float = 900.0, stop_timeout_s: float = 30.0) -> None:
        self.command = command
        self.port = port
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        log = tempfile.NamedTemporaryFile(prefix="lmc-bench-serve-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        env = dict(os.environ)
        if self.api_key:
            env["LMC_API_KEY"] = self.api_key
        print(f"Starting `{' '.join(self.command[2:])}` (log: {self.log_path})…", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            code = self.process.poll()
            if code is not None:
                raise ServeLaunchError(f"`lmc serve` exited with code {code} before it was ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServeLaunchError(f"`lmc serve` was not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGINT (the server drains and exits), then SIGKILL if it does not."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, num_lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
