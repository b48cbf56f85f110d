"""The console header names the KV cache's type where it is not the model's."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult

from lm_console.client.types import EngineInfo
from lm_console.tui.widgets.engine_status import EngineStatus, _remote_header

INFO = dict(model="m", device="cpu", dtype="bfloat16", block_size=16, num_blocks=160, max_num_batched_tokens=2048,
            max_num_seqs=128)


def _local_header(info: EngineInfo) -> str:
    class Header(App):
        def compose(self) -> ComposeResult:
            yield EngineStatus(id="status")

    async def scenario() -> str:
        app = Header()
        async with app.run_test():
            status = app.query_one(EngineStatus)
            status.show(info, "serving")
            return str(status.render())

    return asyncio.run(scenario())


def test_an_int8_cache_is_named_and_the_models_own_type_is_not():
    assert "bfloat16 · kv int8 · block 16" in _local_header(EngineInfo(**INFO, kv_cache_dtype="int8"))
    for same in ("bfloat16", None):
        assert "bfloat16 · block 16" in _local_header(EngineInfo(**INFO, kv_cache_dtype=same))
    remote = _remote_header(EngineInfo(**INFO, kv_cache_dtype="int8", url="http://127.0.0.1:8000"))
    assert "cpu · bfloat16 · kv int8 · block 16" in remote
    assert "kv" not in _remote_header(EngineInfo(**INFO, kv_cache_dtype="?", url="http://127.0.0.1:8000"))
