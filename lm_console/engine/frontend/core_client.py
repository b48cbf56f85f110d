"""EngineCoreClient: how the frontend talks to the EngineCore.

InprocClient runs the core in this process (tests, debugging, `multiprocess=False`);
SyncMPClient (LLM's default) and AsyncMPClient (AsyncLLM) run it in its own process
(lm_console/engine/frontend/mp_client.py), SyncDPClient / AsyncDPClient several cores (dp_client.py);
lm_console/engine/frontend/client_factory.py picks one. All share this interface; utility calls behave the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lm_console.engine.protocol import EngineCoreOutputs, EngineCoreRequest

if TYPE_CHECKING:
    from lm_console.engine.config.engine_config import EngineConfig
    from lm_console.engine.metrics.stats import BlockPoolState, SchedulerStats


class EngineCoreClient:
    """The frontend's handle on one engine core."""

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Add several requests at once (one message to a separate core process)."""
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (in-process: runs one step)."""
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run an EngineCore utility method (reset_prefix_cache, get_stats, ...) and return its result."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    # -- utility shorthands -----------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def get_block_pool_state(self) -> BlockPoolState:
        return self.call_utility("get_block_pool_state")


class InprocClient(EngineCoreClient):
    """The EngineCore in the caller's process: get_output() runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        from lm_console.engine.core.engine_core import EngineCore  # torch: only on this path

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, _ = self.engine_core.step()
        return outputs.get(0) or EngineCoreOutputs()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        from lm_console.engine.core.engine_core_proc import UTILITY_METHODS

        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; allowed: {sorted(UTILITY_METHODS)}")
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
