"""A real vLLM server (vLLM's CPU build from its own venv) over the embedded model, with KV events on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from vllm_helpers import vllm_venv

STARTUP_DEADLINE_S = 1800  # a liveness bound: vLLM compiles its model on first start (minutes on 2 cores)


@dataclass(frozen=True)
class VLLMServer:
    url: str
    kv_events_endpoint: str
    model: str
    log: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    venv = vllm_venv()
    if venv is None:  # the collection hook skips `vllm` tests first; this guards a direct use
        pytest.skip("no vLLM venv (LMC_TEST_VLLM_VENV)")
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VLLMServer]:
    """`python -m vllm.entrypoints.openai.api_server` on free ports; stopped at the end of the session.

    LMC_TEST_VLLM_URL and LMC_TEST_VLLM_KV_EVENTS (tests only) name a vLLM server already running with
    KV events on instead, to rerun the tests without another start (minutes).
    """
    if os.environ.get("LMC_TEST_VLLM_URL"):
        yield VLLMServer(os.environ["LMC_TEST_VLLM_URL"].rstrip("/"), os.environ["LMC_TEST_VLLM_KV_EVENTS"],
                         str(embedded_model_dir), Path("/dev/null"))
        return
    port, events_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    command = ["nice", "-n", "10", str(vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               # Eager: the console does not care how fast vLLM runs, and compiling costs minutes on 2 cores.
               "--model", str(embedded_model_dir), "--served-model-name", "SmolLM2-135M-Instruct", "--enforce-eager",
               "--port", str(port), "--max-model-len", "2048",
               "--kv-events-config",
               f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events_port}"}}']
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + STARTUP_DEADLINE_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with {process.returncode} while starting; its log:\n"
                            f"{log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, f"vLLM did not start within {STARTUP_DEADLINE_S} s; log: {log}"
            time.sleep(2)
        yield VLLMServer(url, f"tcp://127.0.0.1:{events_port}", str(embedded_model_dir), log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # its own session: the engine core goes too
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
