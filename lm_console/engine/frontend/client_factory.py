"""Which EngineCoreClient a frontend gets: in-process, one core process, or data_parallel_size of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lm_console.engine.config.engine_args import EngineArgs
from lm_console.engine.frontend.core_client import EngineCoreClient, InprocClient
from lm_console.engine.frontend.dp_client import AsyncDPClient, SyncDPClient
from lm_console.engine.frontend.mp_client import AsyncMPClient, SyncMPClient
from lm_console.engine.platform import apply_openmp_wait_environment
from lm_console.engine.startup_trace import mark

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig


def make_client(engine_args: EngineArgs, while_starting: Callable[[], None] | None = None,
                on_config: Callable[[EngineConfig], None] | None = None,
                ) -> tuple[EngineCoreClient, EngineConfig]:
    """The client LLM uses and the frontend config: SyncDPClient for data_parallel_size > 1 or Ray cores,
    SyncMPClient by default, InprocClient with multiprocess=False.

    while_starting runs while separate core processes start (not for the in-process core).
    on_config (in-process core only) gets the resolved config before the weights load, so the
    caller can start work that needs only the config (the tokenizer, on a thread) meanwhile.
    """
    if engine_args.uses_data_parallel_client:
        client: EngineCoreClient = SyncDPClient(engine_args, while_starting=while_starting)
        return client, engine_args.create_frontend_config(client.ready_info)  # type: ignore[attr-defined]
    if engine_args.multiprocess:
        mp_client = SyncMPClient(engine_args, while_starting=while_starting)
        return mp_client, engine_args.create_frontend_config(mp_client.ready_info)
    apply_openmp_wait_environment()  # the in-process core: before torch's first import, where it is not in yet
    config = engine_args.create_engine_config()
    mark("config")
    if on_config is not None:
        on_config(config)
    inproc = InprocClient(config)
    return inproc, inproc.engine_core.config  # the core's config, with num_blocks decided


def make_async_client(engine_args: EngineArgs, while_starting: Callable[[], None] | None = None
                      ) -> AsyncMPClient | AsyncDPClient:
    """The client AsyncLLM uses: AsyncDPClient for data_parallel_size > 1, else AsyncMPClient."""
    if engine_args.uses_data_parallel_client:
        return AsyncDPClient(engine_args, while_starting=while_starting)
    return AsyncMPClient(engine_args, while_starting=while_starting)


__all__ = ["make_async_client", "make_client"]
