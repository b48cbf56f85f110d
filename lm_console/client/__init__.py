"""Engine clients for the console: the ConsoleClient protocol, the AsyncLLM adapter, a running
server's client (RemoteConsoleClient, over HTTP) and a fake.

Importing this package stays light (no torch): AsyncLLMConsoleClient imports the engine only
when it starts.
"""

from __future__ import annotations

from lm_console.client.fake import FakeConsoleClient
from lm_console.client.protocol import ChatMessages, ConsoleClient
from lm_console.client.types import (
    BLOCK_CACHED, BLOCK_FREE, BLOCK_IN_USE, BLOCK_NULL, EngineInfo, EngineUnavailable, GenParams,
    KVEventRecord, StatsSample, StreamChunk,
)

__all__ = [
    "BLOCK_CACHED", "BLOCK_FREE", "BLOCK_IN_USE", "BLOCK_NULL", "ChatMessages", "ConsoleClient",
    "EngineInfo", "EngineUnavailable", "FakeConsoleClient", "GenParams", "KVEventRecord",
    "StatsSample", "StreamChunk", "AsyncLLMConsoleClient", "RemoteConsoleClient",
]


def __getattr__(name: str):  # noqa: ANN202
    if name == "AsyncLLMConsoleClient":
        from lm_console.client.asyncllm import AsyncLLMConsoleClient

        return AsyncLLMConsoleClient
    if name == "RemoteConsoleClient":  # httpx only: a running server's client (lmc tui --url)
        from lm_console.client.remote import RemoteConsoleClient

        return RemoteConsoleClient
    raise AttributeError(name)
