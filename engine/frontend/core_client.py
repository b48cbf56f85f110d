"""EngineCoreClient: how the frontend talks to the EngineCore (seed: 1257-1332).

InprocClient runs the core in this process (tests, debugging, the offline LLM for now); the
multiprocess clients (ZMQ) implement the same methods.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    """The EngineCore in the caller's process: get_output() runs one step."""

    def __init__(self, config: EngineConfig) -> None:
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

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
