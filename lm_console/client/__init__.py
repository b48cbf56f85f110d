"""Engine clients for the console: the ConsoleClient protocol, the AsyncLLM adapter, a running
server's client (RemoteConsoleClient, over HTTP) and a fake.

Importing this package stays light (no torch): AsyncLLMConsoleClient imports the engine's
frontend only when it starts, and the fake runs the engine core over the torch-free FakeExecutor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_console._lazy import lazy_exports

if TYPE_CHECKING:
    from lm_console.client.asyncllm import AsyncLLMConsoleClient
    from lm_console.client.fake import FakeConsoleClient
    from lm_console.client.protocol import ChatMessages, ConsoleClient
    from lm_console.client.remote import RemoteConsoleClient
    from lm_console.client.types import (
        EngineInfo, EngineUnavailable, GenParams, KVEventRecord, StatsSnapshot, StreamChunk,
    )

__all__ = [
    "ChatMessages", "ConsoleClient", "EngineInfo", "EngineUnavailable", "FakeConsoleClient", "GenParams",
    "KVEventRecord", "StatsSnapshot", "StreamChunk", "AsyncLLMConsoleClient", "RemoteConsoleClient",
]

__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["EngineInfo", "EngineUnavailable", "GenParams", "KVEventRecord", "StatsSnapshot", "StreamChunk"],
                    "lm_console.client.types"),
    "ChatMessages": "lm_console.client.protocol",
    "ConsoleClient": "lm_console.client.protocol",
    "FakeConsoleClient": "lm_console.client.fake",
    "AsyncLLMConsoleClient": "lm_console.client.asyncllm",  # imports the engine's frontend only when it starts
    "RemoteConsoleClient": "lm_console.client.remote",  # httpx only: a running server's client (lmc tui --url)
})
