"""Engine clients for the console: the ConsoleClient protocol, the AsyncLLM adapter, a running
server's client (RemoteConsoleClient, over HTTP) and a fake.

Importing this package stays light (no torch): AsyncLLMConsoleClient imports the engine's
frontend only when it starts, and the fake runs the engine core over the torch-free FakeExecutor.
"""

from __future__ import annotations

from lm_console.client.fake import FakeConsoleClient
from lm_console.client.protocol import ChatMessages, ConsoleClient
from lm_console.client.types import (
    EngineInfo, EngineUnavailable, GenParams, KVEventRecord, StatsSnapshot, StreamChunk,
)

__all__ = [
    "ChatMessages", "ConsoleClient", "EngineInfo", "EngineUnavailable", "FakeConsoleClient", "GenParams",
    "KVEventRecord", "StatsSnapshot", "StreamChunk", "AsyncLLMConsoleClient", "RemoteConsoleClient",
]


def __getattr__(name: str):  # noqa: ANN202
    if name == "AsyncLLMConsoleClient":
        from lm_console.client.asyncllm import AsyncLLMConsoleClient

        return AsyncLLMConsoleClient
    if name == "RemoteConsoleClient":  # httpx only: a running server's client (lmc tui --url)
        from lm_console.client.remote import RemoteConsoleClient

        return RemoteConsoleClient
    raise AttributeError(name)
